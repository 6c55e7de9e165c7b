"""The plan of one context-parallel step that every rank derives alike from the step's
CPStep (layout.py): which queries and keys each rank holds, which keys each pair of ranks
shares under a window, and the VarlenBatch of each ring step. Host index tensors, no
communication: the ring (ring.py) runs on it, and no sizes are exchanged."""

from __future__ import annotations

import torch

from ringserve.attention.dense import VarlenBatch
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.parallel.cp.layout import CPStep


class RingStep:
    """Every rank's queries and keys of one step, from the layout's CPStep, as host index
    tensors: per new token (packed order) its sequence, owner rank, position and local slot;
    per rank and sequence its queries and keys. O(new tokens + sequences x ranks) elements,
    nothing per cached token: keys are only ever counted, never listed.
    """

    def __init__(self, cp: CPStep, num_tokens: list[int], num_ranks: int):
        self.num_ranks = num_ranks
        self.is_decode = all(n == 1 for n in num_tokens)  # one new token a sequence
        # [R, 4 + G]: sequence, rank, first position, tokens, first local slot per KV group
        runs = torch.tensor(cp.runs, dtype=torch.int64).reshape(-1, 4 + cp.num_groups)
        lengths = runs[:, 3]
        total = sum(num_tokens)
        run_start = torch.cumsum(lengths, 0) - lengths
        offset = torch.arange(total) - run_start.repeat_interleave(lengths, output_size=total)

        def per_token(column):
            return runs[:, column].repeat_interleave(lengths, output_size=total)

        self.seq = per_token(0)  # [T] sequence of each new token
        self.owners = per_token(1)  # [T] rank that computes it and holds its KV
        self.positions = per_token(2) + offset  # [T] global positions
        # [G, T] local cache slots on the owner, per KV group
        self.slots = torch.stack([per_token(c) for c in range(4, runs.shape[1])]) + offset
        num_seqs = len(num_tokens)
        self._cached = torch.tensor(cp.cached_keys, dtype=torch.int64).reshape(num_ranks, num_seqs)
        packed = torch.bincount(self.owners * num_seqs + self.seq, minlength=num_ranks * num_seqs)
        self.queries = packed.reshape(num_ranks, num_seqs)  # [N, S] new tokens of each sequence on each rank
        self.keys = self._cached + self.queries  # [N, S] keys each rank holds once the step's are written
        # Per rank, read by every layer's ring: plain ints.
        self._num_queries = self.queries.sum(1).tolist()
        self._num_keys = self.keys.sum(1).tolist()
        self._seq_start = torch.tensor([0, *num_tokens[:-1]], dtype=torch.int64).cumsum(0)  # [S] first token
        self.host_elements = runs.numel() + 5 * total + 4 * self.keys.numel() + num_seqs
        self._new_keys_before: dict[int, torch.Tensor] = {}
        self._recent_blocks, self._block_size = cp.recent_blocks, cp.block_size
        self._num_tokens = num_tokens
        self._skipped: dict[tuple[int, AttentionWindow], torch.Tensor] = {}
        self._work: dict[AttentionWindow, torch.Tensor] = {}
        self._window_keys: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def num_queries(self, rank: int) -> int:
        return self._num_queries[rank]

    def num_keys(self, rank: int) -> int:
        return self._num_keys[rank]

    def _seen_new_keys(self, k_rank: int) -> torch.Tensor:
        """[T] per new token, the new keys of its sequence on k_rank at or before it."""
        if k_rank not in self._new_keys_before:
            held = torch.cumsum(self.owners == k_rank, 0)
            before_seq = (held - (self.owners == k_rank).long())[self._seq_start.clamp(max=len(held) - 1)]
            self._new_keys_before[k_rank] = held - before_seq[self.seq]
            self.host_elements += 3 * len(held)
        return self._new_keys_before[k_rank]

    def _seen(self, k_rank: int) -> torch.Tensor:
        """[T] per new token, the keys of its sequence on k_rank at or before it."""
        return self._cached[k_rank][self.seq] + self._seen_new_keys(k_rank)

    def keys_seen(self, q_rank: int, k_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Under full attention, q_rank's queries that see any key on k_rank: (index [T'],
        seq [T'], count [T']) int64, where each is among q_rank's packed queries, its
        sequence, and how many of that sequence's keys on k_rank it sees (the first ones in
        position order)."""
        mine = self.owners == q_rank
        seen = self._seen(k_rank)[mine]
        index = torch.nonzero(seen > 0).flatten()
        self.host_elements += 3 * len(index)
        return index, self.seq[mine][index], seen[index]

    def _before_window(self, k_rank: int, window: AttentionWindow) -> torch.Tensor:
        """[T] per new token, the keys of its sequence on k_rank before the first position
        its window sees: those held before the step's recent blocks (CPStep.recent_blocks)
        plus the recent ones, listed by position, below it. O(lookback + new tokens) per
        sequence, nothing per older cached token."""
        key = (k_rank, window)
        if key not in self._skipped:
            assert len(self._recent_blocks) == len(self._num_tokens), "CPLayout needs the lookback of windows"
            bs = self._block_size
            skipped = torch.empty(len(self.seq), dtype=torch.int64)
            for s, (first_block, ranks) in enumerate(self._recent_blocks):
                t0, t1 = int(self._seq_start[s]), int(self._seq_start[s]) + self._num_tokens[s]
                if t1 == t0:
                    continue
                end = int(self.positions[t1 - 1]) + 1
                blocks = torch.tensor(
                    [first_block + i for i, r in enumerate(ranks) if r == k_rank], dtype=torch.int64
                )
                held = (blocks[:, None] * bs + torch.arange(bs)).flatten()
                held = held[held < end]  # [K] positions held on k_rank from the first recent block
                before = int(self.keys[k_rank, s]) - len(held)
                # Exact per layer; the recent blocks start at the layout's lookback bound, never
                # after it (config.first_visible_block), so `held` covers every firsts.
                firsts = window.first_visible(self.positions[t0:t1])
                skipped[t0:t1] = before + torch.searchsorted(held, firsts)
                self.host_elements += len(held) + 2 * (t1 - t0)
            self._skipped[key] = skipped
        return self._skipped[key]

    def _window_counts(self, k_rank: int, window: AttentionWindow):
        """A windowed layer gathers only the keys on k_rank that some query of the step sees:
        per sequence, from the first such key (offset [S]) on. -> (seen [T], first [T],
        keys [S], offset [S]), the counts of _seen / _before_window taken from there."""
        key = ("counts", k_rank, window)
        if key not in self._window_keys:
            seen, first = self._seen(k_rank), self._before_window(k_rank, window)
            sees = seen > first
            held = self.keys[k_rank]
            offset = held.clone().scatter_reduce(0, self.seq[sees], first[sees], "amin")
            at = offset[self.seq]
            self._window_keys[key] = (
                (seen - at).clamp(min=0),
                (first - at).clamp(min=0),
                held - offset,
                offset,
            )
        return self._window_keys[key]

    def local_key_rows(self, k_rank: int, window: AttentionWindow) -> torch.Tensor:
        """[K'] the rows of k_rank's packed keys (all it holds of each sequence) that a
        windowed layer gathers: each sequence's keys from the first one any query sees."""
        _, _, counts, offset = self._window_counts(k_rank, window)
        held = self.keys[k_rank]
        return _ranges(torch.cumsum(held, 0) - held + offset, counts)

    def pairs_with_work(self, window: AttentionWindow) -> torch.Tensor:
        """[N, N] bool: whether any query of rank q sees any key of rank k (a ring step
        between them that does nothing is skipped: no attention call, no transfer)."""
        if window not in self._work:
            work = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.bool)
            for k_rank in range(self.num_ranks):
                visible = self._seen(k_rank) > (0 if window.is_full else self._before_window(k_rank, window))
                seen_by = torch.bincount(self.owners[visible], minlength=self.num_ranks)
                work[:, k_rank] = seen_by > 0
            self._work[window] = work
        return self._work[window]

    def window_keys(
        self, q_rank: int, k_rank: int, window: AttentionWindow
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, the range lo .. hi - 1 of the keys a windowed layer gathers on
        k_rank (local_key_rows) that some query of q_rank sees: ([S], [S]) int64, lo == hi
        where none does. All a windowed pass-KV step sends."""
        key = (q_rank, k_rank, window)
        if key in self._window_keys:
            return self._window_keys[key]
        mine = self.owners == q_rank
        seen, first, _, _ = self._window_counts(k_rank, window)
        seq, seen, first = self.seq[mine], seen[mine], first[mine]
        sees = seen > first  # queries with at least one key here
        num_seqs = self.keys.shape[1]
        hi = torch.zeros(num_seqs, dtype=torch.int64).scatter_reduce(0, seq[sees], seen[sees], "amax")
        lo = torch.full((num_seqs,), 1 << 62, dtype=torch.int64).scatter_reduce(
            0, seq[sees], first[sees], "amin"
        )
        lo = torch.where(hi > 0, lo, 0)
        self._window_keys[key] = lo, torch.maximum(hi, lo)
        return self._window_keys[key]

    def window_key_index(self, q_rank: int, k_rank: int, window: AttentionWindow) -> torch.Tensor:
        """[K'] the rows of the keys k_rank gathers (local_key_rows) in window_keys."""
        lo, hi = self.window_keys(q_rank, k_rank, window)
        counts = self._window_counts(k_rank, window)[2]
        self.host_elements += 3 * int((hi - lo).sum())
        return _ranges(torch.cumsum(counts, 0) - counts + lo, hi - lo)

    def varlen(
        self,
        q_rank: int,
        k_rank: int,
        device,
        window: AttentionWindow = FULL_ATTENTION,
        trimmed: bool = False,
    ) -> VarlenBatch:
        """Attention metadata of q_rank's queries against k_rank's keys: each query sees the
        keys of its sequence there up to its position (the cached ones and the new ones
        at or before it; keys are packed per sequence in position order), from the first
        one its window sees: under a window, among the keys local_key_rows gathers, or
        (trimmed) only those of window_keys."""
        mine = self.owners == q_rank
        seq = self.seq[mine]
        q_lens, k_lens = self.queries[q_rank], self.keys[k_rank]
        if window.is_full:
            seen, first = self._seen(k_rank)[mine], None
        else:  # counted among the keys the layer gathers (local_key_rows)
            seen, first, k_lens, _ = self._window_counts(k_rank, window)
            seen, first = seen[mine], first[mine]
        if trimmed:
            lo, hi = self.window_keys(q_rank, k_rank, window)
            k_lens = hi - lo
            seen = (seen - lo[seq]).clamp(min=0).minimum(k_lens[seq])
            first = (first - lo[seq]).clamp(min=0).minimum(seen)
        cu_q = [0, *torch.cumsum(q_lens, 0).tolist()]
        cu_k = [0, *torch.cumsum(k_lens, 0).tolist()]
        q_positions = self.positions[mine]
        self.host_elements += 3 * len(seq) + len(cu_q) + len(cu_k)

        def to_device(t):
            return t.to(device, non_blocking=True)

        return VarlenBatch(
            cu_seqlens_q=to_device(torch.tensor(cu_q, dtype=torch.int32)),
            cu_seqlens_k=to_device(torch.tensor(cu_k, dtype=torch.int32)),
            max_seqlen_q=int(q_lens.max()) if len(q_lens) else 0,
            max_seqlen_k=int(k_lens.max()) if len(k_lens) else 0,
            q_positions=to_device(q_positions),
            k_positions=None,
            causal_suffix=False,
            q_bounds=cu_q,
            k_bounds=cu_k,
            seen_keys=to_device(seen),
            seen_keys_host=seen,
            first_keys=None if first is None else to_device(first),
            first_keys_host=first,
        )


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """starts[i] .. starts[i] + counts[i] - 1 for every i, concatenated ([sum(counts)] int64)."""
    total = int(counts.sum())
    first = torch.repeat_interleave(starts, counts, output_size=total)
    done = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    return first + torch.arange(total) - done
