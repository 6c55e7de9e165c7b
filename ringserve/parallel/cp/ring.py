"""The ring's communication and attention: RingAttention runs a step's plan (plan.py) by
pass-KV (KV travels, isend/irecv double-buffered, partials merged locally) or pass-Q
(queries travel, partials go home in one all-to-all), and reads a rank's own KV in place
through its block table where a decode step allows (the paged kernel)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention.dense import VarlenBatch, attention_rows
from ringserve.attention.paged import PagedBatch, paged_attention
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.kernels.kv_quant import FP8_DTYPE, dequantize_pair
from ringserve.kernels.lse_merge import merge_partials
from ringserve.parallel.cp.plan import RingStep


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
            dist.isend(_as_bytes(send), self.next_peer, group=self.group),
            dist.irecv(_as_bytes(recv), self.prev_peer, group=self.group),
        ]

    def __call__(self, q, k_local, v_local, window: AttentionWindow = FULL_ATTENTION, kv_scales=None):
        """q [Tq, NH, D]: this rank's new tokens; k/v_local [Tk, NKV, D]: the keys it holds
        (all of them; under a window, the rows local_key_rows picks), as its cache stores
        them: kv_scales (k_scale, v_scale) [NKV] float32 where that is FP8 (kernels/kv_quant.py)
        -> (out [Tq, NH, D], lse [Tq, NH] float32) over every rank's keys."""
        if self.algo == "pass_kv":
            # FP8 keys travel as they are stored (half bf16's bytes), dequantised per block
            return self._pass_kv(q, k_local, v_local, window, kv_scales)
        k_local, v_local = dequantize_pair(k_local, v_local, kv_scales, q.dtype)  # they stay here
        return self._pass_q(q, k_local, v_local, window)

    def _pass_kv(self, q, k_local, v_local, window: AttentionWindow = FULL_ATTENTION, kv_scales=None):
        if not window.is_full:
            return self._local_pass_kv(q, k_local, v_local, window, kv_scales)
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
            k, v = dequantize_pair(current[:n, 0], current[:n, 1], kv_scales, q.dtype)
            out, lse, first = attention_rows(q, k, v, self._batch(self.rank, src), self.scale)
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

    def attend_in_place(self, q, k_cache, v_cache, block_table, kv_scales=None):
        """pass-Q decode under full attention, this rank's keys read in place: q [Tq, NH, D]
        this rank's new tokens (their KV already stored); k/v_cache [slots, NKV, D]; block_table
        [rows, max_blocks] int32, this rank's share of the layer's KV group; kv_scales as
        __call__'s -> (out, lse) as __call__."""

        def attend_local(src, queries):
            batch, seeing = self._paged_batch(src)  # seeing: which of src's queries
            if batch is None:  # no query of src sees a key here
                return None
            out, lse = paged_attention(
                queries[seeing],
                k_cache,
                v_cache,
                block_table,
                batch,
                self.paged_keys.block_size,
                self.scale,
                kv_scales=kv_scales,
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
            requests.append(dist.isend(_as_bytes(send), peer, group=self.group))
            self.transfers += 1
        if recv_ok:
            peer = dist.get_global_rank(self.group, (self.rank - j) % self.size)
            requests.append(dist.irecv(_as_bytes(recv), peer, group=self.group))
        return requests

    def _local_pass_kv(self, q, k_local, v_local, window: AttentionWindow, kv_scales=None):
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
            k, v = dequantize_pair(keys[:, 0], keys[:, 1], kv_scales, q.dtype)
            out, lse, first = attention_rows(q, k, v, batch, self.scale)
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


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An FP8 block as bytes for the transport (gloo has no float8 type); others as they are."""
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x
