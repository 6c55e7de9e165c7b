"""What Qwen2 and Gemma 3 (text) configs set beyond the Llama shape, as ModelConfig fields.

Each function reads one transformers config and returns the ModelConfig fields it sets
(config.py refuses, by name, the fields no family implements).
"""

from __future__ import annotations


def qwen2_fields(hf) -> dict:
    """Qwen2 / Qwen2.5: biases on q, k and v but none on o_proj (transformers hard-codes
    both; the config has no attention_bias). Sliding layers come from layer_types."""
    return dict(attention_bias=True, o_proj_bias=False)


def gemma3_fields(hf) -> dict:
    """Gemma3TextConfig, as transformers' modeling_gemma3.py computes it: q/k norms, four
    norms per layer, each (1 + w) in float32, embeddings times sqrt(hidden), queries scaled
    by 1/sqrt(query_pre_attn_scalar), a gelu-tanh MLP, a RoPE per layer type (the sliding
    layers' base is rope_local_base_freq), optional final logit softcapping. Sliding layers
    come from layer_types."""
    return dict(
        qk_norm=True,
        hidden_act=hf.hidden_activation,
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        norm_unit_offset=True,
        sandwich_norms=True,
        embedding_scale=hf.hidden_size**0.5,
        final_logit_softcapping=hf.final_logit_softcapping,
        rope_layer_types=tuple(hf.layer_types),
    )


DENSE_FAMILY_FIELDS = {
    "Qwen2ForCausalLM": qwen2_fields,
    "Gemma3ForCausalLM": gemma3_fields,
}
