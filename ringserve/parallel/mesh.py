"""One device mesh for the whole job, and every process group taken from it.

World ranks are laid out cp-major, tp-minor (rank = cp_rank * tp + tp_rank), so a TP group
is a block of consecutive ranks (one host) and CP runs across hosts, as in the paper. Hosts
hold consecutive ranks too (rank = host * ranks_per_host + local rank): the host dimension
decides which EP groups span hosts and so use the two-shot all-to-all.

`Mesh` is the arithmetic alone (which ranks form each group, no processes); `init_groups`
joins the world and creates every group of the mesh on every rank, in one fixed order:
torch's new_group is collective over the whole world, so a rank that skipped a group it is
not in, or made them in its own order, would pair its groups with other ranks' wrong ones.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.config import ParallelConfig


@dataclass(frozen=True)
class Mesh:
    """Sizes of the mesh: tp x cp ranks, ep of them per EP group, ranks_per_host per host."""

    tp: int
    cp: int
    ep: int
    ranks_per_host: int

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Mesh:
        """ranks_per_host None (or above the world): the whole world is one host."""
        world = parallel.world_size
        per_host = min(parallel.ranks_per_host or world, world)
        return cls(parallel.tp, parallel.cp, parallel.ep, per_host)

    def __post_init__(self):
        if self.world_size % self.ranks_per_host:
            raise ValueError(
                f"tp x cp = {self.world_size} ranks do not fill hosts of {self.ranks_per_host} ranks"
            )
        # The two-shot all-to-all pairs the k-th EP rank on each host: every EP group needs
        # the same number of ranks on each host it spans.
        on_host = {n for g in self.ep_groups() for n in Counter(self.host_of(r) for r in g).values()}
        if len(on_host) > 1:
            raise ValueError(
                f"ep={self.ep} groups {self.ep_groups()} sit unevenly on hosts of {self.ranks_per_host} "
                f"ranks ({sorted(on_host)} ranks of one group on a host): the two-shot all-to-all "
                "needs as many on each host"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def tp_groups(self) -> list[list[int]]:
        return [[c * self.tp + t for t in range(self.tp)] for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        return [[c * self.tp + t for c in range(self.cp)] for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """Each EP group's world ranks in EP-rank order (ascending, so host-major)."""
        axes = ParallelConfig(self.tp, self.cp, self.ep).ep_axes  # validates ep
        if not axes:
            return [[r] for r in range(self.world_size)]
        if len(axes) == 2:
            return [list(range(self.world_size))]
        return self.tp_groups() if axes == ("tp",) else self.cp_groups()

    @property
    def ep_ranks_per_host(self) -> int:
        """How many of an EP group's ranks share each host it spans."""
        group = self.ep_groups()[0]
        return sum(self.host_of(r) == self.host_of(group[0]) for r in group)

    @property
    def two_shot(self) -> bool:
        """An EP group spans hosts: dispatch goes inside the host first, then across."""
        return self.ep > 1 and self.ep_ranks_per_host < self.ep

    def ep_intra_host_groups(self) -> list[list[int]]:
        """An EP group's ranks on one host (shot 1); none without two-shot."""
        if not self.two_shot:
            return []
        per = self.ep_ranks_per_host
        return [g[i : i + per] for g in self.ep_groups() for i in range(0, len(g), per)]

    def ep_peer_groups(self) -> list[list[int]]:
        """An EP group's ranks of one local index, one per host (shot 2); none without two-shot."""
        if not self.two_shot:
            return []
        per = self.ep_ranks_per_host
        return [g[i::per] for g in self.ep_groups() for i in range(per)]

    def all_groups(self) -> list[tuple[str, list[int]]]:
        """(kind, ranks) of every group to create, in the order every rank creates them.

        The EP group itself is the tp, cp or world group (the same ranks), so it is not made twice.
        """
        kinds = {
            "tp": self.tp_groups(),
            "cp": self.cp_groups(),
            "ep_intra_host": self.ep_intra_host_groups(),
            "ep_peers": self.ep_peer_groups(),
        }
        return [(kind, ranks) for kind, groups in kinds.items() for ranks in groups]


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # the tp, cp or whole-world processes
    ep_replicated_group: dist.ProcessGroup | None = None  # EP ranks holding the same tokens (TP)
    ep_intra_host_group: dist.ProcessGroup | None = None  # two-shot: this EP group's ranks on this host
    ep_peer_group: dist.ProcessGroup | None = None  # two-shot: its ranks of this local index, one per host
    control_group: dist.ProcessGroup | None = None  # gloo, for the driver's step messages (executor)
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    mesh: Mesh | None = None

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
    mesh = Mesh.of(parallel)  # refuses hosts the layout cannot fill before joining
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
    return build_groups(mesh, rank, device, timeout)


def build_groups(mesh: Mesh, rank: int, device: torch.device, timeout: datetime.timedelta) -> ParallelGroups:
    """Create every group of the mesh, on every rank of the joined world, in the mesh's order,
    and keep this rank's."""
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, ranks in mesh.all_groups():
        group = dist.new_group(ranks, timeout=timeout)  # collective: every rank, every group
        if rank in ranks:
            mine[kind] = group
    axes = ParallelConfig(mesh.tp, mesh.cp, mesh.ep).ep_axes
    ep_group = mine[axes[0]] if len(axes) == 1 else (dist.group.WORLD if axes else None)
    cp_rank, tp_rank = divmod(rank, mesh.tp)
    return ParallelGroups(
        rank=rank,
        world_size=mesh.world_size,
        device=device,
        tp_group=mine["tp"],
        cp_group=mine["cp"],
        tp_rank=tp_rank,
        tp_size=mesh.tp,
        cp_rank=cp_rank,
        cp_size=mesh.cp,
        ep_group=ep_group,
        ep_replicated_group=mine["tp"] if "tp" in axes and mesh.tp > 1 else None,
        ep_intra_host_group=mine.get("ep_intra_host"),
        ep_peer_group=mine.get("ep_peers"),
        ep_rank=dist.get_rank(ep_group) if ep_group is not None else 0,
        ep_size=mesh.ep,
        mesh=mesh,
    )
