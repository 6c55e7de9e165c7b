"""What Llama 4 (text) and gpt-oss configs set beyond the Llama shape, as ModelConfig fields.

Each function reads one transformers config and returns the ModelConfig fields it sets;
a field the model code does not implement, and that would change the math, is refused
with a ModelLoadError naming it (never run silently wrong).
"""

from __future__ import annotations

from ringserve.errors import ModelLoadError


def _refuse(arch: str, field: str, value, why: str):
    raise ModelLoadError(f"{arch}: {field}={value!r} is not supported ({why})")


def _check_layer_types(arch: str, hf, known: tuple[str, ...]) -> list[str]:
    layer_types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    unknown = sorted(set(layer_types) - set(known))
    if unknown:
        _refuse(arch, "layer_types", unknown, f"ringserve implements {', '.join(known)}")
    if len(layer_types) < hf.num_hidden_layers:
        _refuse(arch, "layer_types", layer_types, "fewer entries than num_hidden_layers")
    return layer_types[: hf.num_hidden_layers]


def _layer_window(kind: str, size):
    """An AttentionWindow for one layer type (None: full causal attention)."""
    from ringserve.config import AttentionWindow

    if kind == "chunked_attention" and size:
        return AttentionWindow(chunk=size)
    if kind == "sliding_attention" and size:
        return AttentionWindow(sliding=size)
    return AttentionWindow()


def llama4_text_fields(hf) -> dict:
    """Llama4TextConfig (Llama 4 Scout / Maverick, text): chunked attention in the RoPE
    layers, NoPE layers with attention temperature tuning, the L2 q/k norm, MoE layers with a
    sigmoid router and a shared expert, dense layers of intermediate_size_mlp."""
    arch = "Llama4ForCausalLM"
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        _refuse(arch, "hidden_act", act, "ringserve's Llama 4 MLPs and experts are SwiGLU (silu)")
    layers = hf.num_hidden_layers
    use_rope = list(hf.no_rope_layers)  # 1: the layer applies RoPE (transformers' naming)
    if len(use_rope) < layers:
        _refuse(arch, "no_rope_layers", use_rope, "fewer entries than num_hidden_layers")
    layer_types = _check_layer_types(arch, hf, ("chunked_attention", "full_attention"))
    chunk = getattr(hf, "attention_chunk_size", None)
    return dict(
        intermediate_size=hf.intermediate_size_mlp,  # the dense layers' MLP
        moe_intermediate_size=hf.intermediate_size,  # each expert's, and the shared expert's
        shared_expert_intermediate_size=hf.intermediate_size,
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_layers=tuple(hf.moe_layers),
        moe_router="sigmoid_scaled_input",
        experts_layout="fused_concat",
        o_proj_bias=bool(hf.attention_bias),
        nope_layers=tuple(i for i in range(layers) if not use_rope[i]),
        rope_interleaved=True,
        qk_l2_norm=bool(hf.use_qk_norm),
        attn_temperature=(float(hf.floor_scale), float(hf.attn_scale))
        if hf.attn_temperature_tuning
        else None,
        attention_windows=tuple(_layer_window(kind, chunk) for kind in layer_types),
    )


def gpt_oss_fields(hf) -> dict:
    """GptOssConfig: attention sinks, sliding and full layers by layer_types, biases on every
    attention projection, MoE with biases, a top-k softmax router and the clamped SwiGLU."""
    arch = "GptOssForCausalLM"
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        if str(method) not in ("mxfp4", "QuantizationMethod.MXFP4"):
            _refuse(arch, "quantization_config.quant_method", method, "ringserve dequantises mxfp4 only")
    layer_types = _check_layer_types(arch, hf, ("sliding_attention", "full_attention"))
    return dict(
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_router="topk_softmax",
        experts_layout="fused_interleaved",
        experts_bias=True,
        swiglu=(float(hf.swiglu_alpha), float(hf.swiglu_limit)),
        o_proj_bias=bool(hf.attention_bias),
        attention_sinks=True,
        attention_windows=tuple(_layer_window(kind, hf.sliding_window) for kind in layer_types),
    )


FAMILY_FIELDS = {"Llama4ForCausalLM": llama4_text_fields, "GptOssForCausalLM": gpt_oss_fields}
