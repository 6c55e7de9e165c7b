"""Turns a scheduled batch into one packed forward pass and the logits to sample from."""

from __future__ import annotations

import torch

from ringserve.attention import VarlenBatch
from ringserve.engine.kv_cache import KVCache, PagedAttentionContext
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.model import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.scale = model.config.head_dim**-0.5
        self.num_forward_tokens = 0  # tokens computed so far (prefix-cache hits skip theirs)

    def prepare(self, batch: ScheduledBatch):
        """Host-side index building, then one copy of each tensor to the device."""
        bs = self.kv_cache.block_size
        input_ids, positions, slots, context_slots = [], [], [], []
        cu_q, cu_k, sample_rows = [0], [0], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            offsets = torch.arange(end)
            context = torch.tensor(seq.block_table, dtype=torch.int64)[offsets // bs] * bs + offsets % bs
            slots.append(context[start:])
            context_slots.append(context)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            if end == seq.num_tokens:  # the last known token: its logits give the next one
                sample_rows.append(cu_q[-1] - 1)
        dev = self.device

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        positions_t = tensor(positions)
        k_positions = torch.cat([torch.arange(cu_k[i + 1] - cu_k[i]) for i in range(len(cu_k) - 1)])
        varlen = VarlenBatch(
            cu_seqlens_q=tensor(cu_q, torch.int32),
            cu_seqlens_k=tensor(cu_k, torch.int32),
            max_seqlen_q=max(batch.num_tokens),
            max_seqlen_k=max(cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)),
            q_positions=positions_t,
            k_positions=k_positions.to(dev),
            causal_suffix=True,
            q_bounds=cu_q,
            k_bounds=cu_k,
        )
        ctx = PagedAttentionContext(
            self.kv_cache,
            torch.cat(slots).to(dev, non_blocking=True),
            torch.cat(context_slots).to(dev, non_blocking=True),
            varlen,
            self.scale,
        )
        return tensor(input_ids), positions_t, ctx, tensor(sample_rows)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits [S, V] float32 for the sequences of the batch that reached their last
        token (all_logits: [T, V] for every computed token, for checks and scoring)."""
        input_ids, positions, ctx, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, ctx)
        self.num_forward_tokens += int(input_ids.shape[0])
        return self.model.compute_logits(hidden if all_logits else hidden[sample_rows])
