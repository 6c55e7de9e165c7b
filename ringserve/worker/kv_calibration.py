"""The scales of an FP8 KV cache (kernels/kv_quant.py): a checkpoint's own where it has them
(checkpoint_kv_scales), else calibrated once at start-up (calibrate_kv_scales).

e4m3 keeps 3 mantissa bits only between 2^-6 and 448 (times the scale). A scale of 1.0
(vLLM's default without calibrated scales) saturates any key or value past 448 and leaves
small-valued heads below the normal range (on SmolLM2-135M 46% of V's values). So the
engine runs one prefill of a calibration text before serving, takes each layer's largest
|k| and |v| per KV head, and sets scale = amax x HEADROOM / 448: every value the calibration
saw lands in the normal range, with room for HEADROOM times larger ones before saturating.
Headroom costs no precision (e4m3's relative step is the same across its range); it moves
the bottom of the range up, where values are too small to change an attention score.
bench/fp8_accuracy.py measures the choices: on SmolLM2-135M they differ little (perplexity
+0.9% to +1.8% over bf16 KV, KL 1.7e-2 for each; the keys' 3-bit mantissa dominates, not
the scale), so the choice is made for range, not for that model's accuracy.

Every rank of a context-parallel group takes the same scales (the max over the group), so
a block written on one rank reads right on another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention.dense import VarlenBatch, attention_with_lse
from ringserve.errors import ModelLoadError
from ringserve.kernels.elementwise import rotary_qk
from ringserve.kernels.kv_quant import FP8_MAX
from ringserve.kernels.lse_merge import add_sinks
from ringserve.worker.forward_context import PagedAttentionContext

HEADROOM = 4.0  # calibrated amax x this = the largest value a head stores unsaturated


@dataclass(kw_only=True)
class _RecordingContext(PagedAttentionContext):
    """A fresh prompt's forward in the model's dtype (unquantised) that writes no cache and records each
    layer's largest |k| and |v| per KV head in amax [layers, 2, NKV]."""

    amax: torch.Tensor

    def project_qkv(self, layer: int, x, qkv_proj, rope):
        head_dim = self.kv_cache.k.shape[-1]
        q, k, v = (part.view(x.shape[0], part.shape[-1] // head_dim, head_dim) for part in qkv_proj(x))
        return (*rotary_qk(q, k, rope.cos, rope.sin), v)

    def attend(self, layer: int, q, k, v, sinks=None, rope=None, kv_stored=False):
        if rope is not None:  # the cache holds rotated keys
            q, k = rotary_qk(q, k, rope.cos, rope.sin)
        for i, x in enumerate((k, v)):
            torch.maximum(self.amax[layer, i], x.abs().amax(dim=(0, 2)).float(), out=self.amax[layer, i])
        out, lse = attention_with_lse(q, k, v, self.dense, self.scale, self.window(layer))
        return add_sinks(out, lse, sinks)


@torch.inference_mode()
def calibrate_kv_scales(runner, token_ids: list[int], cp_group=None) -> torch.Tensor:
    """Measure runner's model on token_ids (one prompt, every rank of a TP group together)
    and set its FP8 cache's scales in place (the tensor CUDA graphs read); returns them,
    [layers, 2, NKV] float32."""
    cache = runner.kv_cache
    device = runner.device
    n = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(n, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    varlen = VarlenBatch(
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=n,
        max_seqlen_k=n,
        q_positions=positions,
        k_positions=positions,
        causal_suffix=True,
        q_bounds=[0, n],
        k_bounds=[0, n],
    )
    amax = torch.zeros_like(cache.scales)
    ctx = _RecordingContext(
        cache,
        None,  # no slot: nothing is stored
        runner.all_reduce,
        runner.run_experts,
        scale=runner.scale,
        dense=varlen,
        windows=runner.model.config.attention_windows,
        amax=amax,
    )
    runner.model(ids, positions, ctx)
    if cp_group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=cp_group)
    # A head that was all zeros keeps 1.0 (any scale stores its zeros exactly).
    scales = torch.where(amax > 0, amax * HEADROOM / FP8_MAX, torch.ones_like(amax))
    cache.scales.copy_(scales)
    return scales


def checkpoint_kv_scales(model, num_layers: int) -> torch.Tensor:
    """[layers, 2, NKV] float32 of this rank's KV heads from the checkpoint's k_scale / v_scale
    (model.kv_cache_scales: one per tensor, or one per KV head of the whole model); a
    ModelLoadError names what is missing or malformed."""
    shard = model.shard
    total_heads = model.config.num_key_value_heads
    rows = []
    for layer in range(num_layers):
        pair = []
        for which, name in enumerate(("k_scale", "v_scale")):
            scale = model.kv_cache_scales.get((layer, which))
            if scale is None:
                raise ModelLoadError(
                    f"the checkpoint has FP8 KV-cache scales for some layers but not "
                    f"model.layers.{layer}.self_attn.{name}: give every layer both, or none"
                )
            if scale.numel() == total_heads:
                scale = scale[shard.kv_head_start : shard.kv_head_start + shard.num_kv_heads]
            elif scale.numel() == 1:
                scale = scale.expand(shard.num_kv_heads)
            else:
                raise ModelLoadError(
                    f"model.layers.{layer}.self_attn.{name} has {scale.numel()} values: one per tensor or "
                    f"one per KV head ({total_heads}) expected"
                )
            if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                raise ModelLoadError(f"model.layers.{layer}.self_attn.{name} must be positive and finite")
            pair.append(scale)
        rows.append(torch.stack(pair))
    return torch.stack(rows)
