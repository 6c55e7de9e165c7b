"""Which dense attention calls cover a batch whose queries and keys lie at arbitrary positions.

Ring attention meets blocks that the fused causal kernels cannot mask by themselves: a
rank's zigzag chunks against another rank's chunks, new tokens against a cached prefix
spread over ranks, one decode token per sequence against part of its context. All of
these share one property the plan relies on: within a sequence the keys are sorted by
position, so the keys a query sees are a prefix of its sequence's keys, of length
n[t] = #keys at or before query t. Runs of queries then fall into three shapes:

- n constant: one unmasked block, the run's queries against the first n keys;
- n growing by one per query: a causal diagonal (top-left aligned, as cuDNN's causal
  flag is), after an unmasked block over the keys the whole run sees, merged by LSE;
- n zero: the queries see nothing here (out 0, LSE -inf).

For the zigzag layout each ring step is then one call: the local step is one causal
diagonal over the rank's two chunks, earlier chunks one unmasked block for all queries,
later chunks one unmasked block for the late chunk's queries.

A batch where every sequence has at most one query and sees all its keys (a decode step
of the ring) is planned as one fused varlen call instead.

Under a window (sliding, chunked) a query sees keys f[t] .. n[t] - 1: runs where f stays
put are the shapes above shifted by f; where f moves with almost every query (a sliding
band) the run is cut into tiles, each one masked call over just the keys the tile sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Block:
    """Queries q0:q1 against keys k0:k1, unmasked or causal (then q1 - q0 == k1 - k0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclass
class DecodeLayout:
    """One query per kept sequence, attending all its keys: a fused varlen call.

    rows: the query rows of sequences that have keys (None: all rows, in order);
    k_starts / k_counts: each kept sequence's keys in the packed key tensor.
    """

    rows: list[int] | None
    k_starts: list[int]
    k_counts: list[int]
    num_keys: int  # keys in the packed tensor


@dataclass
class AttentionPlan:
    groups: list[list[Block]] = field(default_factory=list)  # blocks on the same rows, merged by LSE
    unseen: list[tuple[int, int]] = field(default_factory=list)  # query rows that see no key
    masked: list[tuple[int, int, int, int]] = field(default_factory=list)  # (q0, q1, k0, k1): explicit mask
    # (q0, q1, k0, k1, visible [q1 - q0, k1 - k0] bool on the host): windows whose first key
    # moves with almost every query (a sliding band), one masked call per tile of queries
    banded: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)
    decode: DecodeLayout | None = None
    _device_tensors: dict | None = None

    def single_group(self) -> list[Block] | None:
        """The one row group that holds every query that sees a key, if the plan is just
        that (the other queries see nothing)."""
        if self.masked or self.banded or self.decode is not None or len(self.groups) != 1:
            return None
        return self.groups[0]

    def device_tensors(self, device) -> dict:
        """The decode layout's index tensors on the device, made once per plan (it serves
        every layer) and copied without a host sync."""
        if self._device_tensors is None:
            layout = self.decode

            def to_device(values):
                return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

            self._device_tensors = {
                "rows": None if layout.rows is None else to_device(layout.rows).long(),
                "cu_q": to_device(list(range(len(layout.k_starts) + 1))),
                "cu_k": to_device([*layout.k_starts, layout.num_keys]),
                "k_counts": to_device(layout.k_counts),
            }
        return self._device_tensors


def plan_attention(q_bounds, k_bounds, q_positions: torch.Tensor, k_positions: torch.Tensor) -> AttentionPlan:
    """Plan a packed batch: sequence i has queries q_bounds[i]:q_bounds[i+1] at q_positions
    and keys k_bounds[i]:k_bounds[i+1] at k_positions (host tensors)."""
    seen_counts = []  # per sequence: keys seen by each query; None for keys out of order
    for i in range(len(q_bounds) - 1):
        keys = k_positions[k_bounds[i] : k_bounds[i + 1]]
        if len(keys) > 1 and not bool((keys[1:] >= keys[:-1]).all()):
            seen_counts.append(None)
        else:
            seen_counts.append(
                torch.searchsorted(keys, q_positions[q_bounds[i] : q_bounds[i + 1]], right=True)
            )
    return plan_seen(q_bounds, k_bounds, seen_counts)


def plan_seen(q_bounds, k_bounds, seen_counts: list[torch.Tensor | None], first_counts=None) -> AttentionPlan:
    """Plan from how many of its sequence's keys each query sees (keys sorted by position):
    seen_counts[i] [queries of sequence i] int64 on the host, or None for keys out of order
    (then an explicit mask). first_counts (a window): per sequence, how many of those the
    query does not see (it sees keys first .. seen - 1); None: all from the first.
    Host work O(queries + sequences), none per key (but a band's masks)."""
    plan = AttentionPlan()
    if first_counts is not None and all(f is None or not bool(f.any()) for f in first_counts):
        first_counts = None  # every window reaches back to the sequence's first key here
    if first_counts is not None:
        plan.decode = _decode_layout(q_bounds, k_bounds, seen_counts, first_counts)
        if plan.decode is not None:  # decode under a window: each query's keys are a suffix
            return plan
        for i, (n, f) in enumerate(zip(seen_counts, first_counts)):
            _plan_windowed(plan, n, f, q_bounds[i], k_bounds[i])
        return plan
    if all(n is not None for n in seen_counts):
        plan.decode = _decode_layout(q_bounds, k_bounds, seen_counts)
        if plan.decode is not None:  # a decode step: the fused call needs no block plan
            return plan
    for i, n in enumerate(seen_counts):
        if n is None:
            plan.masked.append((q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]))
        else:
            _plan_sequence(plan, n, q_bounds[i], k_bounds[i])
    return plan


def _decode_layout(q_bounds, k_bounds, seen_counts, first_counts=None) -> DecodeLayout | None:
    """The fused layout, if every sequence has at most one query and it sees all its keys
    (from its window's first, first_counts, on: a suffix of them)."""
    rows, k_starts, k_counts = [], [], []
    for i, n in enumerate(seen_counts):
        num_queries, num_keys = q_bounds[i + 1] - q_bounds[i], k_bounds[i + 1] - k_bounds[i]
        if num_queries > 1 or (num_queries == 1 and int(n[0]) != num_keys):
            return None
        first = int(first_counts[i][0]) if first_counts is not None and num_queries == 1 else 0
        if num_queries == 1 and num_keys > first:
            rows.append(q_bounds[i])
            k_starts.append(k_bounds[i] + first)
            k_counts.append(num_keys - first)
    if not rows:
        return None  # nothing to compute: the block plan marks every query unseen
    return DecodeLayout(None if len(rows) == q_bounds[-1] else rows, k_starts, k_counts, k_bounds[-1])


def _plan_sequence(plan: AttentionPlan, n: torch.Tensor, q_base: int, k_base: int) -> None:
    for a, b in _runs(n):
        first = int(n[a])
        diagonal = b - a > 1 and int(n[a + 1]) == first + 1
        if first == 0 and diagonal:  # the first query sees nothing, the rest a diagonal from key 0
            plan.unseen.append((q_base + a, q_base + a + 1))
            a, first = a + 1, 1
            diagonal = b - a > 1
        if first == 0:
            plan.unseen.append((q_base + a, q_base + b))
        elif not diagonal:
            plan.groups.append([Block(q_base + a, q_base + b, k_base, k_base + first, False)])
        else:
            before = first - 1  # keys every query of the run sees, then one more per query
            group = [] if before == 0 else [Block(q_base + a, q_base + b, k_base, k_base + before, False)]
            group.append(Block(q_base + a, q_base + b, k_base + before, k_base + before + b - a, True))
            plan.groups.append(group)


_SHORT = 8  # queries sharing a window start below which they go to a band's masked tile
_BAND_TILE = 256  # queries per masked tile


def _plan_windowed(plan: AttentionPlan, n: torch.Tensor, f: torch.Tensor, q_base: int, k_base: int) -> None:
    """Queries see keys f[t] .. n[t] - 1 (both never decrease). Where f stays put over a
    run, it is the prefix plan shifted by f; where it moves with (almost) every query, a
    band: masked tiles over just the keys the tile sees."""
    count = len(n)
    change = (torch.nonzero(f[1:] != f[:-1]).flatten() + 1).tolist()
    band_start = None
    for a, b in zip([0, *change], [*change, count]):
        if b - a >= _SHORT:
            if band_start is not None:
                _plan_band(plan, n[band_start:a], f[band_start:a], q_base + band_start, k_base)
                band_start = None
            first = int(f[a])
            _plan_sequence(plan, n[a:b] - first, q_base + a, k_base + first)
        elif band_start is None:
            band_start = a
    if band_start is not None:
        _plan_band(plan, n[band_start:], f[band_start:], q_base + band_start, k_base)


def _plan_band(plan: AttentionPlan, n: torch.Tensor, f: torch.Tensor, q_base: int, k_base: int) -> None:
    for a in range(0, len(n), _BAND_TILE):
        b = min(len(n), a + _BAND_TILE)
        lo, hi = int(f[a]), int(n[b - 1])
        if hi <= lo or not bool((n[a:b] > f[a:b]).any()):
            plan.unseen.append((q_base + a, q_base + b))
            continue
        keys = torch.arange(lo, hi)
        visible = (keys[None, :] >= f[a:b, None]) & (keys[None, :] < n[a:b, None])
        plan.banded.append((q_base + a, q_base + b, k_base + lo, k_base + hi, visible))


def _runs(n: torch.Tensor) -> list[tuple[int, int]]:
    """Cut queries into runs over which n is constant or grows by exactly one per query.

    Works on the segments of equal step n[t+1] - n[t] (found without a Python loop over
    queries, since a 1M-token prompt gives a rank 128K queries): a segment with step 0 or 1
    is one run; other steps make one-query runs.
    """
    count = len(n)
    if count <= 1:
        return [(0, count)] if count else []
    step = n[1:] - n[:-1]  # step[t] links queries t and t + 1
    change = (torch.nonzero(step[1:] != step[:-1]).flatten() + 1).tolist()
    runs, start = [], 0
    for i, j in zip([0, *change], [*change, count - 1]):  # steps i..j-1 link queries i..j
        if int(step[i]) in (0, 1):
            if start <= j:
                runs.append((start, j + 1))
                start = j + 1
        else:
            runs.extend((t, t + 1) for t in range(start, j))
            start = max(start, j)
    if start < count:
        runs.append((start, count))
    return runs
