"""Llama 4 (text) and gpt-oss beyond the common model tests: prompts over several attention
chunks / sliding windows, chunked prefill across a chunk boundary, prefix-cache hits, the
rotation and routing details, and the config fields refused by name."""

import json
import shutil

import pytest
import torch

from ringserve import LLM, ModelLoadError, SamplingParams
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.tiny_models import hf_greedy, hf_model

FAMILIES = ["llama4", "gpt_oss"]  # tiny configs: chunks of 16 tokens / windows of 8 (conftest)


def _prompt(length: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_long_prompt_chunked_prefill_across_a_chunk_boundary(arch, tiny_model_dir):
    """70 tokens (5 Llama 4 chunks, ~9 gpt-oss windows): a 50-token prefill, then prefill chunks
    of 7 and 9 tokens after the cached prefix (the second crosses position 64, a chunk boundary),
    then decode steps through the paged cache: every position's logits as transformers'."""
    folder = tiny_model_dir(arch)
    tokens = _prompt(70)
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    engine = LLMEngine(folder, device="cpu", dtype="float32")
    ours = engine_logits(engine, tokens, prefill=50, chunks=[7, 9])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", FAMILIES)
def test_prefix_cache_hit_then_greedy_as_transformers(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    first = _prompt(45)
    second = first[:40] + _prompt(12, seed=4)  # shares 40 tokens: two cached blocks of 16
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=16) as llm:
        llm.generate([first], greedy)
        before = llm.engine.num_computed_tokens
        out = llm.generate([second], greedy)[0]
        computed = llm.engine.num_computed_tokens - before
    assert computed < len(second) + 20 - 1 - 16  # at least one block came from the cache
    assert out.token_ids == hf_greedy(hf_model(folder), second, 20)


def test_llama4_rotates_interleaved_pairs_and_scales_nope_queries(tiny_model_dir):
    """The loaded q/k rows are each head's even rows then its odd rows (interleaved RoPE as
    the half-split one), and the NoPE layer is the one without RoPE, with temperature tuning."""
    folder = tiny_model_dir("llama4")
    engine = LLMEngine(folder, device="cpu", dtype="float32")
    model = engine.executor.worker.model
    hf = hf_model(folder)
    d = model.config.head_dim
    q_ours = model.model.layers[0].self_attn.qkv_proj.weight[: 4 * d]
    q_hf = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_ours[:d][: d // 2], q_hf[:d][0::2]) and torch.equal(
        q_ours[:d][d // 2 :], q_hf[:d][1::2]
    )
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.uses_rope for a in attn] == [True, False]
    assert [a.temperature_tuned for a in attn] == [False, True]
    assert [a.l2_eps is not None for a in attn] == [True, False]
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "Llama4MoeBlock"]


def _edited_copy(tmp_path, folder, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.parametrize(
    "arch,changes,field",
    [
        ("llama4", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("llama4", dict(layer_types=["sliding_attention"] * 2), "layer_types=\\['sliding_attention'\\]"),
        ("gpt_oss", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types="),
    ],
)
def test_unknown_variants_are_refused_by_name(arch, changes, field, tmp_path, tiny_model_dir):
    folder = _edited_copy(tmp_path, tiny_model_dir(arch), **changes)
    with pytest.raises(ModelLoadError, match=field):
        LLM(folder, device="cpu")


@pytest.mark.parametrize("layout", ["fused_concat", "fused_interleaved"])
def test_grouped_matmul_experts_equal_the_loop(layout):
    """The GPU path of the fused experts (two grouped matmuls, biases picked per row by its
    expert) against expert-by-expert matmuls, in bfloat16 on the CPU (which runs
    torch._grouped_mm too): an expert with no rows, gpt-oss biases and clamped SwiGLU."""
    from ringserve.model.fused_moe import FusedExperts

    gpt_oss = layout == "fused_interleaved"
    experts = FusedExperts(
        4, 32, 16, gpt_oss, gpt_oss, (1.702, 1.0) if gpt_oss else None, adds_down_bias=True
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(11, 32, generator=g).to(torch.bfloat16)
    ends = torch.tensor([3, 3, 7, 11], dtype=torch.int32)  # expert 1 has no rows
    grouped, loop = experts.grouped_mm_forward(x, ends), experts.loop_forward(x, ends)
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)


def test_llama4_as_published_runs_its_text_model(tmp_path, caplog):
    """Llama 4 Scout / Maverick are published as Llama4ForConditionalGeneration: ringserve
    reads text_config and the language_model.* tensors (the vision tower's are not read), with
    logits as transformers' on a text prompt."""
    import transformers as tf

    from ringserve.config import ModelConfig
    from ringserve.model.tiny_models import make_hf_config

    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    text = make_hf_config("llama4").to_dict()
    torch.manual_seed(0)
    model = tf.Llama4ForConditionalGeneration(tf.Llama4Config(text_config=text, vision_config=vision))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(tmp_path)
    tokens = _prompt(40)
    with torch.no_grad():
        ref = model.eval()(input_ids=torch.tensor([tokens])).logits[0]
    with caplog.at_level("WARNING", logger="ringserve.model.weights"):
        engine = LLMEngine(str(tmp_path), device="cpu", dtype="float32")
    # The vision tower is skipped by design, not warned about tensor by tensor.
    assert not [r for r in caplog.records if r.name == "ringserve.model.weights"]
    assert engine.model_config.architecture == "Llama4ForCausalLM"
    torch.testing.assert_close(engine_logits(engine, tokens, prefill=30), ref, rtol=1e-4, atol=1e-4)
    # The text config declares no dtype of its own: the whole model's applies.
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["text_config"].pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(str(tmp_path)).dtype == torch.bfloat16
