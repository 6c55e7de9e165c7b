"""The device mesh's groups, as rank lists (no processes): tp, cp, EP and the two-shot
all-to-all's intra-host and peer groups, for layouts with one and several EP groups."""

import itertools

import pytest

from ringserve.config import ParallelConfig
from ringserve.parallel.mesh import Mesh


def mesh(tp, cp, ep, ranks_per_host=None):
    return Mesh.of(ParallelConfig(tp=tp, cp=cp, ep=ep, ranks_per_host=ranks_per_host))


def test_tp_is_consecutive_ranks_and_cp_strides_over_them():
    m = mesh(2, 4, 1)
    assert m.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [kind for kind, _ in m.all_groups()] == ["tp"] * 4 + ["cp"] * 2  # no EP groups


@pytest.mark.parametrize(
    "layout,ep_groups,intra,peers",
    [
        # ep=cp over two hosts of 4: each CP group has ranks 2 apart, two on each host.
        (
            (2, 4, 4, 4),
            [[0, 2, 4, 6], [1, 3, 5, 7]],
            [[0, 2], [4, 6], [1, 3], [5, 7]],
            [[0, 4], [2, 6], [1, 5], [3, 7]],
        ),
        # ep=tp over hosts of 2: each TP group spans two hosts.
        (
            (4, 2, 4, 2),
            [[0, 1, 2, 3], [4, 5, 6, 7]],
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            [[0, 2], [1, 3], [4, 6], [5, 7]],
        ),
        # ep=tp over hosts of one rank: every host holds one rank of each EP group it touches.
        ((2, 2, 2, 1), [[0, 1], [2, 3]], [[0], [1], [2], [3]], [[0, 1], [2, 3]]),
        # ep = the whole world over two hosts.
        ((2, 2, 4, 2), [[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        # ep=tp=16 over two hosts of 8, cp=2 (the layout that could hang with per-group new_group).
        (
            (16, 2, 16, 8),
            [list(range(16)), list(range(16, 32))],
            [list(range(h * 8, h * 8 + 8)) for h in range(4)],
            [list(range(s + i, s + 16, 8)) for s in (0, 16) for i in range(8)],
        ),
    ],
)
def test_ep_groups_spanning_hosts(layout, ep_groups, intra, peers):
    m = mesh(*layout)
    assert m.two_shot
    assert m.ep_groups() == ep_groups
    assert m.ep_intra_host_groups() == intra
    assert m.ep_peer_groups() == peers


@pytest.mark.parametrize("layout", [(2, 2, 2, 2), (2, 4, 4, None), (4, 2, 4, 4), (1, 1, 1, 8)])
def test_no_two_shot_groups_when_each_ep_group_is_on_one_host(layout):
    m = mesh(*layout)
    assert not m.two_shot
    assert {kind for kind, _ in m.all_groups()} == {"tp", "cp"}


LAYOUTS = [
    (tp, cp, ep, per_host)
    for tp, cp in itertools.product([1, 2, 4], [1, 2, 4])
    for ep in sorted({1, tp, cp, tp * cp})
    for per_host in [1, 2, 4, 8, 16]
    if (tp * cp) % min(per_host, tp * cp) == 0
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_group_follows_the_mesh(layout):
    tp, cp, ep, per_host = layout
    m = mesh(*layout)
    world = tp * cp
    host = [r // min(per_host, world) for r in range(world)]
    # Each rank in exactly one group of each kind; tp and cp from rank = cp_rank * tp + tp_rank.
    for groups in (m.tp_groups(), m.cp_groups(), m.ep_groups()):
        assert sorted(r for g in groups for r in g) == list(range(world))
    assert all(divmod(r, tp)[0] == c for c, g in enumerate(m.tp_groups()) for r in g)
    assert all(r % tp == t for t, g in enumerate(m.cp_groups()) for r in g)
    assert all(len(g) == ep for g in m.ep_groups())
    if not m.two_shot:
        assert all(len({host[r] for r in g}) == 1 for g in m.ep_groups()) or ep == 1
        return
    ep_of = {r: g for g in m.ep_groups() for r in g}
    for kind, groups in (("intra", m.ep_intra_host_groups()), ("peers", m.ep_peer_groups())):
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        for g in groups:
            assert set(g) <= set(ep_of[g[0]])  # inside one EP group
            if kind == "intra":  # one host, consecutive EP ranks
                assert len({host[r] for r in g}) == 1
            else:  # one rank per host the EP group spans, each the same local EP index
                assert len({host[r] for r in g}) == len(g) == ep // len(m.ep_intra_host_groups()[0])
                assert len({ep_of[r].index(r) % m.ep_ranks_per_host for r in g}) == 1
    # Every rank lists the same groups in the same order (new_group is collective).
    assert m.all_groups() == mesh(*layout).all_groups()


def test_hosts_the_layout_cannot_fill_are_refused():
    with pytest.raises(ValueError, match="do not fill hosts of 3"):
        mesh(2, 2, 1, 3)
    with pytest.raises(ValueError, match="unevenly"):
        mesh(3, 2, 3, 2)  # a TP group of 3 over hosts of 2: 2 ranks on one host, 1 on the next


def test_dp_is_the_outer_dimension_and_ep_may_span_it():
    m = Mesh.of(ParallelConfig(dp=2, cp=3, tp=2, ep=4))  # ep over dp x tp (cp x tp is 6)
    assert m.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert m.cp_groups() == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert m.dp_groups() == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert m.ep_groups() == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert m.coords(9) == {"dp": 1, "cp": 1, "tp": 1} and m.rank_of(1, 1, 1) == 9
    kinds = [kind for kind, _ in m.all_groups()]
    assert kinds == ["tp"] * 6 + ["cp"] * 4 + ["dp"] * 6 + ["ep"] * 3


@pytest.mark.parametrize(
    "parallel,ep_groups",
    [
        (ParallelConfig(ep=4), [[0, 1, 2, 3]]),  # dp=4: the whole world
        (ParallelConfig(dp=2, tp=2, ep=2), [[0, 1], [2, 3]]),  # ep=tp: each replica's own experts
        (ParallelConfig(dp=2, tp=2, cp=2, ep=2), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (ParallelConfig(dp=4, tp=2, ep=4), [[0, 2, 4, 6], [1, 3, 5, 7]]),  # ep=dp: the dp groups
    ],
)
def test_ep_groups_over_replicas(parallel, ep_groups):
    m = Mesh.of(parallel)
    assert m.ep_groups() == ep_groups
    assert not m.ep_is_own_group  # the world, the tp or the dp groups serve


def test_ep_over_replicas_across_hosts_is_two_shot():
    # dp=2 replicas of cp=2, one replica per host; the EP group is all four ranks.
    m = Mesh.of(ParallelConfig(dp=2, cp=2, ep=4, ranks_per_host=2))
    assert m.two_shot
    assert m.ep_intra_host_groups() == [[0, 1], [2, 3]]
    assert m.ep_peer_groups() == [[0, 2], [1, 3]]
