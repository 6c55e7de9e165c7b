"""One device mesh for the whole job, and the named process groups taken from it.

World ranks are laid out cp-major, tp-minor (rank = cp_rank * tp + tp_rank), so a TP group
is a block of consecutive ranks (one host) and CP runs across hosts, as in the paper.
"""

from __future__ import annotations

import datetime
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
    control_group: dist.ProcessGroup | None = None  # gloo, for the driver's step messages
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    mesh: object = None

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        return cls(rank=0, world_size=1, device=device)


def init_groups(
    parallel: ParallelConfig,
    rank: int,
    world_size: int,
    device: torch.device,
    init_method: str,
    timeout_s: float,
) -> ParallelGroups:
    """Join the world (gloo on CPU, NCCL on CUDA) and build the mesh and its groups."""
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
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    mesh = init_device_mesh(device.type, (parallel.cp, parallel.tp), mesh_dim_names=("cp", "tp"))
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return ParallelGroups(
        rank=rank,
        world_size=world_size,
        device=device,
        tp_group=mesh.get_group("tp"),
        cp_group=mesh.get_group("cp"),
        control_group=control,
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=parallel.tp,
        cp_rank=mesh.get_local_rank("cp"),
        cp_size=parallel.cp,
        mesh=mesh,
    )
