"""Turns one step's work into a packed forward pass on this rank, and the logits to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention import VarlenBatch
from ringserve.engine.kv_cache import KVCache, PagedAttentionContext
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.model import Transformer
from ringserve.parallel.comm import all_gather_stacked


@dataclass
class StepInput:
    """What every rank needs to run one step: plain lists, cheap to send to other ranks."""

    token_ids: list[list[int]]  # each sequence's new tokens
    starts: list[int]  # each sequence's tokens already in the cache (position of its first new token)
    block_tables: list[list[int]]
    sample: list[bool]  # whether the sequence's last known token is among its new ones

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepInput:
        token_ids, starts, tables, sample = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            token_ids.append(seq.token_ids[start : start + n])
            starts.append(start)
            tables.append(list(seq.block_table))
            sample.append(start + n == seq.num_tokens)
        return cls(token_ids, starts, tables, sample)


class ModelRunner:
    """Runs the model (this rank's shard) over a StepInput; gathers vocabulary shards."""

    def __init__(
        self, model: Transformer, kv_cache: KVCache, device: torch.device, all_reduce, tp_group=None
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.all_reduce = all_reduce
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.scale = model.config.head_dim**-0.5

    def prepare(self, step: StepInput):
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
            to_device(torch.cat(context_slots)),
            varlen,
            self.scale,
            self.all_reduce,
        )
        input_ids_t = to_device(torch.tensor(input_ids, dtype=torch.int64))
        return input_ids_t, positions_t, ctx, to_device(torch.tensor(sample_rows, dtype=torch.int64))

    @torch.inference_mode()
    def forward(self, step: StepInput, all_logits: bool = False) -> torch.Tensor:
        """Logits [S, V] float32 of the sequences that sample this step (all_logits: [T, V]
        for every new token, for checks and scoring)."""
        input_ids, positions, ctx, sample_rows = self.prepare(step)
        hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden if all_logits else hidden[sample_rows])
        return self._gather_vocab(logits)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_local] per rank -> [N, V] (the vocabulary is split over tp ranks)."""
        if self.tp_size == 1:
            return logits
        gathered = all_gather_stacked(logits, self.tp_group)  # [tp, N, V_local]
        full = gathered.permute(1, 0, 2).reshape(logits.shape[0], -1)
        return full[:, : self.model.config.vocab_size]
