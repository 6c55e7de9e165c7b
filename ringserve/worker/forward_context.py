"""The ForwardContext of one step on one rank (model/decoder.py's protocol): where each layer's new
KV is written in the paged cache, and the attention over it (paged, dense, or the CP ring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringserve.attention.dense import VarlenBatch, attention_with_lse
from ringserve.attention.paged import PagedBatch, gather_plan, paged_attention
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.kernels.elementwise import rotary_store_kv, store_kv
from ringserve.kernels.kv_quant import gather_kv
from ringserve.kernels.lse_merge import add_sinks
from ringserve.kernels.skinny_matmul import qkv_rope_store
from ringserve.parallel.cp.ring import RingAttention
from ringserve.worker.kv_cache import KVCache


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

    def layer_kv(self, layer: int):
        """(k_cache, v_cache, slots, kv_scales): this layer's caches, the slot of each new
        token, and an FP8 cache's (k_scale, v_scale) [NKV] (None for a cache in the model's dtype)."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        slots = self.slot_mapping[self.kv_cache.groups.layer_group[layer]]
        return k_cache, v_cache, slots, self.kv_cache.layer_scales(layer)

    def project_qkv(self, layer: int, x, qkv_proj, rope):
        """(q [T, NH, D], k, v [T, NKV, D]) of qkv_proj(x), q and k rotated by rope, with k
        and v already stored in the cache: one kernel where the skinny matmul runs."""
        k_cache, v_cache, slots, scales = self.layer_kv(layer)
        fused = qkv_rope_store(
            x,
            qkv_proj.weight,
            qkv_proj.bias,
            rope.cos,
            rope.sin,
            k_cache,
            v_cache,
            slots,
            kv_scales=scales,
            weight_scale=qkv_proj.weight_scale,
        )
        if fused is not None:
            return fused
        head_dim = k_cache.shape[-1]
        q, k, v = (part.view(x.shape[0], part.shape[-1] // head_dim, head_dim) for part in qkv_proj(x))
        q, k = rotary_store_kv(q, k, v, rope.cos, rope.sin, k_cache, v_cache, slots, kv_scales=scales)
        return q, k, v

    def write_kv(self, layer: int, q, k, v, rope, kv_stored: bool):
        """Store the new tokens' KV (unless kv_stored: project_qkv did), rotating q and k
        first when rope is given (one kernel); returns (q, k, this layer's k_cache, v_cache,
        kv_scales)."""
        assert rope is None or not kv_stored, "project_qkv has rotated q and k already"
        k_cache, v_cache, slots, scales = self.layer_kv(layer)
        if rope is not None:
            q, k = rotary_store_kv(q, k, v, rope.cos, rope.sin, k_cache, v_cache, slots, kv_scales=scales)
        elif not kv_stored:
            store_kv(k, v, k_cache, v_cache, slots, scales)
        return q, k, k_cache, v_cache, scales

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
      every sequence's keys in place through its block table;
    - gather_paged (long chunks after a cached prefix, no decode row): each sequence's
      keys are gathered once per KV group and window, then dense attention, whose cuDNN
      blocks outrun the paged kernel on long chunks (runner.gathers_long_chunks).
    """

    scale: float
    dense: VarlenBatch | None = None
    paged: PagedBatch | None = None
    block_tables: torch.Tensor | None = None  # [groups, rows, max_blocks] int32, the runner's
    gather_paged: bool = False
    # (KV group, window) -> (slots, VarlenBatch) of the gathered keys; made by the first layer
    _gathered: dict = field(default_factory=dict)

    def attend(self, layer: int, q, k, v, sinks=None, rope=None, kv_stored=False):
        q, k, k_cache, v_cache, scales = self.write_kv(layer, q, k, v, rope, kv_stored)
        window = self.window(layer)
        if self.dense is not None:
            if scales is not None:
                # An FP8 cache: the prompt's keys as the cache holds them, as every later
                # step (and a CP ring's prefill) reads them. A copy of this step's rows only.
                k, v = gather_kv(k_cache, v_cache, self.layer_kv(layer)[2], scales, q.dtype)
            out, lse = attention_with_lse(q, k, v, self.dense, self.scale, window)
        elif self.gather_paged:
            group = self.kv_cache.groups.layer_group[layer]
            if (group, window) not in self._gathered:
                self._gathered[group, window] = gather_plan(
                    self.block_tables[group], self.paged, self.kv_cache.block_size, window, q.device
                )
            slots, varlen = self._gathered[group, window]
            k, v = gather_kv(k_cache, v_cache, slots, scales, q.dtype)
            out, lse = attention_with_lse(q, k, v, varlen, self.scale, window)
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
                kv_scales=scales,
            )
        return add_sinks(out, lse, sinks)


@dataclass(kw_only=True)
class RingAttentionContext(_StepContext):
    """ForwardContext of one step on one CP rank: this rank's new KV goes to its slots; its
    queries meet every rank's keys through the ring (pass-KV or pass-Q). A pass-Q decode step
    reads each rank's keys in place in full-attention layers; other layers and steps gather
    the keys the rank holds."""

    # [groups, K_mine] per KV group, local slots of every key this rank holds, per sequence;
    # None where no layer of the step gathers them (RingAttention.reads_in_place)
    local_slots: torch.Tensor | None
    ring: RingAttention
    block_tables: torch.Tensor  # [groups, rows, max_blocks] int32: this rank's share

    def attend(self, layer: int, q, k, v, sinks=None, rope=None, kv_stored=False):
        q, k, k_cache, v_cache, scales = self.write_kv(layer, q, k, v, rope, kv_stored)
        window = self.window(layer)
        group = self.kv_cache.groups.layer_group[layer]
        if self.ring.reads_in_place(window):
            out, lse = self.ring.attend_in_place(q, k_cache, v_cache, self.block_tables[group], scales)
            return add_sinks(out, lse, sinks)
        rows = self.ring.local_key_rows(window)  # a window: only the keys some query sees
        slots = self.local_slots[group] if rows is None else self.local_slots[group][rows]
        # An FP8 cache's keys stay FP8 on the ring (pass-KV sends half the bytes); each
        # block is dequantised where it is attended.
        out, lse = self.ring(q, k_cache[slots], v_cache[slots], window, scales)
        return add_sinks(out, lse, sinks)
