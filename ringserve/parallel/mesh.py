"""One device mesh for the whole job, and the named process groups taken from it.

World ranks are laid out cp-major, tp-minor (rank = cp_rank * tp + tp_rank), so a TP group
is a block of consecutive ranks (one host) and CP runs across hosts, as in the paper.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.config import ParallelConfig


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # the tp, cp or whole-world processes
    ep_replicated_group: dist.ProcessGroup | None = None  # EP ranks holding the same tokens (TP)
    control_group: dist.ProcessGroup | None = None  # gloo, for the driver's step messages (executor)
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    mesh: object = None

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        return cls(rank=0, world_size=1, device=device)


_JOIN_TIMEOUT_S = 30.0
_JOINED = "ringserve/joined/"  # + rank: a store key each rank sets once it is connected


def _wait_for_peers(store, world_size: int, timeout_s: float, check_peers) -> None:
    """Rank 0 waits here, in Python, until every other rank has connected to the store.

    Not in TCPStore's own wait: inside that C++ call no signal is handled, so a Ctrl-C while
    the ranks start would wait for the slowest of them, and a rank that died would be
    noticed only at the timeout.
    """
    keys = [f"{_JOINED}{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if check_peers is not None:
            check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank joined within {timeout_s:.0f} s")
        time.sleep(0.02)


def init_groups(
    parallel: ParallelConfig,
    rank: int,
    world_size: int,
    device: torch.device,
    init_method: str,
    timeout_s: float,
    check_peers: Callable[[], None] | None = None,
) -> ParallelGroups:
    """Join the world (gloo on CPU, NCCL on CUDA) and build the mesh and its groups.

    check_peers: rank 0's check, while it waits for the others to join, that they are still
    starting (it raises for one that died).
    """
    if world_size != parallel.world_size:
        raise ValueError(
            f"{world_size} processes were started, but tp={parallel.tp} x cp={parallel.cp} "
            f"needs {parallel.world_size}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if init_method.startswith("tcp://"):
        # Joining is not a collective: ranks still importing torch on a busy host are slow,
        # not hung, so the rendezvous may wait longer than a step's collectives do.
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        join_timeout = datetime.timedelta(seconds=max(timeout_s, _JOIN_TIMEOUT_S))
        store = dist.TCPStore(
            host, int(port), world_size, rank == 0, timeout=join_timeout, wait_for_workers=False
        )
        if rank == 0:
            _wait_for_peers(store, world_size, join_timeout.total_seconds(), check_peers)
        else:
            store.set(f"{_JOINED}{rank}", "1")
        init_method = None
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    mesh = init_device_mesh(device.type, (parallel.cp, parallel.tp), mesh_dim_names=("cp", "tp"))
    groups = {"tp": mesh.get_group("tp"), "cp": mesh.get_group("cp")}
    axes = parallel.ep_axes
    ep_group = groups[axes[0]] if len(axes) == 1 else (dist.group.WORLD if axes else None)
    return ParallelGroups(
        rank=rank,
        world_size=world_size,
        device=device,
        tp_group=groups["tp"],
        cp_group=groups["cp"],
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=parallel.tp,
        cp_rank=mesh.get_local_rank("cp"),
        cp_size=parallel.cp,
        ep_group=ep_group,
        ep_replicated_group=groups["tp"] if "tp" in axes and parallel.tp > 1 else None,
        ep_rank=dist.get_rank(ep_group) if ep_group is not None else 0,
        ep_size=parallel.ep,
        mesh=mesh,
    )
