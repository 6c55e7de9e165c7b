"""Running a MoE layer's experts: on this rank, or spread over expert-parallel ranks.

Without EP (`LocalExperts`) every rank holds every expert (under TP, a slice of each
expert's intermediate dimension) and sums partial outputs with the TP allreduce.

With EP (`ExpertParallel`) each of the ep ranks holds num_experts / ep whole experts.
Dispatch: each (token, chosen expert) pair goes to the rank holding the expert: counts are
exchanged first, then all_to_all_single with uneven splits carries the activations and the
routing (expert id and weight). The receiving rank runs each local expert once over its
group and weights the outputs; the reverse all-to-all (combine) brings them home, where
they are summed per token. Exact: no capacity limit, no dropped token.

When the EP group spans hosts (the mesh's host dimension), the all-to-all is two-shot: a token's
choices bound for one destination rank travel as one row (its expert ids and weights, -1
where unused), first inside the host to the rank whose local index matches the
destination's, then across hosts between those peer ranks. So a token crosses the host
boundary once per destination rank, over the peer link (flat: once per chosen expert).
`cross_host_bytes` counts the activation bytes that crossed, both ways.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ringserve.parallel.comm import all_gather_stacked


class ExpertWeights(Protocol):
    """A rank's experts as the model holds them (model/decoder.py's Experts, or FusedExperts).
    Named here, not imported, so that parallel sits beneath the model."""

    @property
    def num_local_experts(self) -> int: ...

    def grouped_forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [M, H]: the rows of local expert e at ends[e-1]:ends[e] -> [M, H]."""
        ...


def _run_rows(experts: ExpertWeights, rows, expert_ids, weights, first_expert: int, all_local: bool = False):
    """rows [N, H]; expert_ids, weights [N, k] (-1: no expert) -> [N, H] = sum_j w_j * e_j(row).

    Each local expert runs once over all the rows that chose it (grouped, no per-token loop).
    all_local: every id is one of this rank's experts (no -1), so all N * k pairs are taken
    as they are. Nothing here waits for the GPU then: no nonzero (its size is data), and the
    group ends come from a search on the device, not a bincount (which reads its max).
    """
    if all_local:
        top_k = expert_ids.shape[1]
        row_of = torch.arange(expert_ids.numel(), device=rows.device) // top_k  # [N * k]
        local, w = expert_ids.flatten() - first_expert, weights.flatten()
    else:
        row_of, slot = torch.nonzero(expert_ids >= 0, as_tuple=True)
        local, w = expert_ids[row_of, slot] - first_expert, weights[row_of, slot]
    order = torch.argsort(local, stable=True)
    row_of, local, w = row_of[order], local[order], w[order]
    # ends[e]: pairs routed to local experts 0..e, i.e. where expert e's group ends.
    experts_here = torch.arange(experts.num_local_experts, device=rows.device)
    ends = torch.searchsorted(local, experts_here, right=True, out_int32=True)
    y = experts.grouped_forward(rows[row_of], ends) * w.unsqueeze(-1)
    return torch.zeros_like(rows).index_add_(0, row_of, y)


class LocalExperts:
    def __init__(self, all_reduce):
        self.all_reduce = all_reduce

    def __call__(self, experts: ExpertWeights, x, expert_ids, weights):
        return self.all_reduce(_run_rows(experts, x, expert_ids, weights, 0, all_local=True))


def _exchange(rows, extras: list, send_counts, group):
    """all_to_all of rows and same-length side tensors with uneven splits, plus its reverse.

    Returns (received rows, received side tensors, back, rows sent to each rank) where
    back(y) sends rows of y, in the order received, back to where they came from.
    """
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    total = sum(recv_splits)
    received = []
    for t in [rows, *extras]:
        out = t.new_empty(total, *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
        received.append(out)

    def back(y):
        home = y.new_empty(sum(send_splits), *y.shape[1:])
        dist.all_to_all_single(home, y.contiguous(), send_splits, recv_splits, group=group)
        return home

    return received[0], received[1:], back, send_splits


class ExpertParallel:
    """Experts spread over `group`; tokens reach them by all-to-all and come back the same way.

    replicated_group: the ranks that hold the same tokens (TP ranks inside the EP group):
    each dispatches an equal share of the tokens, and the results are gathered back.
    intra_host_group, peer_group: where the EP group spans hosts, its ranks on this rank's
    host and its ranks of this rank's local index (one per host), from the mesh
    (ParallelGroups); EP ranks are host-major. Given, the all-to-all is two-shot.
    """

    def __init__(
        self,
        group,
        num_experts: int,
        replicated_group=None,
        intra_host_group=None,
        peer_group=None,
        two_shot: bool | None = None,
    ):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.experts_per_rank = num_experts // self.size
        self.replicated_group = replicated_group
        self.intra, self.peers = intra_host_group, peer_group
        self.per_host = dist.get_world_size(self.intra) if self.intra is not None else self.size
        self.two_shot = (self.per_host < self.size) if two_shot is None else two_shot
        if self.two_shot and (self.intra is None or self.peers is None):
            raise ValueError("the two-shot all-to-all needs the EP group's intra-host and peer groups")
        self.cross_host_bytes = 0

    def __call__(self, experts: ExpertWeights, x, expert_ids, weights):
        if self.replicated_group is None:
            return self._dispatch_combine(experts, x, expert_ids, weights)
        n, r = dist.get_world_size(self.replicated_group), dist.get_rank(self.replicated_group)
        share = -(-x.shape[0] // n)
        lo, hi = min(r * share, x.shape[0]), min((r + 1) * share, x.shape[0])
        padded = x.new_zeros(share, x.shape[1])
        padded[: hi - lo] = self._dispatch_combine(experts, x[lo:hi], expert_ids[lo:hi], weights[lo:hi])
        return all_gather_stacked(padded, self.replicated_group).view(-1, x.shape[1])[: x.shape[0]]

    def _dispatch_combine(self, experts: ExpertWeights, x, expert_ids, weights):
        dest = expert_ids // self.experts_per_rank  # [T, k] rank holding each choice
        if self.two_shot:
            rows, ids, w, token_of, back = self._two_shot(x, expert_ids, weights, dest)
        else:
            rows, ids, w, token_of, back = self._flat(x, expert_ids, weights, dest)
        y = _run_rows(experts, rows, ids, w, self.rank * self.experts_per_rank)
        return torch.zeros_like(x).index_add_(0, token_of, back(y))

    def _host_of(self, rank):
        return rank // self.per_host

    def _flat(self, x, expert_ids, weights, dest):
        """One row per (token, choice), straight to the rank holding the expert."""
        top_k = expert_ids.shape[1]
        pairs_dest = dest.flatten()
        order = torch.argsort(pairs_dest, stable=True)
        token_of = order // top_k
        rows, (ids, w), back, sent = _exchange(
            x[token_of],
            [expert_ids.flatten()[order, None], weights.flatten()[order, None]],
            torch.bincount(pairs_dest, minlength=self.size),
            self.group,
        )
        first = self.per_host * self._host_of(self.rank)  # counted from the host copy: no extra sync
        remote = sum(sent) - sum(sent[first : first + self.per_host])
        self.cross_host_bytes += 2 * remote * x.shape[1] * x.element_size()  # there and back

        return rows, ids, w, token_of, back

    def _two_shot(self, x, expert_ids, weights, dest):
        """One row per (token, destination rank); inside the host first, then across."""
        per, top_k = self.per_host, expert_ids.shape[1]
        # Unique (token, destination) rows, each carrying its choices there (-1 elsewhere).
        key = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * self.size + dest  # [T, k]
        unique_keys, slot_row = torch.unique(key.flatten(), return_inverse=True)
        num_rows = len(unique_keys)
        token_of = unique_keys // self.size
        row_dest = unique_keys % self.size
        ids = torch.full((num_rows, top_k), -1, dtype=expert_ids.dtype, device=x.device)
        w = torch.zeros(num_rows, top_k, dtype=weights.dtype, device=x.device)
        slot = torch.arange(top_k, device=x.device).repeat(x.shape[0])
        ids[slot_row, slot] = expert_ids.flatten()
        w[slot_row, slot] = weights.flatten()
        dest_host, dest_local = row_dest // per, row_dest % per
        # Shot 1, inside the host: to the rank with the destination's local index.
        order1 = torch.argsort(dest_local, stable=True)
        rows1, (ids1, w1, host1), back1, _ = _exchange(
            x[token_of[order1]],
            [ids[order1], w[order1], dest_host[order1]],
            torch.bincount(dest_local, minlength=per),
            self.intra,
        )
        # Shot 2, across hosts between peers: to the destination host.
        order2 = torch.argsort(host1, stable=True)
        counts2 = torch.bincount(host1, minlength=self.size // per)
        rows2, (ids2, w2), back2, sent2 = _exchange(
            rows1[order2], [ids1[order2], w1[order2]], counts2, self.peers
        )
        crossing = sum(sent2) - sent2[self._host_of(self.rank)]
        self.cross_host_bytes += 2 * crossing * x.shape[1] * x.element_size()

        def back(y):
            y1 = torch.empty_like(rows1)
            y1[order2] = back2(y)
            y0 = torch.empty(num_rows, x.shape[1], dtype=x.dtype, device=x.device)
            y0[order1] = back1(y1)
            return y0

        return rows2, ids2, w2, token_of, back
