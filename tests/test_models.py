"""Every architecture against Hugging Face transformers on the same weights."""

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.tiny_models import ARCHITECTURES, hf_greedy, hf_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (40,)).tolist()
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    engine = LLMEngine(folder, device="cpu", dtype="float32")
    # Prefill of 29 tokens, then 11 decode steps reading the paged cache.
    ours = engine_logits(engine, tokens, prefill=29)
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{arch}: relative logits error {rel:.2e}"
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_transformers(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(10, 31))]
    ref_model = hf_model(folder)
    with LLM(folder, device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref_model, prompt, 20)
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "llama4"])
def test_cached_rope_tables_equal_computed_ones(arch, tiny_model_dir):
    # The engine gathers RoPE tables from ones cached for every position (one kernel a
    # step); they must equal the per-step computation bit for bit (scaled RoPE, Gemma 3's
    # two RoPEs, Llama 4's query temperature).
    from ringserve.config import ModelConfig
    from ringserve.model.decoder import RotaryEmbedding

    config = ModelConfig.from_pretrained(tiny_model_dir(arch))
    positions = torch.tensor([0, 1, 17, 250, 1023, 5])
    for key in sorted({config.rope_key(i) for i in range(config.num_hidden_layers)}):
        rope = RotaryEmbedding(config, key)
        for dtype in (torch.float32, torch.bfloat16):
            computed = rope(positions, dtype)
            assert rope.cache_tables(1024, dtype) and rope.table is not None
            cached = rope(positions, dtype)
            for a, b in zip(computed, cached):
                assert (a is None and b is None) or torch.equal(a, b)
            # a context too long to hold the tables for (Llama 4's 10M): computed per step
            assert not rope.cache_tables(10 * 2**20, dtype) and rope.table is None
            assert all(torch.equal(a, b) for a, b in zip(computed[:2], rope(positions, dtype)[:2]))
