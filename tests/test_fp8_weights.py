"""FP8 weights (--quantization fp8; model/quantize.py, kernels/skinny_matmul.fp8_matmul): the
engine against transformers with its weights and each projection's input quantised alike,
every parallel layout (with the FP8 KV cache too) against the single rank, the option's
checks. (The skinny kernel's FP8 path: tests/test_skinny_matmul.py, under Triton's
interpreter.)"""

import pytest
import torch

from ringserve import LLM
from ringserve.engine.logits_probe import engine_logits
from ringserve.kernels.kv_quant import FP8_DTYPE
from ringserve.kernels.skinny_matmul import quantize_rows
from ringserve.model.tiny_models import hf_model
from ringserve.options import EngineOptions, OptionError

from helpers import FP8_PROJECTIONS, fp8_layout_run, prompts_of_lengths, quantize_inputs_per_token


def _fake_quantized_hf(folder: str):
    """transformers' model with each projection's weight quantised per row and read back, and
    its input quantised per token as fp8_matmul does."""
    model = hf_model(folder)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(FP8_PROJECTIONS):
                wq, scale = quantize_rows(module.weight)
                module.weight.copy_(wq.float() * scale)
    return quantize_inputs_per_token(model)


def _weights(llm):
    return llm.engine.executor.worker.model


def test_quantization_fp8_matches_transformers_with_weights_and_inputs_quantized_alike(tiny_model_dir):
    folder = tiny_model_dir("llama")
    tokens = prompts_of_lengths([40], seed=4)[0]
    with LLM(folder, device="cpu", dtype="float32", block_size=4, quantization="fp8") as llm:
        ours = engine_logits(llm.engine, tokens, prefill=19, chunks=[6])
        model = _weights(llm)
        attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert linear.weight.dtype == FP8_DTYPE and linear.weight_scale.shape == (linear.weight.shape[0],)
        assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight_scale is None
    with torch.no_grad():
        want = _fake_quantized_hf(folder)(torch.tensor([tokens])).logits[0]
        plain = hf_model(folder)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    assert (plain - want).abs().max() > 100 * (ours - want).abs().max()  # it did quantise


def test_option_is_checked():
    with pytest.raises(OptionError, match="quantization"):
        EngineOptions(quantization="int4")
    assert EngineOptions(quantization="fp8").engine_config().quantization == "fp8"


def _run(folder, **layout):
    """FP8 weights and FP8 KV under a layout: (tokens, logits), as fp8_layout_run gives them."""
    return fp8_layout_run(folder, quantization="fp8", kv_cache_dtype="fp8", **layout)[:2]


@pytest.fixture(scope="module")
def single_rank(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = _run(tiny_model_dir(arch))
        return cache[arch]

    return get


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", dict(cp=2, cp_algo="pass_kv")),
        ("llama", dict(cp=2, cp_algo="pass_q")),
        ("llama", dict(dp=2)),
        ("qwen3_moe", dict(cp=2, ep=2)),  # experts stay in the model's dtype, spread by EP
    ],
    ids=str,
)
def test_fp8_weights_and_kv_every_layout_equals_the_single_rank(arch, layout, tiny_model_dir, single_rank):
    """A token's activations are quantised per token, so splitting a step's tokens over ranks
    (CP, DP) or its experts (EP) quantises the same numbers as one rank does."""
    ref_tokens, ref_logits = single_rank(arch)
    tokens, logits = _run(tiny_model_dir(arch), **layout)
    if logits is not None:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_tensor_parallel_fp8_weights_share_the_row_scales(tiny_model_dir):
    """TP ranks hold the same quantised weights as one rank (a row-parallel row's scale is the
    whole row's: all-reduced at start-up). Each rank quantises its slice of a row-parallel
    input with that slice's own per-token scale (as vLLM does: sharing them would cost an
    all-reduce per layer): TP's logits then differ from one rank's by about what FP8 differs
    from unquantised (a TP rank's finer activation scales are no worse), not by float32
    rounding."""
    folder = tiny_model_dir("llama")
    tokens = prompts_of_lengths([40], seed=4)[0]
    runs = {}
    for name, kw in (("one", dict(quantization="fp8")), ("tp", dict(quantization="fp8", tp=2)), ("bf", {})):
        with LLM(folder, device="cpu", dtype="float32", block_size=4, timeout_s=60, **kw) as llm:
            runs[name] = engine_logits(llm.engine, tokens, prefill=19, chunks=[6])
            if name == "tp":
                o_proj = _weights(llm).model.layers[0].self_attn.o_proj
                tp_scale = o_proj.weight_scale.clone()
            if name == "one":
                one_scale = _weights(llm).model.layers[0].self_attn.o_proj.weight_scale.clone()
    torch.testing.assert_close(tp_scale, one_scale, rtol=0, atol=0)
    assert (runs["tp"] - runs["one"]).abs().max() < (runs["bf"] - runs["one"]).abs().max()
    assert (runs["tp"] - runs["bf"]).abs().max() < 1.5 * (runs["one"] - runs["bf"]).abs().max()
