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

ARCHITECTURES = ["llama", "mistral", "qwen3", "mixtral", "qwen3_moe"]


def make_hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
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
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: str, seed: int = 0, **save_kwargs) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_hf_config(arch), dtype=torch.float32)
    # Larger weights than the default init make logits spread out, so greedy choices are
    # decided by clear margins and any error in the engine shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, past any EOS (as ignore_eos=True)."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens
