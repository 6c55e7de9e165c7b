"""What Llama 4 (text) and gpt-oss configs set beyond the Llama shape, as ModelConfig fields.

Each function reads one transformers config and returns the ModelConfig fields it sets;
a field the model code does not implement, and that would change the math, is refused
with a ModelLoadError naming it (never run silently wrong).
"""

from __future__ import annotations

from ringserve.errors import ModelLoadError


def _refuse(arch: str, field: str, value, why: str):
    raise ModelLoadError(f"{arch}: {field}={value!r} is not supported ({why})")


def _check_layer_types(arch: str, hf, known: tuple[str, ...]) -> None:
    """The family's own layer types only (config.attention_windows_from_hf turns them into
    windows: Llama 4 chunks, gpt-oss sliding windows)."""
    unknown = sorted(set(getattr(hf, "layer_types", None) or ()) - set(known))
    if unknown:
        _refuse(arch, "layer_types", unknown, f"{arch} layers are {' or '.join(known)}")


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
    _check_layer_types(arch, hf, ("chunked_attention", "full_attention"))
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
    _check_layer_types(arch, hf, ("sliding_attention", "full_attention"))
    return dict(
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_router="topk_softmax",
        experts_layout="fused_interleaved",
        experts_bias=True,
        # transformers before 5.2x has no config field for alpha (its modeling code hard-codes
        # 1.702) and may lack the limit: the published checkpoints' values are the defaults.
        swiglu=(float(getattr(hf, "swiglu_alpha", 1.702)), float(getattr(hf, "swiglu_limit", 7.0))),
        o_proj_bias=bool(hf.attention_bias),
        attention_sinks=True,
    )


# Multimodal architectures whose text model ringserve runs (text_config, the language_model.*
# tensors; the vision tower's are not read).
TEXT_MODEL_OF = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM"}

MOE_FAMILY_FIELDS = {"Llama4ForCausalLM": llama4_text_fields, "GptOssForCausalLM": gpt_oss_fields}
