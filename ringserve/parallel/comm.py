"""Collectives with an explicit group, named for what they do, portable across PyTorch versions."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """x on every rank of `group` -> [world, *x.shape], in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous().view(-1), group=group)
    return out.view(world, *x.shape)


def gather_rows(x: torch.Tensor, counts: list[int], group) -> list[torch.Tensor] | None:
    """x [counts[rank], ...] on every rank of `group` -> on the group's first rank, each
    rank's rows in rank order (None on the others). Padded to the longest, as gloo gathers
    only even tensors."""
    rank = dist.get_rank(group)
    padded = x.new_zeros(max(counts), *x.shape[1:])
    padded[: counts[rank]] = x
    out = [torch.empty_like(padded) for _ in counts] if rank == 0 else None
    dist.gather(padded, out, dst=dist.get_global_rank(group, 0), group=group)
    return None if out is None else [rows[:n] for rows, n in zip(out, counts)]


def broadcast_object(obj, src: int, group, timeout_s: float | None = None):
    """Send a picklable object from rank `src` to every rank of `group`; returns it.

    timeout_s bounds the wait (the sender uses it, so a dead or stopped receiver raises
    instead of blocking); None waits as long as the group allows (receivers idle between
    requests).
    """
    import datetime
    import pickle

    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    sending = dist.get_rank() == src
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if sending else None
    size = torch.tensor([payload.numel() if sending else 0], dtype=torch.int64)
    _wait(dist.broadcast(size, src=src, group=group, async_op=True), timeout)
    if not sending:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(payload, src=src, group=group, async_op=True), timeout)
    return obj if sending else pickle.loads(payload.numpy().tobytes())


def wait_interruptibly(work, poll_s: float = 0.01) -> None:
    """Wait for an async collective in Python: signals (Ctrl-C) are handled while it runs,
    where a blocking work.wait() holds them off until the slowest rank arrives."""
    while not work.is_completed():
        time.sleep(poll_s)
    work.wait()  # raises the collective's error, if any


def _wait(work, timeout) -> None:
    if timeout is None:
        work.wait()
    elif not work.wait(timeout):
        raise TimeoutError(f"a collective did not complete within {timeout.total_seconds():.0f} s")
