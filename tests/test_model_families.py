"""Family-specific loading: Gemma 3 configs as published, fields the model does not
implement refused by name, and attention biases on every projection (Llama-style)."""

import json

import pytest
import torch

from ringserve import LLM, ModelLoadError
from ringserve.config import AttentionWindow, ModelConfig
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.decoder import RotaryEmbedding
from ringserve.model.tiny_models import TINY, hf_model, save_random_model

from helpers import run_requests, scored

# config.json of google/gemma-3-1b-it as transformers 4.50 saved it (sizes shrunk): no
# layer_types or rope_parameters, a local RoPE base and a window pattern instead.
GEMMA3_LEGACY = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=32768,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_local_base_freq=10000,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=512,
    sliding_window_pattern=6,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    torch_dtype="bfloat16",
)


def write_config(folder, raw: dict) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def test_published_gemma3_config_reads_layer_types_and_a_rope_base_per_type(tmp_path):
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    folder = write_config(tmp_path / "gemma3", GEMMA3_LEGACY)
    config = ModelConfig.from_pretrained(folder)
    layer_types = ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert config.rope_layer_types == layer_types
    windows = [
        AttentionWindow(sliding=512) if t == "sliding_attention" else AttentionWindow() for t in layer_types
    ]
    assert list(config.attention_windows) == windows
    assert config.attention_scale == 256**-0.5  # query_pre_attn_scalar, not head_dim 32
    assert config.embedding_scale == 64**0.5 and config.tie_word_embeddings
    assert config.dtype == torch.bfloat16
    hf = Gemma3RotaryEmbedding(AutoConfig.from_pretrained(folder))
    for layer_type in ("sliding_attention", "full_attention"):
        ours = RotaryEmbedding(config, layer_type).inv_freq
        torch.testing.assert_close(ours, getattr(hf, f"{layer_type}_inv_freq"), rtol=0, atol=0)
    local, full = (RotaryEmbedding(config, t).inv_freq for t in ("sliding_attention", "full_attention"))
    assert local[1] == 10000 ** (-2 / 32) and full[1] == 1000000 ** (-2 / 32)


# config.json of Qwen/Qwen2.5-0.5B-Instruct: a sliding window configured but switched off.
QWEN25 = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    hidden_size=896,
    intermediate_size=4864,
    max_position_embeddings=32768,
    max_window_layers=21,
    num_attention_heads=14,
    num_hidden_layers=24,
    num_key_value_heads=2,
    rms_norm_eps=1e-06,
    rope_theta=1000000.0,
    sliding_window=32768,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    use_sliding_window=False,
    vocab_size=151936,
)


def test_published_qwen25_config_has_qkv_biases_and_full_attention(tmp_path):
    config = ModelConfig.from_pretrained(write_config(tmp_path / "qwen25", QWEN25))
    assert config.attention_bias and not config.o_proj_bias
    assert not config.has_local_attention  # use_sliding_window is false
    assert config.tie_word_embeddings and config.head_dim == 64
    assert RotaryEmbedding(config).inv_freq[1] == 1000000.0 ** (-2 / 64)


@pytest.mark.parametrize(
    "raw,field",
    [
        (dict(GEMMA3_LEGACY, attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(GEMMA3_LEGACY, use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(GEMMA3_LEGACY, hidden_activation="relu"), "hidden_activation"),
        (dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=True), "mlp_bias"),
        (
            dict(GEMMA3_LEGACY, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_type",
        ),
        (
            dict(TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2", partial_rotary_factor=0.5),
            "partial_rotary_factor",
        ),
        (dict(TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="gelu"), "hidden_act"),
        # MoE experts run silu only, even though a dense MLP could run gelu_pytorch_tanh
        (
            dict(
                TINY,
                architectures=["MixtralForCausalLM"],
                model_type="mixtral",
                hidden_act="gelu_pytorch_tanh",
            ),
            "hidden_act",
        ),
    ],
)
def test_unimplemented_fields_are_refused_by_name(tmp_path, raw, field):
    folder = write_config(tmp_path / "model", raw)
    with pytest.raises(ModelLoadError, match=f"{field}=.*not supported"):
        ModelConfig.from_pretrained(folder)


def test_attention_bias_on_q_k_v_and_o_at_tp1_and_tp2(tmp_path):
    """Llama's attention_bias puts a bias on o_proj too; under tp=2 it is added once, after
    the sum over ranks. Qwen2 (q/k/v biases, none on o_proj) is in test_models."""
    import transformers as tf

    folder = save_random_model(tf.LlamaConfig(**TINY, attention_bias=True), str(tmp_path / "llama_bias"))
    tokens = list(range(3, 30))
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    for tp in (1, 2):
        with LLM(folder, device="cpu", dtype="float32", tp=tp, timeout_s=60) as llm:
            ours = engine_logits(llm.engine, tokens, prefill=20)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4, msg=f"tp={tp}")


def test_qwen2_sliding_window_above_max_window_layers(tmp_path):
    """Qwen2 with use_sliding_window: layers from max_window_layers on slide (window 8),
    the ones below attend over everything."""
    import transformers as tf

    hf_config = tf.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    folder = save_random_model(hf_config, str(tmp_path / "qwen2_sliding"))
    config = ModelConfig.from_pretrained(folder)
    assert list(config.attention_windows) == [AttentionWindow(), AttentionWindow(sliding=8)]
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    ours = engine_logits(LLMEngine(folder, device="cpu", dtype="float32"), tokens, prefill=21)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len, V] after each position of `tokens`."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_gemma3_chunks_across_the_window_match_transformers(tiny_model_dir):
    """Prompts past the sliding window (12 tokens) in chunks that straddle its edge: a
    prefill of 10, chunks of 7 and 9 after the cached prefix, then decode steps."""
    folder = tiny_model_dir("gemma3")
    window = hf_model(folder).config.sliding_window
    tokens = torch.randint(0, 256, (44,), generator=torch.Generator().manual_seed(5)).tolist()
    assert window < 10 + 7 < len(tokens)
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    with LLM(folder, device="cpu", dtype="float32", block_size=4) as llm:
        ours = engine_logits(llm.engine, tokens, prefill=10, chunks=[7, 9])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_gemma3_prefix_cache_hit_past_the_window_matches_transformers(tiny_model_dir):
    """A second turn that reuses the first turn's cached blocks (more of them than the
    window) computes only its new tokens, with transformers' log-probabilities."""
    folder = tiny_model_dir("gemma3")
    hf = hf_model(folder)
    g = torch.Generator().manual_seed(6)
    first = torch.randint(0, 256, (33,), generator=g).tolist()
    with LLM(folder, device="cpu", dtype="float32", block_size=4) as llm:
        answer, _ = run_requests(llm.engine, [first], scored(6))[0]
        second = first + answer + torch.randint(0, 256, (5,), generator=g).tolist()
        before = llm.engine.num_computed_tokens
        tokens, rows = run_requests(llm.engine, [second], scored(6))[0]
        computed = llm.engine.num_computed_tokens - before
    assert computed < len(second) - hf.config.sliding_window  # the hit covers more than a window
    ref = hf_logprobs(hf, second + tokens)[len(second) - 1 : -1]
    assert tokens == ref.argmax(-1).tolist()
    torch.testing.assert_close(rows, ref, rtol=1e-4, atol=1e-4)
