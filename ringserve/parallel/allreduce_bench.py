"""`ringserve bench allreduce`: time every allreduce backend per message size on N local
ranks, print the table, and store the thresholds that `auto` then uses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringserve.parallel.allreduce import AllReduce, save_thresholds
from ringserve.parallel.local_world import collective_latency_us, run_local_world

ALGORITHMS = ("torch", "one_shot", "two_shot")
DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _time_rank(rank: int, world_size: int, sizes: list[int], iters: int, device_type: str) -> dict:
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    results = {}
    ops = {name: AllReduce(dist.group.WORLD, name, device) for name in ALGORITHMS}
    for nbytes in sizes:
        x = torch.randn(
            max(1, nbytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype, device=device
        )
        for name, op in ops.items():
            results[(nbytes, name)] = collective_latency_us(lambda op=op, x=x: op(x), iters, device_type)
    return results


def thresholds_from(latency_us: dict, sizes: list[int]) -> dict:
    """Bands from the smallest size up: one_shot while it is the fastest, then two_shot
    while a direct-access algorithm is, then torch for everything larger."""
    one_shot_max = two_shot_max = 0
    band = "one_shot"
    for nbytes in sorted(sizes):
        best = min(ALGORITHMS, key=lambda a: latency_us[(nbytes, a)])
        if band == "one_shot" and best == "one_shot":
            one_shot_max = two_shot_max = nbytes
        elif best in ("one_shot", "two_shot") and band != "torch":
            band, two_shot_max = "two_shot", nbytes
        else:
            break
    return {"one_shot_max_bytes": one_shot_max, "two_shot_max_bytes": two_shot_max}


def run(world_size: int, device_type: str, sizes: list[int], iters: int, save: bool) -> dict:
    latency = run_local_world(
        _time_rank, world_size, sizes, iters, device_type, device_type=device_type, timeout_s=600
    )[0]
    print(f"allreduce latency (us, median of {iters}) on {world_size} {device_type} ranks")
    print(f"{'bytes':>10s} " + " ".join(f"{a:>10s}" for a in ALGORITHMS) + "   fastest")
    for nbytes in sizes:
        row = [latency[(nbytes, a)] for a in ALGORITHMS]
        print(
            f"{nbytes:>10d} " + " ".join(f"{v:10.1f}" for v in row) + f"   {ALGORITHMS[row.index(min(row))]}"
        )
    thresholds = thresholds_from(latency, sizes)
    print(f"auto thresholds: {thresholds}")
    if save:
        print(f"saved to {save_thresholds(device_type, world_size, thresholds)}")
    return thresholds
