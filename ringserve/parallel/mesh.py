"""One device mesh for the whole job, and every process group taken from it.

The mesh has three named dimensions, outermost first: dp (data-parallel replicas, each with
its own requests, scheduler and KV cache), cp and tp. World ranks are laid out dp-major,
tp-minor (rank = (dp_rank * cp + cp_rank) * tp + tp_rank), so a TP group is a block of
consecutive ranks (one host), CP runs across hosts, as in the paper, and a replica is a
block of tp x cp consecutive ranks. Hosts hold consecutive ranks too (rank = host *
ranks_per_host + local rank): the host dimension decides which EP groups span hosts and so
use the two-shot all-to-all. An EP group is the ranks of a product of axes (ParallelConfig.ep_axes)
flattened in rank order: with dp among them, attention runs data-parallel and the experts
are spread over the replicas.

`Mesh` is the arithmetic alone (which ranks form each group, no processes); `init_groups`
joins the world and creates every group of the mesh on every rank, in one fixed order:
torch's new_group is collective over the whole world, so a rank that skipped a group it is
not in, or made them in its own order, would pair its groups with other ranks' wrong ones.
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.config import MESH_AXES, ParallelConfig


@dataclass(frozen=True)
class Mesh:
    """Sizes of the mesh: dp replicas of tp x cp ranks, ep of them per EP group, ranks_per_host per host."""

    tp: int
    cp: int
    ep: int
    ranks_per_host: int
    dp: int = 1

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Mesh:
        """ranks_per_host None (or above the world): the whole world is one host."""
        world = parallel.world_size
        per_host = min(parallel.ranks_per_host or world, world)
        return cls(parallel.tp, parallel.cp, parallel.ep, per_host, parallel.dp)

    def __post_init__(self):
        if self.world_size % self.ranks_per_host:
            raise ValueError(
                f"dp x cp x tp = {self.dp} x {self.cp} x {self.tp} = {self.world_size} ranks do not "
                f"fill hosts of {self.ranks_per_host} ranks"
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
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tp, self.cp, self.ep, dp=self.dp)  # validates ep

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def replica_size(self) -> int:
        return self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        replica, inner = divmod(rank, self.replica_size)
        cp_rank, tp_rank = divmod(inner, self.tp)
        return {"dp": replica, "cp": cp_rank, "tp": tp_rank}

    def rank_of(self, dp: int, cp: int, tp: int) -> int:
        return (dp * self.cp + cp) * self.tp + tp

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def groups_over(self, axes: tuple[str, ...]) -> list[list[int]]:
        """The groups spanning `axes` (the ranks that agree on every other axis), each in rank
        order, ordered by the other axes' coordinates."""
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        others = [a for a in MESH_AXES if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            at = dict(zip(others, fixed))
            group = []
            for moving in itertools.product(*(range(sizes[a]) for a in axes)):
                at.update(zip(axes, moving))
                group.append(self.rank_of(at["dp"], at["cp"], at["tp"]))
            groups.append(sorted(group))
        return groups

    def tp_groups(self) -> list[list[int]]:
        return self.groups_over(("tp",))

    def cp_groups(self) -> list[list[int]]:
        return self.groups_over(("cp",))

    def dp_groups(self) -> list[list[int]]:
        """The ranks of one (cp, tp) place in every replica; the first holds each replica's
        leader (cp_rank 0, tp_rank 0), where its logits are gathered to rank 0."""
        return self.groups_over(("dp",))

    def ep_groups(self) -> list[list[int]]:
        """Each EP group's world ranks in EP-rank order (ascending, so host-major)."""
        axes = self.parallel.ep_axes
        if not axes:
            return [[r] for r in range(self.world_size)]
        return self.groups_over(axes)

    @property
    def ep_is_own_group(self) -> bool:
        """The EP groups are neither one axis's groups nor the whole world: made as their own."""
        axes = self.parallel.ep_axes
        return len(axes) > 1 and self.ep < self.world_size

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

        An EP group that is the tp, cp or dp group, or the whole world (the same ranks), is
        not made twice; with one replica there are no dp groups.
        """
        kinds = {
            "tp": self.tp_groups(),
            "cp": self.cp_groups(),
            "dp": self.dp_groups() if self.dp > 1 else [],
            "ep": self.ep_groups() if self.ep_is_own_group else [],
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
    dp_group: dist.ProcessGroup | None = None  # this rank's place (cp, tp) in every replica
    ep_group: dist.ProcessGroup | None = None  # the ranks of ParallelConfig.ep_axes
    ep_replicated_group: dist.ProcessGroup | None = None  # EP ranks holding the same tokens (TP)
    ep_intra_host_group: dist.ProcessGroup | None = None  # two-shot: this EP group's ranks on this host
    ep_peer_group: dist.ProcessGroup | None = None  # two-shot: its ranks of this local index, one per host
    control_group: dist.ProcessGroup | None = None  # gloo, for the driver's step messages (executor)
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0  # this rank's replica
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    mesh: Mesh | None = None

    @property
    def replica_leader(self) -> bool:
        """cp_rank 0, tp_rank 0: holds its replica's logits after a step (gathered to rank 0)."""
        return self.cp_rank == 0 and self.tp_rank == 0

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
            f"{world_size} processes were started, but dp={parallel.dp} x cp={parallel.cp} x "
            f"tp={parallel.tp} needs {parallel.world_size}"
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
    axes = mesh.parallel.ep_axes
    if not axes:
        ep_group = None
    elif mesh.ep == mesh.world_size:
        ep_group = dist.group.WORLD
    else:
        ep_group = mine["ep" if mesh.ep_is_own_group else axes[0]]
    at = mesh.coords(rank)
    return ParallelGroups(
        rank=rank,
        world_size=mesh.world_size,
        device=device,
        tp_group=mine["tp"],
        cp_group=mine["cp"],
        dp_group=mine.get("dp"),
        tp_rank=at["tp"],
        tp_size=mesh.tp,
        cp_rank=at["cp"],
        cp_size=mesh.cp,
        dp_rank=at["dp"],
        dp_size=mesh.dp,
        ep_group=ep_group,
        # TP ranks inside an EP group hold the same tokens: each dispatches a share of them.
        ep_replicated_group=mine["tp"] if "tp" in axes and mesh.tp > 1 else None,
        ep_intra_host_group=mine.get("ep_intra_host"),
        ep_peer_group=mine.get("ep_peers"),
        ep_rank=dist.get_rank(ep_group) if ep_group is not None else 0,
        ep_size=mesh.ep,
        mesh=mesh,
    )
