"""`ringserve bench allreduce`: time every allreduce backend per message size on N local
ranks, print the table, and store the thresholds that `auto` then uses.

The sweep is repeated (sizes and backends visited in a rotated order each time) and every
cell of the table is the median over the repeats, so one noisy timing, e.g. the first
collective of a freshly started communicator, cannot decide a band. The thresholds are the
size bands `auto` can follow (one_shot, then two_shot, then torch as messages grow) that fit
that table best, and they are saved only if no size contradicts the table.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ringserve.measurements import DEFAULT_REPEATS, save_unless_contradicted
from ringserve.parallel.allreduce import AllReduce, backend_for, save_thresholds
from ringserve.parallel.local_world import collective_latency_us, run_local_world

ALGORITHMS = ("torch", "one_shot", "two_shot")
DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# A backend within 10% of a size's fastest median is as good as the fastest there: smaller
# differences do not survive a re-run. auto using a backend slower than that contradicts
# the table.
TOLERANCE = 0.10


def _time_rank(rank: int, world_size: int, sizes: list[int], iters: int, repeats: int, device_type: str):
    """(nbytes, algorithm) -> that cell's latency in us, one value per repeat."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    element = torch.empty((), dtype=dtype).element_size()
    inputs = {n: torch.randn(max(1, n // element), dtype=dtype, device=device) for n in sizes}
    ops = {name: AllReduce(dist.group.WORLD, name, device) for name in ALGORITHMS}
    samples = {(n, name): [] for n in sizes for name in ALGORITHMS}
    for repeat in range(repeats):
        # Rotated per repeat, so no size or backend is always the one that runs first.
        order = sizes[repeat % len(sizes) :] + sizes[: repeat % len(sizes)]
        names = ALGORITHMS[repeat % 3 :] + ALGORITHMS[: repeat % 3]
        for nbytes in order:
            for name in names:
                op, x = ops[name], inputs[nbytes]
                samples[(nbytes, name)].append(
                    collective_latency_us(lambda op=op, x=x: op(x), iters, device_type)
                )
    return samples


def measure(world_size: int, device_type: str, sizes: list[int], iters: int, repeats: int) -> dict:
    """(nbytes, algorithm) -> latencies in us (one per repeat; the slowest rank's median of
    iters), timed on world_size local ranks."""
    return run_local_world(
        _time_rank, world_size, sizes, iters, repeats, device_type, device_type=device_type, timeout_s=600
    )[0]


def median_latency(samples: dict) -> dict:
    """(nbytes, algorithm) -> the median of its repeats."""
    return {key: statistics.median(values) for key, values in samples.items()}


def thresholds_from(latency_us: dict, sizes: list[int]) -> dict:
    """The bands auto can follow (one_shot up to a size, two_shot up to a larger one, torch
    above) that lose the least to the table: the sum over sizes of how much slower the
    band's backend is than that size's fastest, relative to it. A size that a neighbouring
    band wins by less than it loses elsewhere stays in the band, so one odd size cannot end
    a band (or, as a fastest-first scan did, turn the fast path off below it)."""
    sizes = sorted(sizes)
    fastest = {n: min(latency_us[(n, a)] for a in ALGORITHMS) for n in sizes}

    def loss(bands: list[str]) -> float:
        return sum(latency_us[(n, a)] / fastest[n] - 1 for n, a in zip(sizes, bands))

    count = len(sizes)
    # one_shot for the first i sizes, two_shot for the next j - i, torch for the rest; the
    # first of equal fits (the smaller bands) wins.
    i, j = min(
        ((i, j) for i in range(count + 1) for j in range(i, count + 1)),
        key=lambda ij: loss(
            ["one_shot"] * ij[0] + ["two_shot"] * (ij[1] - ij[0]) + ["torch"] * (count - ij[1])
        ),
    )
    return {
        "one_shot_max_bytes": sizes[i - 1] if i else 0,
        "two_shot_max_bytes": sizes[j - 1] if j else 0,
    }


def contradictions(latency_us: dict, sizes: list[int], thresholds: dict, tolerance: float = TOLERANCE):
    """The sizes at which auto with these thresholds would use a backend that the table shows
    more than `tolerance` slower than the fastest, each as a sentence; empty if none."""
    found = []
    for nbytes in sorted(sizes):
        used = backend_for(nbytes, thresholds)
        best = min(ALGORITHMS, key=lambda a: latency_us[(nbytes, a)])
        if latency_us[(nbytes, used)] > latency_us[(nbytes, best)] * (1 + tolerance):
            found.append(
                f"{nbytes} bytes would use {used} ({latency_us[(nbytes, used)]:.1f} us) "
                f"but {best} took {latency_us[(nbytes, best)]:.1f} us"
            )
    return found


def run(
    world_size: int,
    device_type: str,
    sizes: list[int],
    iters: int,
    save: bool,
    repeats: int = DEFAULT_REPEATS,
) -> dict:
    """Measure, print the table and the thresholds, and store them unless they contradict
    the table (MeasurementRejected; the stored thresholds stay as they were)."""
    latency = median_latency(measure(world_size, device_type, sizes, iters, repeats))
    thresholds = thresholds_from(latency, sizes)
    print(
        f"allreduce latency (us, median over {repeats} repeats of a median of {iters}) "
        f"on {world_size} {device_type} ranks"
    )
    print(f"{'bytes':>10s} " + " ".join(f"{a:>10s}" for a in ALGORITHMS) + "    fastest       auto")
    for nbytes in sorted(sizes):
        row = [latency[(nbytes, a)] for a in ALGORITHMS]
        fastest = ALGORITHMS[row.index(min(row))]
        print(
            f"{nbytes:>10d} "
            + " ".join(f"{v:10.1f}" for v in row)
            + f" {fastest:>10s} {backend_for(nbytes, thresholds):>10s}"
        )
    print(f"auto thresholds: {thresholds}")
    save_unless_contradicted(
        [f"these thresholds contradict the table: {p}" for p in contradictions(latency, sizes, thresholds)],
        "The fastest backend does not follow size bands (one_shot, then two_shot, then torch), or "
        "the timings are noisy: re-run with more --repeats on an idle machine, or choose a backend "
        "with --allreduce",
        save,
        lambda: save_thresholds(device_type, world_size, thresholds),
    )
    return thresholds
