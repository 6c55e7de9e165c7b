"""`ringserve bench cp-calibrate`: measure the two rates that choose pass-KV or pass-Q.

C: attention FLOP/s of one rank (an unmasked block through the engine's block kernel).
BW: bytes/s of one ring hop between two local ranks (isend/irecv, as the ring does).
Stored per device type; `cp_algo=auto` reads them (CPCalibration.load).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ringserve.attention import _dense_block
from ringserve.measurements import save_measurement
from ringserve.parallel.cp import CPCalibration
from ringserve.parallel.local_world import run_local_world


def measure_attention_flops(device_type: str) -> float:
    if device_type == "cuda":
        length, heads, kv_heads, dim, dtype = 8192, 32, 8, 128, torch.bfloat16
    else:
        length, heads, kv_heads, dim, dtype = 512, 8, 2, 64, torch.float32
    device = torch.device(device_type)
    q = torch.randn(length, heads, dim, device=device, dtype=dtype)
    k = torch.randn(length, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn(length, kv_heads, dim, device=device, dtype=dtype)
    times = []
    for i in range(8):
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _dense_block(q, k, v, False, dim**-0.5)
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 4 * length * length * heads * dim / min(times)


def _ring_hop(rank: int, world_size: int, nbytes: int, device_type: str) -> float:
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    send = torch.randn(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(6):
        dist.barrier()
        start = time.perf_counter()
        ops = [dist.isend(send, (rank + 1) % world_size), dist.irecv(recv, (rank - 1) % world_size)]
        for op in ops:
            op.wait()
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return nbytes / min(times)


def run(device_type: str, save: bool = True) -> CPCalibration:
    flops = measure_attention_flops(device_type)
    nbytes = (256 << 20) if device_type == "cuda" else (16 << 20)
    bandwidth = min(
        run_local_world(_ring_hop, 2, nbytes, device_type, device_type=device_type, timeout_s=120)
    )
    result = CPCalibration(attention_flops=flops, link_bytes_per_s=bandwidth)
    print(f"attention {flops / 1e12:.3f} TFLOP/s, ring hop {bandwidth / 1e9:.2f} GB/s ({device_type})")
    if save:
        value = {"attention_flops": flops, "link_bytes_per_s": bandwidth}
        print(f"saved to {save_measurement('cp_calibration', value, device_type)}")
    return result
