"""Tiny random Hugging Face checkpoints of every supported architecture, and transformers'
own answers on them: the references the tests and the GPU checks (bench/) compare with."""

from __future__ import annotations

import torch

# Small enough to be quick on 2 cores, big enough to exercise GQA, q/k norms, rope scaling,
# MoE routing with dense layers, and tied embeddings.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

ARCHITECTURES = ["llama", "mistral", "qwen3", "mixtral", "qwen3_moe", "qwen2", "gemma3", "llama4", "gpt_oss"]


def llama3_rope() -> dict:
    """Llama 3's RoPE scaling, with an original context of 64 so that the tiny prompts reach
    past it."""
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def make_hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters=llama3_rope(),
        )
    if arch == "qwen3":
        # head_dim 32 with 4 heads: 128 wide attention on a 64 wide model
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    if arch == "mistral":
        # A window of 8 positions: prompts of a few dozen tokens span several windows.
        return tf.MistralConfig(**TINY, sliding_window=8, head_dim=16)
    if arch == "qwen3_hybrid":
        # Hybrid local attention (not in ARCHITECTURES: tests of the KV groups use it):
        # sliding windows of 8 in three layers, full attention in the second.
        return tf.Qwen3Config(
            **{**TINY, "num_hidden_layers": 4},
            head_dim=16,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        )
    if arch == "mixtral":
        return tf.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=False)  # q/k/v biases (randomised below)
    if arch == "gemma3":
        # head_dim 32 and query_pre_attn_scalar 24 (not head_dim): the query scaling shows; a
        # sliding then a global layer, each with its RoPE (linear scaling on the global one).
        return tf.Gemma3TextConfig(
            **TINY,
            head_dim=32,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=12,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            final_logit_softcapping=3.0,
        )
    if arch == "llama4":
        # Layer 1 is NoPE (no_rope_layer_interval 2; Scout: 4) with temperature tuning that
        # varies over a few tokens (floor_scale 4) and MoE (top-2, so the input scaling is summed
        # over choices); layer 0 is dense, with RoPE over chunks of 16 tokens.
        return tf.Llama4TextConfig(
            **TINY | dict(intermediate_size=48),
            architectures=["Llama4ForCausalLM"],
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=16,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=llama3_rope(),
        )
    if arch == "gpt_oss":
        # Sliding (8 tokens) and full layers; a SwiGLU limit the activations reach; YaRN RoPE.
        return tf.GptOssConfig(
            **TINY | dict(intermediate_size=64),  # MXFP4 groups of 32 along it (tests/test_mxfp4.py)
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        )
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: str, seed: int = 0, **save_kwargs) -> str:
    return save_random_model(make_hf_config(arch), folder, seed, **save_kwargs)


def save_random_model(hf_config, folder: str, seed: int = 0, **save_kwargs) -> str:
    """A transformers model of this config with random weights, saved to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # Larger weights than the default init make logits spread out, so greedy choices are
    # decided by clear margins and any error in the engine shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith(("bias", "sinks")):  # zero by default: make them count
                p.normal_(0, 0.5)
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(
    model, prompt: list[int], max_new_tokens: int, eos_token_id=None, **generate_kwargs
) -> list[int]:
    """transformers' greedy continuation: past any EOS (as ignore_eos=True) unless eos_token_id
    is given; generate_kwargs: its logits processors (repetition_penalty, min_new_tokens, ...)."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = eos_token_id
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **generate_kwargs,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert eos_token_id is not None or len(tokens) == max_new_tokens
    return tokens
