"""Context parallelism: exact ring attention over a sequence-sharded, persistent KV cache.

Every CP rank holds the whole model (or its TP shard) and the KV of the logical blocks
placed on it (cp_layout.place_blocks: load-balanced 2N chunks for a prefill, round robin
for decode). In a step, rank k computes the new tokens whose blocks it holds, writes
their KV into its cache, and attends them to every visible key of their sequences, wherever
it lies, by one of two rings:

- pass-KV: the KV a rank holds for the batch's sequences travels the ring; each rank
  attends its queries to the block it holds while it sends that block on and receives the
  next (isend/irecv, double-buffered); partials are merged locally by log-sum-exp.
- pass-Q: queries (with positions and sequences) travel; each rank attends them to its own
  KV; the partial outputs and LSEs go home in one all-to-all and are merged there. In a
  decode step (one new token a sequence) a full-attention layer reads the rank's own KV in
  place through its block table (RingAttention.attend_in_place, the paged kernel); other
  steps and windowed layers attend to the rank's keys gathered out of the cache.

Layers with a window (sliding, chunked) run only the ring steps whose pair of ranks shares
a visible key, each block sent straight from its owner (see RingAttention._local_pass_kv).

All ranks derive the same RingStep from the step's CPStep (every rank's new tokens, and
how many keys each rank holds of each sequence), so no sizes are exchanged, and every
message of a ring is padded to the largest rank's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention.dense import VarlenBatch, attention_rows
from ringserve.attention.paged import PagedBatch, paged_attention
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.kernels.lse_merge import merge_partials
from ringserve.measurements import load_measurement
from ringserve.parallel.cp_layout import CPStep

logger = logging.getLogger(__name__)


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


@dataclass
class PagedKeys:
    """How a rank reads its own KV cache in place: the row of its block tables of each of
    the step's sequences, the cache's block size, and the split-KV count for a batch of
    decode queries over at most so many keys (ModelRunner.decode_splits)."""

    seq_rows: list[int]
    block_size: int
    splits: Callable[[int, int], int]


class RingAttention:
    """Attention of this rank's new tokens over all ranks' KV, by pass-KV or pass-Q."""

    # Partial outputs pass-KV keeps before folding them into a running result: merging all
    # at the end is fastest for short prompts (one launch), but a rank's partials of a 1M-token
    # prompt over CP8 are 1 GiB each.
    max_partial_bytes = 512 << 20

    def __init__(
        self, group, step: RingStep, algo: str, scale: float, device, paged_keys: PagedKeys | None = None
    ):
        """paged_keys: where this rank's cache can be read in place; a pass-Q decode step
        then does so in its full-attention layers (attend_in_place)."""
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.step = step
        self.algo = algo
        self.scale = scale
        self.device = device
        # (query rank, key rank, window) -> attention metadata, built once per step for all
        # layers of that window: pass-KV attends this rank's queries to every rank's keys,
        # pass-Q every rank's queries to this rank's keys.
        self._batches = {}
        # Decode queries visit this rank one per sequence and see every key it holds of their
        # sequence: the paged kernel's decode rows. (pass-KV sends the rank's keys, so it
        # gathers them anyway; a longer chunk's queries would each read their keys alone.)
        self.paged_keys = paged_keys if algo == "pass_q" and step.is_decode else None
        for other in range(self.size):
            if self.paged_keys is not None:
                self._paged_batch(other)
            else:
                self._batch(*((self.rank, other) if algo == "pass_kv" else (other, self.rank)))
        # Windowed layers: ring steps this rank skipped (no attention call), and transfers
        # it made, summed over layers (tests read them).
        self.skipped_steps = 0
        self.transfers = 0
        self.sent_keys = 0  # pass-KV: keys sent (only those a window reaches)

    def _batch(self, q_rank: int, k_rank: int, window: AttentionWindow = FULL_ATTENTION) -> VarlenBatch:
        key = (q_rank, k_rank, window)
        if key not in self._batches:
            self._batches[key] = self.step.varlen(q_rank, k_rank, self.device, window)
        return self._batches[key]

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor):
        """Start sending `send` to the next rank and receiving into `recv` from the previous."""
        return [
            dist.isend(send, self.next_peer, group=self.group),
            dist.irecv(recv, self.prev_peer, group=self.group),
        ]

    def __call__(self, q, k_local, v_local, window: AttentionWindow = FULL_ATTENTION):
        """q [Tq, NH, D]: this rank's new tokens; k/v_local [Tk, NKV, D]: the keys it holds
        (all of them; under a window, the rows local_key_rows picks)
        -> (out [Tq, NH, D], lse [Tq, NH] float32) over every rank's keys."""
        if self.algo == "pass_kv":
            return self._pass_kv(q, k_local, v_local, window)
        return self._pass_q(q, k_local, v_local, window)

    def _pass_kv(self, q, k_local, v_local, window: AttentionWindow = FULL_ATTENTION):
        if not window.is_full:
            return self._local_pass_kv(q, k_local, v_local, window)
        longest = max(self.step.num_keys(r) for r in range(self.size))
        current = k_local.new_zeros(longest, 2, *k_local.shape[1:])  # K and V travel together
        current[: k_local.shape[0], 0] = k_local
        current[: k_local.shape[0], 1] = v_local
        incoming = torch.empty_like(current)
        outs, lses, first_rows = [], [], []
        rows = q.shape[0]
        for step in range(self.size):
            src = (self.rank - step) % self.size  # the rank this KV block started on
            pending = self._exchange(current, incoming) if step + 1 < self.size else []
            n = self.step.num_keys(src)
            out, lse, first = attention_rows(
                q, current[:n, 0], current[:n, 1], self._batch(self.rank, src), self.scale
            )
            outs.append(out)
            lses.append(lse)
            first_rows.append(first)
            if len(outs) > 1 and sum(o.nbytes for o in outs) > self.max_partial_bytes:
                # Long prompts: fold the partials into one float32 running result, so a rank
                # holds about two instead of N (a merge costs little next to such steps).
                merged = merge_partials(outs, lses, first_rows, rows, out_dtype=torch.float32)
                outs, lses, first_rows = [merged[0]], [merged[1]], [0]
            for request in pending:
                request.wait()
            current, incoming = incoming, current
        return merge_partials(outs, lses, first_rows, rows, out_dtype=q.dtype)

    def reads_in_place(self, window: AttentionWindow) -> bool:
        """Whether a layer with this window calls attend_in_place rather than gathering
        this rank's keys for __call__."""
        return self.paged_keys is not None and window.is_full

    def attend_in_place(self, q, k_cache, v_cache, block_table):
        """pass-Q decode under full attention, this rank's keys read in place: q [Tq, NH, D]
        this rank's new tokens (their KV already stored); k/v_cache [slots, NKV, D]; block_table
        [rows, max_blocks] int32, this rank's share of the layer's KV group -> (out, lse) as
        __call__."""

        def attend_local(src, queries):
            batch, seeing = self._paged_batch(src)  # seeing: which of src's queries
            if batch is None:  # no query of src sees a key here
                return None
            out, lse = paged_attention(
                queries[seeing], k_cache, v_cache, block_table, batch, self.paged_keys.block_size, self.scale
            )
            return out, lse, seeing

        return self._ring_q(q, attend_local)

    def _paged_batch(self, src: int) -> tuple[PagedBatch | None, slice | torch.Tensor | None]:
        """src's queries that see keys on this rank as the paged kernel's decode rows, each
        over the first keys of its sequence's row here; and where they are among src's
        queries (a slice where all are)."""
        key = ("paged", src)
        if key not in self._batches:
            index, seq, count = self.step.keys_seen(src, self.rank)
            n = len(index)
            if n == 0:
                self._batches[key] = None, None
                return self._batches[key]
            table_rows = [self.paged_keys.seq_rows[s] for s in seq.tolist()]
            lens = count.tolist()
            cu_q = list(range(n + 1))
            # table rows, lengths, query bounds (= each tile's sequence), each tile's first query
            dev = torch.tensor(table_rows + lens + cu_q + [0] * n, dtype=torch.int32).to(
                self.device, non_blocking=True
            )
            table_rows_d, lens_d, cu_q_d, zeros_d = dev.split([n, n, n + 1, n])
            splits = self.paged_keys.splits(n, max(lens))
            batch = PagedBatch(
                table_rows_d, cu_q_d, lens_d, cu_q_d[:n], zeros_d, 1, splits, cu_q, lens, table_rows
            )
            everyone = n == self.step.num_queries(src)
            where = slice(0, n) if everyone else index.to(self.device, non_blocking=True)
            self.step.host_elements += 4 * n + 1
            self._batches[key] = batch, where
        return self._batches[key]

    def _pass_q(self, q, k_local, v_local, window: AttentionWindow = FULL_ATTENTION):
        if not window.is_full:
            return self._local_pass_q(q, k_local, v_local, window)

        def attend_local(src, queries):
            out, lse, first = attention_rows(
                queries, k_local, v_local, self._batch(src, self.rank), self.scale
            )
            return out, lse, slice(first, first + out.shape[0])

        return self._ring_q(q, attend_local)

    def _ring_q(self, q, attend_local: Callable):
        """The pass-Q ring over every rank: attend_local(src, src's queries) -> None or (out,
        lse, rows): the partials of those queries (rows: a slice or index of them) that see
        this rank's keys."""
        longest = max(self.step.num_queries(r) for r in range(self.size))
        current = q.new_zeros(longest, *q.shape[1:])
        current[: q.shape[0]] = q
        incoming = torch.empty_like(current)
        outs = q.new_zeros(self.size, longest, *q.shape[1:])  # partials for each origin rank
        lses = torch.full((self.size, longest, q.shape[1]), float("-inf"), device=q.device)
        for step in range(self.size):
            src = (self.rank - step) % self.size  # whose queries these are
            pending = self._exchange(current, incoming) if step + 1 < self.size else []
            partial = attend_local(src, current[: self.step.num_queries(src)])
            if partial is not None:
                out, lse, rows = partial
                outs[src, rows] = out  # other rows stay 0 / -inf: unseen
                lses[src, rows] = lse
            for request in pending:
                request.wait()
            current, incoming = incoming, current
        # Send every origin its partials; receive ours from every rank.
        home_outs, home_lses = torch.empty_like(outs), torch.empty_like(lses)
        dist.all_to_all_single(home_outs, outs, group=self.group)
        dist.all_to_all_single(home_lses, lses, group=self.group)
        n = q.shape[0]
        return merge_partials([o[:n] for o in home_outs], [lse[:n] for lse in home_lses])

    # Windowed layers: only the steps with work -------------------------------------------
    #
    # Under a sliding window or attention chunks most pairs of ranks share no visible key
    # (a zigzag chunk longer than the window sees only its neighbours' chunks; Llama 4's
    # chunks can lie wholly on one rank). Every rank knows which pairs have work
    # (RingStep.pairs_with_work), so ring step j, between ranks j apart, runs only where it
    # has work: the block goes straight from its owner to the rank j ahead (not hop by hop
    # through ranks that would skip it), and a step nobody needs costs nothing at all.

    def _steps_with_work(self, work: torch.Tensor, q_ahead: bool) -> list[int]:
        """Ring distances j > 0 at which some pair has work: queries of x against keys of
        x - j (pass-KV) or of x + j (pass-Q, q_ahead)."""
        n = self.size
        sign = 1 if q_ahead else -1
        return [j for j in range(1, n) if any(bool(work[x, (x + sign * j) % n]) for x in range(n))]

    def _start_direct(self, j: int, send: torch.Tensor, recv: torch.Tensor, send_ok: bool, recv_ok: bool):
        """Send to the rank j ahead and receive from the rank j behind, where wanted."""
        requests = []
        if send_ok:
            peer = dist.get_global_rank(self.group, (self.rank + j) % self.size)
            requests.append(dist.isend(send, peer, group=self.group))
            self.transfers += 1
        if recv_ok:
            peer = dist.get_global_rank(self.group, (self.rank - j) % self.size)
            requests.append(dist.irecv(recv, peer, group=self.group))
        return requests

    def _local_pass_kv(self, q, k_local, v_local, window: AttentionWindow):
        work = self.step.pairs_with_work(window)  # [query rank, key rank]
        r, n = self.rank, self.size
        steps = self._steps_with_work(work, q_ahead=False)
        kv = torch.stack((k_local, v_local), 1)  # [K, 2, NKV, D]: K and V travel together

        def start(j):
            """Send the rank j ahead just the keys its queries' windows reach; receive ours."""
            ahead, behind = (r + j) % n, (r - j) % n
            send = kv[self._window_rows(ahead, r, window)] if work[ahead, r] else kv[:0]
            recv = kv.new_empty(self._window_size(r, behind, window), *kv.shape[1:])
            self.sent_keys += send.shape[0]
            return recv, self._start_direct(j, send, recv, bool(work[ahead, r]), bool(work[r, behind]))

        outs, lses, first_rows = [], [], []

        def attend(src, keys, batch):
            if not work[r, src]:
                self.skipped_steps += 1
                return
            out, lse, first = attention_rows(q, keys[:, 0], keys[:, 1], batch, self.scale)
            outs.append(out)
            lses.append(lse)
            first_rows.append(first)

        pending = start(steps[0]) if steps else None
        attend(r, kv, self._batch(r, r, window))
        self.skipped_steps += n - 1 - len(steps)
        for i, j in enumerate(steps):
            recv, requests = pending
            for request in requests:
                request.wait()
            pending = start(steps[i + 1]) if i + 1 < len(steps) else None
            src = (r - j) % n
            attend(src, recv, self._trimmed_batch(r, src, window))
        if not outs:  # no query on this rank
            return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), device=q.device)
        return merge_partials(outs, lses, first_rows, q.shape[0], out_dtype=q.dtype)

    def local_key_rows(self, window: AttentionWindow) -> torch.Tensor | None:
        """Rows of this rank's keys (all it holds of the step's sequences, per sequence in
        position order) a layer with this window attends to, on the device; None: all."""
        if window.is_full:
            return None
        key = ("local", window)
        if key not in self._batches:
            self._batches[key] = self.step.local_key_rows(self.rank, window).to(self.device)
        return self._batches[key]

    def _window_rows(self, q_rank: int, k_rank: int, window: AttentionWindow) -> torch.Tensor:
        key = ("rows", q_rank, k_rank, window)
        if key not in self._batches:
            self._batches[key] = self.step.window_key_index(q_rank, k_rank, window).to(self.device)
        return self._batches[key]

    def _window_size(self, q_rank: int, k_rank: int, window: AttentionWindow) -> int:
        lo, hi = self.step.window_keys(q_rank, k_rank, window)
        return int((hi - lo).sum())

    def _trimmed_batch(self, q_rank: int, k_rank: int, window: AttentionWindow) -> VarlenBatch:
        key = ("trimmed", q_rank, k_rank, window)
        if key not in self._batches:
            self._batches[key] = self.step.varlen(q_rank, k_rank, self.device, window, trimmed=True)
        return self._batches[key]

    def _local_pass_q(self, q, k_local, v_local, window: AttentionWindow):
        work = self.step.pairs_with_work(window)  # [query rank, key rank]
        r, n = self.rank, self.size
        steps = self._steps_with_work(work, q_ahead=True)
        longest = max(self.step.num_queries(x) for x in range(n))
        mine = q.new_zeros(longest, *q.shape[1:])
        mine[: q.shape[0]] = q
        buffers = [torch.empty_like(mine), torch.empty_like(mine)] if steps else []
        outs = q.new_zeros(n, longest, *q.shape[1:])  # partials for each origin rank
        lses = torch.full((n, longest, q.shape[1]), float("-inf"), device=q.device)

        def start(i):
            j = steps[i]
            return self._start_direct(
                j, mine, buffers[i % 2], bool(work[r, (r + j) % n]), bool(work[(r - j) % n, r])
            )

        def attend(src, queries):
            if not work[src, r]:
                self.skipped_steps += 1
                return
            count = self.step.num_queries(src)
            out, lse, first = attention_rows(
                queries[:count], k_local, v_local, self._batch(src, r, window), self.scale
            )
            outs[src, first : first + out.shape[0]] = out  # other rows stay 0 / -inf: unseen
            lses[src, first : first + out.shape[0]] = lse

        pending = start(0) if steps else []
        attend(r, mine)
        self.skipped_steps += n - 1 - len(steps)
        for i, j in enumerate(steps):
            for request in pending:
                request.wait()
            pending = start(i + 1) if i + 1 < len(steps) else []
            attend((r - j) % n, buffers[i % 2])
        home_outs, home_lses = torch.empty_like(outs), torch.empty_like(lses)
        dist.all_to_all_single(home_outs, outs, group=self.group)
        dist.all_to_all_single(home_lses, lses, group=self.group)
        count = q.shape[0]
        return merge_partials([o[:count] for o in home_outs], [lse[:count] for lse in home_lses])


# Choosing the ring (DESIGN.md 2.5) --------------------------------------------------------


@dataclass
class CPCalibration:
    attention_flops: float = 600e12  # achieved attention FLOP/s on one rank (C)
    link_bytes_per_s: float = 50e9  # CP link bandwidth (BW)

    @classmethod
    def load(cls, device_type: str) -> CPCalibration:
        """Measured by `ringserve bench cp-calibrate`, else defaults for the device type."""
        measured = load_measurement("cp_calibration", device_type)
        if measured:
            return cls(**measured)
        if device_type == "cpu":
            return cls(attention_flops=20e9, link_bytes_per_s=2e9)
        return cls()


def visible_cached_tokens(windows: tuple[AttentionWindow, ...], cached: list[int]) -> float:
    """The cached keys a step's new tokens can see, averaged over the layers (the cost model
    counts only those): a full layer sees every sequence's cache, a windowed one at most
    its lookback of it. windows: per layer (() all full); cached: per sequence."""
    if not windows or all(w.is_full for w in windows):
        return float(sum(cached))
    per_layer = [sum(p if w.is_full else min(p, w.lookback()) for p in cached) for w in windows]
    return sum(per_layer) / len(per_layer)


def choose_cp_algo(
    new_tokens: int,
    cached_tokens: int,
    cp_size: int,
    num_heads: int,
    num_kv_heads: int,
    element_bytes: int,
    calibration: CPCalibration,
) -> str:
    """pass_kv or pass_q for a step with T new and P cached tokens (DESIGN.md 2.5).

    pass-KV if its transfer hides under the attention compute (T >= N*C*NKV*e / (2*NH*BW)),
    or if the new tokens are a large enough share of the context once pass-Q's all-to-all
    is counted (T/(T+P) >= 2*NKV/NH - 4*T*BW / (N*C*e)); pass-Q otherwise.
    """
    t, p, n = new_tokens, cached_tokens, cp_size
    c, bw, e = calibration.attention_flops, calibration.link_bytes_per_s, element_bytes
    if t >= n * c * num_kv_heads * e / (2 * num_heads * bw):
        return "pass_kv"
    if t / (t + p) >= 2 * num_kv_heads / num_heads - 4 * t * bw / (n * c * e):
        return "pass_kv"
    return "pass_q"
