"""The ForwardContext of one step on one rank (model.py's protocol): where each layer's new
KV is written in the paged cache, and the attention over it (paged, dense, or the CP ring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringserve.attention import VarlenBatch, attention_with_lse
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.engine.kv_cache import KVCache
from ringserve.kernels import rotary_store_kv, store_kv
from ringserve.lse_merge import add_sinks
from ringserve.paged_attention import PagedBatch, paged_attention


@dataclass
class _StepContext:
    """What every ForwardContext of a step shares: the cache, and the TP and expert ops."""

    kv_cache: KVCache
    # [groups, T] cache slot of each new token in each KV group (this rank's, under CP)
    slot_mapping: torch.Tensor
    tp_all_reduce: Callable[[torch.Tensor], torch.Tensor]  # the sum over tensor-parallel ranks
    experts: Callable  # LocalExperts or ExpertParallel (parallel/ep.py)
    windows: tuple[AttentionWindow, ...] = ()  # per layer (ModelConfig.attention_windows); () all full

    def window(self, layer: int) -> AttentionWindow:
        return self.windows[layer] if self.windows else FULL_ATTENTION

    def write_kv(self, layer: int, q, k, v, rope):
        """Store the new tokens' KV, rotating q and k first when rope is given (one kernel);
        returns (q, k, this layer's k_cache, v_cache)."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        slots = self.slot_mapping[self.kv_cache.groups.layer_group[layer]]
        if rope is None:
            store_kv(k, v, k_cache, v_cache, slots)
        else:
            q, k = rotary_store_kv(q, k, v, rope.cos, rope.sin, k_cache, v_cache, slots)
        return q, k, k_cache, v_cache

    def all_reduce(self, x):
        return self.tp_all_reduce(x)

    def run_experts(self, experts, x, expert_ids, weights):
        return self.experts(experts, x, expert_ids, weights)


@dataclass(kw_only=True)
class PagedAttentionContext(_StepContext):
    """ForwardContext of one step on one rank: new KV goes to its slots, then

    - dense: every sequence is a fresh prompt, its keys exactly this step's tokens: dense
      varlen attention over the new k and v (the cache is only written);
    - otherwise (decode, chunks after a cached prefix, mixed steps): paged attention reads
      every sequence's keys in place through its block table.
    """

    scale: float
    dense: VarlenBatch | None = None
    paged: PagedBatch | None = None
    block_tables: torch.Tensor | None = None  # [groups, rows, max_blocks] int32, the runner's

    def attend(self, layer: int, q, k, v, sinks=None, rope=None):
        q, k, k_cache, v_cache = self.write_kv(layer, q, k, v, rope)
        window = self.window(layer)
        if self.dense is not None:
            out, lse = attention_with_lse(q, k, v, self.dense, self.scale, window)
        else:
            out, lse = paged_attention(
                q,
                k_cache,
                v_cache,
                self.block_tables[self.kv_cache.groups.layer_group[layer]],
                self.paged,
                self.kv_cache.block_size,
                self.scale,
                window,
            )
        return add_sinks(out, lse, sinks)


@dataclass(kw_only=True)
class RingAttentionContext(_StepContext):
    """ForwardContext of one step on one CP rank: this rank's new KV goes to its slots; its
    queries meet every rank's keys through the ring (pass-KV or pass-Q)."""

    # [groups, K_mine] per KV group, local slots of every key this rank holds, per sequence
    local_slots: torch.Tensor
    ring: Callable  # RingAttention: (q, k_local, v_local, window) -> (out, lse)

    def attend(self, layer: int, q, k, v, sinks=None, rope=None):
        q, k, k_cache, v_cache = self.write_kv(layer, q, k, v, rope)
        window = self.window(layer)
        rows = self.ring.local_key_rows(window)  # a window: only the keys some query sees
        group_slots = self.local_slots[self.kv_cache.groups.layer_group[layer]]
        slots = group_slots if rows is None else group_slots[rows]
        out, lse = self.ring(q, k_cache[slots], v_cache[slots], window)
        return add_sinks(out, lse, sinks)
