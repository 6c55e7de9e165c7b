"""Run a function on N local ranks (one process each) and collect what each returns.

For tests and benchmarks of collectives: forkserver processes (torch imported once, then
each rank starts in a fraction of a second), gloo on CPU or NCCL on CUDA, every group with
a timeout so a broken collective fails instead of hanging.
"""

from __future__ import annotations

import datetime
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, init_method, device_type, timeout_s, args, results):
    if device_type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            "gloo" if device_type == "cpu" else "nccl",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        # Not os._exit: the put is written by the queue's feeder thread, which multiprocessing
        # flushes on its way out (os._exit lost the report: the caller waited out the timeout).
        sys.exit(1)


def run_local_world(fn, world_size: int, *args, device_type: str = "cpu", timeout_s: float = 60.0) -> list:
    """fn(rank, world_size, *args) on every rank, inside an initialised default group.

    fn must be importable (a module-level function). Returns the values by rank; raises
    RuntimeError naming the rank if any rank fails or the world does not finish in time.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, init_method, device_type, timeout_s, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s + 30)
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed: {value}")
            values[rank] = value
    except Exception as e:
        if isinstance(e, RuntimeError):
            raise
        raise RuntimeError(f"the {world_size}-rank world did not finish within {timeout_s + 30:.0f} s") from e
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]


def collective_latency_us(fn, iters: int, device_type: str, warmup: int = 3) -> float:
    """Median latency of fn() in microseconds on the slowest rank (a collective ends when
    its last rank does); every rank of the default group must call it together."""
    import statistics
    import time

    def sync():
        if device_type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item() * 1e6
