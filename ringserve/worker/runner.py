"""Turns one step's work into a packed forward pass on this rank, and the logits to sample."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringserve.attention.dense import CUDNN_MIN_LEN, VarlenBatch
from ringserve.attention.paged import PagedBatch, decode_splits, fits_one_block, tile_queries
from ringserve.config import FULL_ATTENTION
from ringserve.model.decoder import Transformer
from ringserve.parallel.comm import all_gather_stacked
from ringserve.parallel.cp.plan import RingStep
from ringserve.parallel.cp.ring import PagedKeys, RingAttention
from ringserve.worker.forward_context import PagedAttentionContext, RingAttentionContext
from ringserve.worker.kv_cache import KVCache
from ringserve.worker.step_input import StepInput
from ringserve.worker.step_state import BlockTables, decode_step_tensors, fill_pending_tokens, token_slots

# A step gathers the keys of long chunks (ModelRunner.gathers_long_chunks) only while one
# layer's gathered copy of K and V stays within this: 1 GiB is 256K tokens of Llama-3-8B's
# 8 KV heads x 128 dims in bfloat16 (4 KiB a token), held for one layer at a time.
_GATHER_BYTES = 1 << 30


class ModelRunner:
    """Runs the model (this rank's shard) over a StepInput; gathers vocabulary shards, and
    under context parallelism the rows computed on other CP ranks.

    The step state persists on the device (`BlockTables`); a step's host work is its new
    tokens and sequences: positions, slots and attention metadata are made from them on
    the device.
    """

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        device: torch.device,
        all_reduce,
        run_experts,
        max_rows: int,
        max_model_len: int,
        tp_group=None,
        cp_group=None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.all_reduce = all_reduce
        self.run_experts = run_experts
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        config = model.config
        self.scale = config.attention_scale
        self.num_kv_heads = model.shard.num_kv_heads
        self.num_heads = model.shard.num_heads
        self.max_model_len = max_model_len
        for rotary in model.model.rotary_emb.values():  # every position a sequence can reach
            rotary.cache_tables(max_model_len, model.model.embed_tokens.weight.dtype)
        bs = kv_cache.block_size
        self.block_tables = BlockTables(
            len(kv_cache.groups.groups), max_rows, -(-max_model_len // bs) + 1, kv_cache.pad_block, device
        )
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        )
        # Decode tiles are one per sequence, from the start of its queries.
        self._arange = torch.arange(max_rows + 2, dtype=torch.int32, device=device)
        self._zeros = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.host_elements = 0  # host-built index elements, summed over steps (tests count them)
        self.graphs = None  # DecodeGraphs, set by the worker on CUDA unless eager is enforced

    def decode_splits(self, batch: int, context: int) -> int:
        """Split-KV programs per (sequence, KV head) of a decode step of `batch` sequences of
        at most `context` keys (paged_attention.decode_splits); one on the CPU."""
        if self.device.type != "cuda":
            return 1
        return decode_splits(batch, self.num_kv_heads, self.keys_read(context), self.num_sms)

    def keys_read(self, context: int) -> int:
        """The most keys a decode query reads at this context length: the longest window's
        reach when every layer is windowed (split-KV is sized by it)."""
        config = self.model.config
        return min(context, config.local_lookback + 1) if config.all_layers_local else context

    def _apply_table_updates(self, step: StepInput) -> None:
        # Under CP this rank's table holds its share: the local blocks the layout sent it.
        updates = step.table_updates if step.cp is None else step.cp.table_updates[self.cp_rank]
        self.block_tables.apply(updates)
        self.host_elements += sum(4 * len(blocks) for *_, blocks in updates)

    def prepare(self, step: StepInput, pending_tokens: torch.Tensor | None = None):
        self._apply_table_updates(step)
        if self.cp_size > 1:
            if step.pending:
                raise ValueError("tokens pending on the device (async scheduling) need one rank")
            return self._prepare_cp(step)
        return self._prepare_local(step, pending_tokens)

    def _prepare_cp(self, step: StepInput):
        """This rank's new tokens and keys, and the ring that joins them to the others'.
        Host work: the step's new tokens, and its sequences times the ranks (RingStep)."""
        counts = [len(t) for t in step.token_ids]
        ring_step = RingStep(step.cp, counts, self.cp_size)
        mine = ring_step.owners == self.cp_rank
        all_ids = torch.tensor([t for tokens in step.token_ids for t in tokens], dtype=torch.int64)
        # Which packed new-token rows give logits, and which rank computes each of them.
        self._rows = _CPRows(
            ring_step.owners, torch.tensor(step.logit_rows(), dtype=torch.int64), self.cp_size
        )
        local_rows = self._rows.local_logit_rows(self.cp_rank)
        dev = self.device
        bs = self.kv_cache.block_size
        ring = RingAttention(
            self.cp_group,
            ring_step,
            step.cp_algo,
            self.scale,
            dev,
            PagedKeys(step.rows, bs, self.decode_splits),
        )
        windows = self.model.config.attention_windows
        key_slots = None
        if not all(ring.reads_in_place(w) for w in windows or (FULL_ATTENTION,)):
            # Every key this rank holds of the step's sequences, new ones included, packed per
            # sequence in position order (what the ring's metadata counts): [G, K_mine].
            key_slots = self.block_tables.key_slots(step.rows, ring_step.keys[self.cp_rank].tolist(), bs)
        ctx = RingAttentionContext(
            self.kv_cache,
            ring_step.slots[:, mine].to(dev),  # [G, T_mine]
            self.all_reduce,
            self.run_experts,
            local_slots=key_slots,
            ring=ring,
            block_tables=self.block_tables.tables,
            windows=windows,
        )
        self.host_elements += (
            step.cp.num_host_elements
            + ring_step.host_elements
            + 2 * len(all_ids)
            + len(counts)
            + 3 * len(self._rows.owners)
            + 2 * len(step.rows)
        )
        return all_ids[mine].to(dev), ring_step.positions[mine].to(dev), ctx, local_rows.to(dev)

    def _prepare_local(self, step: StepInput, pending_tokens: torch.Tensor | None):
        """Per new token: id, position, row; per sequence: row, query bounds, length. One
        copy to the device; slots and attention metadata are derived there."""
        q_lens = [len(t) for t in step.token_ids]
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        seq_lens = [start + n for start, n in zip(step.starts, q_lens)]
        input_ids = [t for tokens in step.token_ids for t in tokens]
        positions, token_rows = [], []
        for row, start, n in zip(step.rows, step.starts, q_lens):
            positions += range(start, start + n)
            token_rows += [row] * n
        logit_rows = step.logit_rows()
        decode = all(n == 1 for n in q_lens)
        fresh = not any(step.starts)  # fresh prompts: their keys are this step's tokens
        qpt = tile_queries(self.num_heads, self.num_kv_heads, decode)
        tile_seq, tile_q0 = [], []
        if not (decode or fresh):  # query tiles of the paged kernel
            for i, n in enumerate(q_lens):
                tile_seq += [i] * -(-n // qpt)
                tile_q0 += range(0, n, qpt)
        host = torch.tensor(
            input_ids
            + positions
            + token_rows
            + logit_rows
            + step.rows
            + cu_q
            + seq_lens
            + tile_seq
            + tile_q0
            + [i for pair in step.pending for i in pair],
            dtype=torch.int64,
        )
        self.host_elements += host.numel()
        dev = host.to(self.device, non_blocking=True)
        t, b, p = len(input_ids), len(q_lens), 2 * len(step.pending)
        ids, pos, token_rows_d, logit_rows_d, small, pending = dev.split(
            [t, t, t, len(logit_rows), dev.numel() - 3 * t - len(logit_rows) - p, p]
        )
        if step.pending:
            fill_pending_tokens(ids, pending.view(-1, 2), pending_tokens)
        small = small.to(torch.int32)
        seq_rows_d, cu_q_d, seq_lens_d, tiles = small.split([b, b + 1, b, small.numel() - 3 * b - 1])
        slots = token_slots(self.block_tables.tables, token_rows_d, pos, self.kv_cache.block_size)
        if fresh:
            varlen = VarlenBatch(
                cu_seqlens_q=cu_q_d,
                cu_seqlens_k=cu_q_d,
                max_seqlen_q=max(q_lens),
                max_seqlen_k=max(q_lens),
                q_positions=pos,
                k_positions=pos,
                causal_suffix=True,
                q_bounds=cu_q,
                k_bounds=cu_q,
            )
            ctx = self._context(slots, dense=varlen)
        else:
            if decode:
                tile_seq_d, tile_q0_d = self._arange[:b], self._zeros[:b]
            else:
                tile_seq_d, tile_q0_d = tiles.split(len(tile_seq))
            splits = self.decode_splits(b, max(seq_lens)) if decode else 1
            paged = PagedBatch(
                seq_rows_d, cu_q_d, seq_lens_d, tile_seq_d, tile_q0_d, qpt, splits, cu_q, seq_lens, step.rows,
                one_block=decode and fits_one_block(max(seq_lens), splits),
            )  # fmt: skip
            gather = self.gathers_long_chunks(q_lens, seq_lens)
            ctx = self._context(slots, paged=paged, gather_paged=gather)
        return ids, pos, ctx, logit_rows_d

    def gathers_long_chunks(self, q_lens: list[int], seq_lens: list[int]) -> bool:
        """Whether a step of chunks after cached prefixes gathers their keys for dense
        attention (PagedAttentionContext.gather_paged): on a GPU in half precision when
        every sequence brings CUDNN_MIN_LEN new tokens or more, where cuDNN's blocks run
        at about twice the paged kernel's speed (bench/bench_prefill_kernels.py), and the
        copy of one layer's keys and values fits _GATHER_BYTES. Decode rows, short chunks
        and longer contexts read in place."""
        dtype = self.model.model.embed_tokens.weight.dtype
        if self.device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return False
        copy_bytes = 2 * sum(seq_lens) * self.kv_cache.k[0, 0].numel() * dtype.itemsize
        return min(q_lens) >= CUDNN_MIN_LEN and copy_bytes <= _GATHER_BYTES

    def _context(self, slots, dense=None, paged=None, gather_paged=False) -> PagedAttentionContext:
        return PagedAttentionContext(
            self.kv_cache,
            slots,
            self.all_reduce,
            self.run_experts,
            scale=self.scale,
            dense=dense,
            paged=paged,
            block_tables=self.block_tables.tables,
            windows=self.model.config.attention_windows,
            gather_paged=gather_paged,
        )

    def decode_logits(self, inputs, num_splits: int, one_block: bool = False, out=None) -> torch.Tensor:
        """A decode step from device tensors alone (what a CUDA graph captures): inputs [4, B]
        int64 (token ids, positions, block-table rows, lengths after the step) -> logits
        [B, V] float32, written into out [B, V] when given. Padded rows (the pad row, length
        0) write only the scratch block and see no key. one_block: the caller knows every
        length fits one loop step per split (PagedBatch.one_block)."""
        b = inputs.shape[1]
        input_ids, positions = inputs[0], inputs[1]
        rows, seq_lens, slots = decode_step_tensors(
            inputs, self.block_tables.tables, self.kv_cache.block_size
        )
        paged = PagedBatch(
            rows,
            self._arange[: b + 1],
            seq_lens,
            self._arange[:b],
            self._zeros[:b],
            1,
            num_splits,
            one_block=one_block,
        )
        ctx = self._context(slots, paged=paged)
        hidden = self.model(input_ids, positions, ctx)
        if self.tp_size == 1:
            return self.model.compute_logits(hidden, out=out)
        logits = self._gather_vocab(self.model.compute_logits(hidden))
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def forward(
        self, step: StepInput, all_logits: bool = False, pending_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [S + R, V] float32: the S sequences that sample this step, then the R rows
        of step.scored (all_logits: [T, V] for every new token, for checks). pending_tokens:
        the previous step's sampled ids [S'] on the device, which step.pending points into."""
        if (
            self.graphs is not None
            and not all_logits
            and (step.is_decode or step.is_verify)
            and self.graphs.fits(step)
        ):
            self._apply_table_updates(step)
            logits = self.graphs.run(step, pending_tokens)  # [new tokens, V]
            if step.is_verify:  # the rows the engine reads, in logit_rows order (a copy)
                logits = logits[torch.tensor(step.logit_rows(), device=logits.device)]
            return logits
        input_ids, positions, ctx, logit_rows = self.prepare(step, pending_tokens)
        hidden = self.model(input_ids, positions, ctx)
        capture = self.model.hidden_capture  # an EAGLE-3 head's input (model/eagle3.py)
        if self.cp_size > 1 and capture is not None:
            capture.gather_ring(self._rows.owners, self.cp_group)
        logits = self._gather_vocab(self.model.compute_logits(hidden if all_logits else hidden[logit_rows]))
        if self.cp_size > 1:
            logits = self._rows.gather(logits, all_logits, self.cp_group, self.cp_rank)
        return logits

    @torch.inference_mode()
    def warm_up_cached_prefill(self) -> None:
        """One step of a chunk after a cached prefix, so that the paged kernel's prefill
        tiles (one Triton compile per tile configuration, about a second) are built before
        the first prefix-cache hit or mixed step. It runs in the block tables' pad row,
        which points only at the KV cache's scratch block: no real block is written."""
        pad_row = self.block_tables.pad_row
        queries = 2 * tile_queries(self.num_heads, self.num_kv_heads, decode=False)
        step = StepInput(
            rows=[pad_row],
            token_ids=[[0] * queries],
            starts=[self.kv_cache.block_size],
            sample=[True],
            table_updates=[],
        )
        self.forward(step)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_local] per rank -> [N, V] (the vocabulary is split over tp ranks)."""
        if self.tp_size == 1:
            return logits
        gathered = all_gather_stacked(logits, self.tp_group)  # [tp, N, V_local]
        full = gathered.permute(1, 0, 2).reshape(logits.shape[0], self.tp_size * logits.shape[1])
        return full[:, : self.model.config.vocab_size]


class _CPRows:
    """Which CP rank computes each new-token row of a step, to put gathered logits in order."""

    def __init__(self, owners: torch.Tensor, logit_rows: torch.Tensor, cp_size: int):
        self.owners = owners  # [T] rank computing each packed new token
        self.logit_rows = logit_rows  # [R] packed rows whose logits the step returns, in order
        self.cp_size = cp_size

    def local_logit_rows(self, rank: int) -> torch.Tensor:
        """Indices, among this rank's own tokens, of its logit rows (in logit_rows order)."""
        local_index = torch.cumsum(self.owners == rank, 0) - 1
        rows = self.logit_rows[self.owners[self.logit_rows] == rank]
        return local_index[rows]

    def gather(self, logits: torch.Tensor, all_rows: bool, group, rank: int) -> torch.Tensor:
        """Every rank's rows -> [R, V] in logit_rows order (or all new tokens in packed order)."""
        rows = torch.arange(len(self.owners)) if all_rows else self.logit_rows
        row_owner = self.owners[rows]
        counts = [int((row_owner == r).sum()) for r in range(self.cp_size)]
        longest = max(counts)
        padded = logits.new_zeros(longest, logits.shape[-1])
        padded[: logits.shape[0]] = logits
        gathered = all_gather_stacked(padded, group)  # [cp, longest, V]
        # The k-th row of rank r is that rank's k-th row in packed order.
        index_in_rank = torch.zeros(len(rows), dtype=torch.int64)
        for r in range(self.cp_size):
            mask = row_owner == r
            index_in_rank[mask] = torch.arange(int(mask.sum()))
        return gathered[row_owner.to(logits.device), index_in_rank.to(logits.device)]
