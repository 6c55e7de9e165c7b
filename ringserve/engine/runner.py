"""Turns one step's work into a packed forward pass on this rank, and the logits to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention import VarlenBatch
from ringserve.engine.kv_cache import KVCache, PagedAttentionContext, RingAttentionContext
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.model import Transformer
from ringserve.parallel.comm import all_gather_stacked
from ringserve.parallel.cp import RingAttention, split_step


@dataclass
class StepInput:
    """What every rank needs to run one step: plain lists, cheap to send to other ranks."""

    token_ids: list[list[int]]  # each sequence's new tokens
    starts: list[int]  # each sequence's tokens already in the cache (position of its first new token)
    block_tables: list[list[int]]
    sample: list[bool]  # whether the sequence's last known token is among its new ones
    cp_algo: str = "pass_kv"  # the ring for this step under context parallelism

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepInput:
        token_ids, starts, tables, sample = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            token_ids.append(seq.token_slice(start, start + n))
            starts.append(start)
            tables.append(seq.block_table)  # read within this step, before the scheduler changes it
            sample.append(start + n == seq.num_tokens)
        return cls(token_ids, starts, tables, sample)


class ModelRunner:
    """Runs the model (this rank's shard) over a StepInput; gathers vocabulary shards, and
    under context parallelism the rows computed on other CP ranks."""

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        device: torch.device,
        all_reduce,
        run_experts,
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
        self.scale = model.config.head_dim**-0.5

    def prepare(self, step: StepInput):
        if self.cp_size > 1:
            return self._prepare_cp(step)
        return self._prepare_local(step)

    def _prepare_cp(self, step: StepInput):
        """This rank's new tokens and keys, and the ring that joins them to the others'."""
        bs = self.kv_cache.block_size
        counts = [len(t) for t in step.token_ids]
        shares, owners = split_step(
            counts, step.starts, step.block_tables, bs, self.kv_cache.num_blocks, self.cp_size
        )
        mine = owners == self.cp_rank
        all_ids = torch.tensor([t for tokens in step.token_ids for t in tokens], dtype=torch.int64)
        share = shares[self.cp_rank]
        positions = torch.cat(share.q_positions)
        # New tokens' slots: my keys are in ascending position order, the new ones last.
        new_slots = torch.cat(
            [
                slots[len(k_pos) - len(q_pos) :]
                for slots, k_pos, q_pos in zip(share.k_slots, share.k_positions, share.q_positions)
            ]
        )
        # Which packed new-token rows sample, and which rank computes each of them.
        ends = torch.tensor(counts).cumsum(0) - 1
        self._rows = _CPRows(owners, ends[torch.tensor(step.sample, dtype=torch.bool)], self.cp_size)
        dev = self.device
        ring = RingAttention(self.cp_group, shares, step.cp_algo, self.scale, dev)
        ctx = RingAttentionContext(
            self.kv_cache,
            new_slots.to(dev),
            self.all_reduce,
            self.run_experts,
            local_slots=torch.cat(share.k_slots).to(dev),
            ring=ring,
        )
        local_rows = self._rows.local_sample_rows(self.cp_rank)
        return all_ids[mine].to(dev), positions.to(dev), ctx, local_rows.to(dev)

    def _prepare_local(self, step: StepInput):
        """Host-side index building, then one copy of each tensor to the device."""
        bs = self.kv_cache.block_size
        input_ids, positions, slots, context_slots, k_positions = [], [], [], [], []
        cu_q, cu_k, sample_rows = [0], [0], []
        for tokens, start, table, sample in zip(step.token_ids, step.starts, step.block_tables, step.sample):
            end = start + len(tokens)
            input_ids += tokens
            offsets = torch.arange(end)
            context = torch.tensor(table, dtype=torch.int64)[offsets // bs] * bs + offsets % bs
            positions.append(offsets[start:])
            slots.append(context[start:])
            context_slots.append(context)
            k_positions.append(offsets)
            cu_q.append(cu_q[-1] + len(tokens))
            cu_k.append(cu_k[-1] + end)
            if sample:
                sample_rows.append(cu_q[-1] - 1)
        dev = self.device

        def to_device(t):
            return t.to(dev, non_blocking=True)

        positions_t = to_device(torch.cat(positions))
        varlen = VarlenBatch(
            cu_seqlens_q=to_device(torch.tensor(cu_q, dtype=torch.int32)),
            cu_seqlens_k=to_device(torch.tensor(cu_k, dtype=torch.int32)),
            max_seqlen_q=max(len(t) for t in step.token_ids),
            max_seqlen_k=max(b - a for a, b in zip(cu_k[:-1], cu_k[1:])),
            q_positions=positions_t,
            k_positions=to_device(torch.cat(k_positions)),
            causal_suffix=True,
            q_bounds=cu_q,
            k_bounds=cu_k,
        )
        ctx = PagedAttentionContext(
            self.kv_cache,
            to_device(torch.cat(slots)),
            self.all_reduce,
            self.run_experts,
            context_slots=to_device(torch.cat(context_slots)),
            batch=varlen,
            scale=self.scale,
        )
        input_ids_t = to_device(torch.tensor(input_ids, dtype=torch.int64))
        return input_ids_t, positions_t, ctx, to_device(torch.tensor(sample_rows, dtype=torch.int64))

    @torch.inference_mode()
    def forward(self, step: StepInput, all_logits: bool = False) -> torch.Tensor:
        """Logits [S, V] float32 of the sequences that sample this step (all_logits: [T, V]
        for every new token, for checks and scoring)."""
        input_ids, positions, ctx, sample_rows = self.prepare(step)
        hidden = self.model(input_ids, positions, ctx)
        logits = self._gather_vocab(self.model.compute_logits(hidden if all_logits else hidden[sample_rows]))
        if self.cp_size > 1:
            logits = self._rows.gather(logits, all_logits, self.cp_group, self.cp_rank)
        return logits

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_local] per rank -> [N, V] (the vocabulary is split over tp ranks)."""
        if self.tp_size == 1:
            return logits
        gathered = all_gather_stacked(logits, self.tp_group)  # [tp, N, V_local]
        full = gathered.permute(1, 0, 2).reshape(logits.shape[0], self.tp_size * logits.shape[1])
        return full[:, : self.model.config.vocab_size]


class _CPRows:
    """Which CP rank computes each new-token row of a step, to put gathered logits in order."""

    def __init__(self, owners: torch.Tensor, sample_rows: torch.Tensor, cp_size: int):
        self.owners = owners  # [T] rank computing each packed new token
        self.sample_rows = sample_rows  # packed rows whose logits are sampled
        self.cp_size = cp_size

    def local_sample_rows(self, rank: int) -> torch.Tensor:
        """Indices, among this rank's own tokens, of its sampled rows (in packed order)."""
        local_index = torch.cumsum(self.owners == rank, 0) - 1
        rows = self.sample_rows[self.owners[self.sample_rows] == rank]
        return local_index[rows]

    def gather(self, logits: torch.Tensor, all_rows: bool, group, rank: int) -> torch.Tensor:
        """Every rank's rows -> [R, V] in packed order (sampled rows, or all new tokens)."""
        rows = torch.arange(len(self.owners)) if all_rows else self.sample_rows
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
