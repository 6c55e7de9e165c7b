"""One decoder-only transformer for every architecture in config.SUPPORTED_ARCHITECTURES.

Reads like single-device code and keeps Hugging Face parameter names, so checkpoint
tensors load by name. Tokens are packed: a step's new tokens of every sequence form one
[T] row, with their global positions. Anything that crosses sequences or devices goes
through the `ForwardContext` passed in: `ctx.attend` (the paged-cache or ring attention)
and `ctx.all_reduce` (the tensor-parallel sum, identity on one rank).

For fewer, fuller kernels per layer, q/k/v and gate/up are each one matmul (`MergedLinear`,
filled from the checkpoint's separate tensors), residual adds run fused into the following
RMSNorm, and RoPE rotates q and k in one pass (`ringserve.kernels.elementwise`: Triton on CUDA). At
decode batch sizes on a GPU the linears' matmuls are a skinny kernel of ours
(`ringserve.kernels.skinny_matmul`), which reads the weights closer to the memory's bandwidth.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig, TPShard
from ringserve.kernels.elementwise import (
    add_rms_norm,
    grouped_mm_usable,
    rms_norm,
    rotary_qk,
    unit_offset_rms_norm,
)
from ringserve.kernels.skinny_matmul import (
    QuantizedRows,
    fp8_grouped_mm,
    fp8_grouped_mm_usable,
    fp8_matmul,
    gated_linear,
    linear,
    quantize_rows,
)
from ringserve.model.fused_moe import GptOssMoeBlock, Llama4MoeBlock


class ForwardContext(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
        rope: PositionTables | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q [T, NH, D], k and v [T, NKV, D] of this step's tokens -> [T, NH, D], each query
        over the keys its layer's window lets it see (ModelConfig.attention_window). sinks
        [NH] (this rank's heads): a logit per head that joins the softmax denominator only
        (gpt-oss), applied once every partial is merged. rope: q and k are not yet rotated;
        the context rotates them as it stores the new keys (one kernel for both). kv_stored:
        project_qkv made q, k and v and has stored k and v already."""

    def project_qkv(
        self, layer: int, x: torch.Tensor, qkv_proj: MergedLinear, rope: PositionTables
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, NH, D], k, v [T, NKV, D]) of qkv_proj(x) with q and k rotated by rope and k,
        v stored in the layer's cache, ready for attend(..., kv_stored=True): the context
        owns the cache, and runs the projection, RoPE and the store as one kernel where it
        can (skinny_matmul.qkv_rope_store)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the tensor-parallel ranks."""

    def run_experts(self, experts: Experts, x, expert_ids, weights) -> torch.Tensor:
        """sum_j weights[t, j] * expert[expert_ids[t, j]](x[t]) for every token t: on this
        rank's experts, or dispatched to the ranks holding them (expert parallelism)."""


class RMSNorm(nn.Module):
    """norm(x); with a residual, (norm(x + residual), x + residual) in one fused pass."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as w - 1 and applied as (1 + w), in float32."""

    def forward(self, x, residual=None):
        if residual is None:
            return unit_offset_rms_norm(x, self.weight, self.eps)
        total = residual + x  # rounded to x's dtype before the norm, as HF adds
        return unit_offset_rms_norm(total, self.weight, self.eps), total


def make_norm(config: ModelConfig, dim: int) -> RMSNorm:
    return (UnitOffsetRMSNorm if config.norm_unit_offset else RMSNorm)(dim, config.rms_norm_eps)


class Linear(nn.Linear):
    """nn.Linear; at decode batch sizes on a GPU its matmul is ringserve's skinny kernel.
    Under --quantization fp8 (model/quantize.py), or loaded from a row-wise FP8 checkpoint
    (model/fp8.py), its weight is e4m3 with a float32 scale per output row in weight_scale
    [N] (kernels/skinny_matmul.fp8_matmul)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_scale", None)

    def forward(self, x, out=None):
        return linear(x, self.weight, self.bias, out=out, weight_scale=self.weight_scale)

    def float_output(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """forward(x) as float32 (an LM head's logits [N, out_features]), rounded to x's dtype
        first as HF's `.float()`: into out when given (a decode graph's static logits), else
        for half-precision x into a float32 tensor of its own, so that eager steps' few rows
        take the skinny kernel's variant the decode graphs built at start-up (Triton
        specialises on the output's dtype: a bf16 one was compiled on the first requests'
        prefills, BENCHMARKS.md). float32 x needs neither (no copy)."""
        if out is None and x.dtype == torch.float32:
            return self(x)
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        return self(x, out=out)


class MergedLinear(Linear):
    """Projections of the same input stacked by output rows, run as one matmul.

    parts: the checkpoint's names of the stacked projections (siblings of this module,
    e.g. q_proj, k_proj, v_proj) and this rank's output rows of each, in order. The loader
    fills each part's rows from its own tensor; forward returns one view per part.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def fused(self, x):
        """The parts side by side, [T, sum of rows] (for kernels that take them so)."""
        return super().forward(x)

    def forward(self, x):
        return self.fused(x).split(list(self.parts.values()), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for global positions; scaled variants (llama3, yarn, ...) via transformers.

    key: "default", or the layer type whose RoPE this is when the config has one per layer
    type (Gemma 3: rope_parameters["sliding_attention"] and ["full_attention"]).
    """

    def __init__(self, config: ModelConfig, key: str = "default"):
        super().__init__()
        self.config = config
        self.key = key
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.table: torch.Tensor | None = None  # cache_tables' [P, 2, 1, D] cos and sin

    def _inv_freq(self):
        hf, head_dim = self.config.hf_config, self.config.head_dim
        # transformers 5 names it rope_parameters; 4.x, rope_scaling (plus rope_theta).
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        layer_type = None if self.key == "default" else self.key
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dims = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
            self.attention_scaling = 1.0
            return 1.0 / (theta ** (dims / head_dim))
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        with torch.device("cpu"):  # also when the model is being built on the meta device
            init = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, self.attention_scaling = init(hf, torch.device("cpu"), layer_type=layer_type)
        return inv_freq

    def reset_buffers(self):
        """Recompute inv_freq after the model was built on the meta device."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    # The most memory the cached tables may take: 128K positions of 128-wide heads in bf16
    # take 64 MiB; Llama 4 Scout's 10M positions would take 5 GiB, and compute per step.
    MAX_TABLE_BYTES = 128 << 20

    def cache_tables(self, max_positions: int, dtype: torch.dtype) -> bool:
        """Compute the tables of positions 0 .. max_positions - 1 once (the engine's longest
        sequence): forward then gathers its rows, one kernel a step instead of nine (cat,
        cos, sin, scalings, casts). The same ops on the same positions: the same values.
        Returns False, caching nothing, where they would exceed MAX_TABLE_BYTES."""
        table_bytes = max_positions * 2 * self.config.head_dim * torch.finfo(dtype).bits // 8
        if table_bytes > self.MAX_TABLE_BYTES:
            self.table = None
            return False
        tables = self._tables(torch.arange(max_positions, device=self.inv_freq.device), dtype)
        self.table = torch.stack([tables.cos, tables.sin], dim=1)  # [P, 2, 1, D]
        return True

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> PositionTables:
        """The tables of positions [T] (each below the cached tables' length, if cached)."""
        if self.table is None or self.table.dtype != dtype:
            return self._tables(positions, dtype)
        rows = self.table[positions]  # [T, 2, 1, D]
        return PositionTables(rows[:, 0], rows[:, 1], self._q_scale(positions))

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> PositionTables:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return PositionTables(cos[:, None, :], sin[:, None, :], self._q_scale(positions))  # [T, 1, D]

    def _q_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        if self.config.attn_temperature is None:
            return None
        floor_scale, attn_scale = self.config.attn_temperature
        # Llama 4's temperature tuning (NoPE layers): [T, 1, 1] float32, as transformers.
        q_scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return q_scale[:, None, None]


class PositionTables(NamedTuple):
    """What attention needs of the tokens' global positions, computed once per forward."""

    cos: torch.Tensor  # [T, 1, D] RoPE tables, in the activations' dtype
    sin: torch.Tensor
    q_scale: torch.Tensor | None = None  # [T, 1, 1] Llama 4 NoPE layers' query scale


class RowParallelLinear(Linear):
    """A linear layer whose input columns are split over tensor-parallel ranks: the partial
    products are summed, then the bias (whole on every rank) is added once."""

    def forward(self, x, ctx: ForwardContext):
        out = ctx.all_reduce(linear(x, self.weight, weight_scale=self.weight_scale))
        return out if self.bias is None else out + self.bias


def l2_norm_heads(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's weightless RMS norm over each head's D of x [T, heads, D], in float32 and
    rounded to x's dtype (the fused RMSNorm with a weight of ones: no float32 copy of x)."""
    return rms_norm(x, x.new_ones(x.shape[-1]), eps)


class Attention(nn.Module):
    """Self-attention with its variants as options: q/k norms (Qwen3), RoPE or none, the L2
    q/k norm and query temperature (Llama 4), sinks and an o_proj bias (gpt-oss).

    Llama 4 rotates interleaved pairs (2i, 2i + 1) of each head; the loader stores its q and
    k rows de-interleaved (even ones, then odd ones: `weights.deinterleave_heads`), which turns
    that into the usual half-split rotation with the same dot products q.k.
    """

    def __init__(self, config: ModelConfig, layer: int, shard: TPShard):
        super().__init__()
        self.layer = layer
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # [(NH + 2 NKV) * D, H]: this rank's q heads, then its k heads, then its v heads.
        self.qkv_proj = MergedLinear(hidden, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, bias)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = make_norm(config, self.head_dim)
            self.k_norm = make_norm(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.uses_rope = layer not in config.nope_layers
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm and self.uses_rope else None
        self.temperature_tuned = config.attn_temperature is not None and not self.uses_rope
        # Plain RoPE right after the projection: ctx.project_qkv can do both and the KV store.
        self.rope_at_projection = self.uses_rope and self.q_norm is None and self.l2_eps is None
        # This rank's heads' sink logits [NH] (gpt-oss).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(self, x, pos: PositionTables, ctx: ForwardContext):
        tokens = x.shape[0]
        if self.rope_at_projection:
            q, k, v = ctx.project_qkv(self.layer, x, self.qkv_proj, pos)
            out = ctx.attend(self.layer, q, k, v, sinks=self.sinks, kv_stored=True)
            return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), ctx)
        q, k, v = self.qkv_proj(x)  # views of one [T, (NH + 2 NKV) * D] output
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = pos if self.uses_rope else None
        if self.l2_eps is not None:  # Llama 4's L2 norm comes after RoPE
            q, k = rotary_qk(q, k, pos.cos, pos.sin)
            q, k = l2_norm_heads(q, self.l2_eps), l2_norm_heads(k, self.l2_eps)
            rope = None
        elif rope is None:
            q, k = q.contiguous(), k.contiguous()
        if self.temperature_tuned:
            q = (q * pos.q_scale).to(q.dtype)
        out = ctx.attend(self.layer, q, k, v, sinks=self.sinks, rope=rope)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), ctx)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu"):
        super().__init__()
        # [2 I, H]: this rank's gate rows, then its up rows.
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.hidden_act = hidden_act  # one of config.names.GATED_ACTIVATIONS (the config checks it)

    def forward(self, x, ctx: ForwardContext):
        # act(gate) * up [T, I] straight out of the gate/up matmul
        gate_up = self.gate_up_proj
        act_up = gated_linear(
            x,
            gate_up.weight,
            self.hidden_act,
            weight_scale=gate_up.weight_scale,
            quantize_output=self.down_proj.weight_scale is not None,
        )
        return ctx.all_reduce(self.down_proj(act_up))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows vocab_start .. vocab_start + num_local - 1 (all of them on one rank).

    Ids outside the range look up zeros, so the sum over tensor-parallel ranks is the lookup.
    """

    def __init__(self, num_local: int, dim: int, vocab_start: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, dim))
        self.vocab_start = vocab_start
        self.whole = vocab_start == 0 and num_local >= vocab_size

    def forward(self, input_ids, ctx: ForwardContext):
        if self.whole:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return ctx.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


class Experts(nn.Module):
    """The experts of one MoE layer, stacked: expert e's weights are gate_proj[e] etc.
    Under --quantization fp8 (model/quantize.py), or from a row-wise FP8 checkpoint as
    stored (model/fp8.py), each is e4m3 with a float32 scale per output row in
    gate_proj_scale, up_proj_scale [E, I] and down_proj_scale [E, H]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        for name in ("gate_proj_scale", "up_proj_scale", "down_proj_scale"):
            self.register_buffer(name, None)

    @property
    def num_local_experts(self) -> int:
        return self.gate_proj.shape[0]

    def on_device(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether grouped_forward runs without a host sync (kernels.grouped_mm_usable)."""
        _, intermediate, hidden = self.gate_proj.shape
        fp8 = self.gate_proj_scale is not None
        return grouped_mm_usable(device, dtype, hidden, intermediate) and (
            not fp8 or fp8_grouped_mm_usable(device)
        )

    def grouped_forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [N, H]: tokens sorted by expert, local expert e's rows ending at ends[e]
        ([E] int32 on x's device, the running count) -> [N, H].

        Each expert runs once over its whole group (no per-token loop); an expert with no
        token costs nothing. On a GPU in bf16, one grouped matmul runs all experts at once,
        reading the group ends on the device (no host sync); FP8 experts likewise, their
        input rows quantised per token (kernels/skinny_matmul.fp8_grouped_mm).
        """
        if self.on_device(x.device, x.dtype):
            if self.gate_proj_scale is not None:
                xq = QuantizedRows(*quantize_rows(x), x.dtype)  # once for gate and up
                gate = fp8_grouped_mm(xq, self.gate_proj.transpose(1, 2), self.gate_proj_scale, ends)
                up = fp8_grouped_mm(xq, self.up_proj.transpose(1, 2), self.up_proj_scale, ends)
                act = F.silu(gate) * up
                return fp8_grouped_mm(act, self.down_proj.transpose(1, 2), self.down_proj_scale, ends)
            gate = torch._grouped_mm(x, self.gate_proj.transpose(1, 2), offs=ends)
            up = torch._grouped_mm(x, self.up_proj.transpose(1, 2), offs=ends)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        out = torch.empty_like(x)
        start = 0
        for e, end in enumerate(ends.tolist()):  # on a GPU a sync: this fallback is not the fast path
            if end > start:
                h = x[start:end]
                act = F.silu(self.project(h, "gate_proj", e)) * self.project(h, "up_proj", e)
                out[start:end] = self.project(act, "down_proj", e)
            start = end
        return out

    def project(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        """x @ weight[expert]^T for the stacked weight `name`, in FP8 where it is."""
        weight, scale = getattr(self, name)[expert], getattr(self, name + "_scale")
        return F.linear(x, weight) if scale is None else fp8_matmul(x, weight, scale[expert])


class SparseMoeBlock(nn.Module):
    """Router (softmax, top-k, optional renormalisation) and experts; exact, no capacity limit."""

    def __init__(self, config: ModelConfig, shard: TPShard):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(shard.num_experts, config.hidden_size, shard.moe_intermediate_size)

    def route(self, x):
        """-> (expert ids [T, k], weights [T, k]) for each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x, ctx: ForwardContext):
        expert_ids, weights = self.route(x)
        return ctx.run_experts(self.experts, x, expert_ids, weights)


def moe_block(config: ModelConfig, shard: TPShard) -> nn.Module:
    """The MoE block the config's router names (Llama 4 and gpt-oss: ringserve.model.fused_moe)."""
    if config.moe_router == "softmax":
        return SparseMoeBlock(config, shard)
    if config.moe_router == "sigmoid_scaled_input":
        shared = MLP(config.hidden_size, config.shared_expert_intermediate_size // shard.size)
        return Llama4MoeBlock(config, shard, shared)
    if config.moe_router == "topk_softmax":
        return GptOssMoeBlock(config, shard)
    raise ValueError(f"unknown moe_router {config.moe_router!r}")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: TPShard):
        super().__init__()
        self.self_attn = Attention(config, layer, shard)
        if config.layer_is_sparse(layer):
            self.mlp = moe_block(config, shard)
        else:
            self.mlp = MLP(config.hidden_size, shard.intermediate_size, config.hidden_act)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)

    def forward(self, x, residual, pos: PositionTables, ctx: ForwardContext):
        """x [T, H]: the previous layer's MLP output, residual: the stream it adds to (None at
        the first layer, where x is the embedding) -> the same pair for this layer; the
        hidden state is their sum. Each add runs fused into the norm after it (the last
        layer's into the final norm)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, pos, ctx), residual)
        return self.mlp(h, ctx), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: besides the norms before attention and before the MLP, one on the output
    of each, before it joins the residual stream (post_attention_layernorm normalises the
    attention output here, not the MLP input as in Llama)."""

    def __init__(self, config: ModelConfig, layer: int, shard: TPShard):
        super().__init__(config, layer, shard)
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(self, x, residual, pos, ctx: ForwardContext):
        """As DecoderLayer.forward; x is the previous layer's normalised MLP output."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(h, pos, ctx))
        h, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h, ctx)), residual


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, shard: TPShard):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_size, config.hidden_size, shard.vocab_start, config.vocab_size
        )
        layer_class = SandwichDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_class(config, i, shard) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        # One RoPE table per key that some layer uses (config.rope_key).
        keys = sorted({config.rope_key(i) for i in range(config.num_hidden_layers)})
        self.rotary_emb = nn.ModuleDict({key: RotaryEmbedding(config, key) for key in keys})


class Transformer(nn.Module):
    """Causal LM: `forward` gives final hidden states, `compute_logits` the vocabulary scores.

    shard: this rank's part of a tensor-parallel model (its heads, MLP columns and
    vocabulary rows); the default is the whole model.
    """

    def __init__(self, config: ModelConfig, shard: TPShard | None = None):
        super().__init__()
        shard = shard or TPShard.whole(config)
        self.config = config
        self.shard = shard
        self.model = Backbone(config, shard)
        # A checkpoint's FP8 KV-cache scales (llm-compressor's kv_cache_scheme: each layer's
        # self_attn.k_scale / v_scale), (layer, 0 for K or 1 for V) -> float32 [] or [NKV]
        # over every KV head; filled by weights.load_weights, read where the cache is FP8.
        self.kv_cache_scales: dict[tuple[int, int], torch.Tensor] = {}
        self.lm_head = Linear(config.hidden_size, shard.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # EAGLE-3 speculative decoding (model/eagle3.py): keeps a mix of some layers' hidden
        # states for every token computed; set on rank 0 by the worker, None otherwise.
        self.hidden_capture = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """input_ids, positions [T] -> hidden states [T, H]."""
        x = self.model.embed_tokens(input_ids, ctx)
        if self.config.embedding_scale is not None:
            # Gemma: times sqrt(hidden) rounded to the model dtype first, as transformers does.
            x = x * float(torch.tensor(self.config.embedding_scale, dtype=x.dtype))
        pos = {key: emb(positions, x.dtype) for key, emb in self.model.rotary_emb.items()}
        residual = None
        capture, captured = self.hidden_capture, None
        for i, layer in enumerate(self.model.layers):
            if capture is not None and i in capture.layers:  # the hidden state entering layer i
                captured = capture.add(i, x if residual is None else x + residual, captured)
            x, residual = layer(x, residual, pos[self.config.rope_key(i)], ctx)
        if capture is not None:
            capture.store(captured, ctx)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    @property
    def logits_width(self) -> int:
        """Columns of the logits a step returns (the whole vocabulary)."""
        return self.config.vocab_size

    def moe_blocks(self) -> list[nn.Module]:
        """The MoE blocks in layer order (under EP, each one dispatch and combine per step),
        of every family (SparseMoeBlock, Llama4MoeBlock, GptOssMoeBlock)."""
        layers = self.model.layers
        return [layer.mlp for i, layer in enumerate(layers) if self.config.layer_is_sparse(i)]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> [N, V_local] float32: this rank's vocabulary rows (all of them on one rank),
        rounded to the model's dtype first as HF's `.float()` (Linear.float_output); written
        into out when given (a decode graph's static logits: no copy after the matmul)."""
        logits = self.lm_head.float_output(hidden, out)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
