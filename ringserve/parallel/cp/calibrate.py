"""`ringserve bench cp-calibrate`: measure the two rates that choose pass-KV or pass-Q.

C: attention FLOP/s of one rank (an unmasked block through the engine's block kernel).
BW: bytes/s of one ring hop between two local ranks (isend/irecv, as the ring does).
Each is timed `repeats` times after a warm-up and stored as the median, per device type;
`cp_algo=auto` reads them (CPCalibration.load). A rate most repeats disagree with (a noisy
machine) is not stored.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from ringserve.attention.dense import dense_block
from ringserve.measurements import DEFAULT_REPEATS, save_measurement, save_unless_contradicted
from ringserve.parallel.cp.policy import CPCalibration
from ringserve.parallel.local_world import run_local_world

_WARMUP = 2
# A stored rate must be within this factor of at least half of the repeats it came from:
# loose enough for a busy machine, tight enough to refuse one lucky timing (a rate 4x the rest).
AGREEMENT = 2.0


def measure_attention_flops(device_type: str, repeats: int = DEFAULT_REPEATS) -> list[float]:
    """One rank's attention FLOP/s, once per repeat."""
    if device_type == "cuda":
        length, heads, kv_heads, dim, dtype = 8192, 32, 8, 128, torch.bfloat16
    else:
        length, heads, kv_heads, dim, dtype = 512, 8, 2, 64, torch.float32
    device = torch.device(device_type)
    q = torch.randn(length, heads, dim, device=device, dtype=dtype)
    k = torch.randn(length, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn(length, kv_heads, dim, device=device, dtype=dtype)
    rates = []
    for i in range(_WARMUP + repeats):
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dense_block(q, k, v, False, dim**-0.5)
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= _WARMUP:
            rates.append(4 * length * length * heads * dim / (time.perf_counter() - start))
    return rates


def _ring_hop(rank: int, world_size: int, nbytes: int, repeats: int, device_type: str) -> list[float]:
    """This rank's time of each repeat's hop (send to the next rank, receive from the previous)."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    send = torch.randn(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(_WARMUP + repeats):
        dist.barrier()
        start = time.perf_counter()
        ops = [dist.isend(send, (rank + 1) % world_size), dist.irecv(recv, (rank - 1) % world_size)]
        for op in ops:
            op.wait()
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= _WARMUP:
            times.append(time.perf_counter() - start)
    return times


def measure_ring_bandwidth(device_type: str, repeats: int = DEFAULT_REPEATS) -> list[float]:
    """Bytes/s of one ring hop between two local ranks, once per repeat (a hop ends when
    its slower rank does)."""
    nbytes = (256 << 20) if device_type == "cuda" else (16 << 20)
    per_rank = run_local_world(
        _ring_hop, 2, nbytes, repeats, device_type, device_type=device_type, timeout_s=120
    )
    return [nbytes / max(times) for times in zip(*per_rank)]


def calibration_from(flops: list[float], bandwidth: list[float]) -> CPCalibration:
    """The medians over the repeats."""
    return CPCalibration(
        attention_flops=statistics.median(flops), link_bytes_per_s=statistics.median(bandwidth)
    )


def contradictions(flops: list[float], bandwidth: list[float], calibration: CPCalibration) -> list[str]:
    """Why the calibration does not stand for its repeats (each as a sentence; empty if it
    does): a rate that is not a positive finite number, or that fewer than half of the
    repeats are within AGREEMENT times of (one lucky or unlucky timing, or a machine too
    busy to measure)."""
    found = []
    rates = (
        ("attention", calibration.attention_flops, flops, 1e12, "TFLOP/s"),
        ("ring hop", calibration.link_bytes_per_s, bandwidth, 1e9, "GB/s"),
    )
    for name, value, samples, scale, unit in rates:
        if not (math.isfinite(value) and value > 0):
            found.append(f"{name} rate {value} is not a positive number")
            continue
        agree = sum(value / AGREEMENT <= s <= value * AGREEMENT for s in samples)
        if 2 * agree < len(samples):
            found.append(
                f"{name} {value / scale:.3g} {unit} but only {agree} of {len(samples)} repeats "
                f"within {AGREEMENT}x of it ({', '.join(f'{s / scale:.3g}' for s in samples)})"
            )
    return found


def run(device_type: str, save: bool = True, repeats: int = DEFAULT_REPEATS) -> CPCalibration:
    """Measure, print the repeats and the medians, and store them unless the repeats
    contradict them (MeasurementRejected; the stored calibration stays as it was)."""
    flops = measure_attention_flops(device_type, repeats)
    bandwidth = measure_ring_bandwidth(device_type, repeats)
    result = calibration_from(flops, bandwidth)
    print(f"{'repeat':>6s} {'TFLOP/s':>10s} {'GB/s':>10s}")
    for i, (c, bw) in enumerate(zip(flops, bandwidth)):
        print(f"{i:>6d} {c / 1e12:10.4f} {bw / 1e9:10.3f}")
    print(
        f"attention {result.attention_flops / 1e12:.3f} TFLOP/s, ring hop "
        f"{result.link_bytes_per_s / 1e9:.2f} GB/s ({device_type}, medians of {repeats})"
    )
    value = {"attention_flops": result.attention_flops, "link_bytes_per_s": result.link_bytes_per_s}
    save_unless_contradicted(
        [f"the calibration contradicts its repeats: {p}" for p in contradictions(flops, bandwidth, result)],
        "Re-run with more --repeats on an idle machine",
        save,
        lambda: save_measurement("cp_calibration", value, device_type),
    )
    return result
