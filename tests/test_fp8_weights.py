"""FP8 weights (--quantization fp8; model/quantize.py, kernels/skinny_matmul.fp8_matmul): the
engine against transformers with its weights and each projection's input quantised alike,
every parallel layout (with the FP8 KV cache too) against the single rank, the option's
checks. (The skinny kernel's FP8 path: tests/test_skinny_matmul.py, under Triton's
interpreter.)"""

from unittest import mock

import pytest
import torch

from ringserve import LLM
from ringserve.engine.logits_probe import engine_logits
from ringserve.kernels.kv_quant import FP8_DTYPE
from ringserve.kernels.skinny_matmul import quantize_rows
from ringserve.model.decoder import Experts
from ringserve.model.tiny_models import hf_model
from ringserve.options import EngineOptions, OptionError

from helpers import (
    FP8_PROJECTIONS,
    fake_quantized_moe_hf,
    fp8_layout_run,
    prompts_of_lengths,
    quantize_inputs_per_token,
)


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
        ("qwen3_moe", dict(cp=2, ep=2)),  # FP8 experts, spread by EP
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


def test_fp8_experts_match_transformers_with_experts_quantized_alike(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    tokens = prompts_of_lengths([40], seed=4)[0]
    with LLM(folder, device="cpu", dtype="float32", block_size=4, quantization="fp8") as llm:
        ours = engine_logits(llm.engine, tokens, prefill=19, chunks=[6])
        experts = next(m for m in _weights(llm).modules() if isinstance(m, Experts))
        assert experts.gate_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
        assert experts.down_proj_scale.shape == experts.down_proj.shape[:2]
    model, quantized_inputs = fake_quantized_moe_hf(folder)
    with torch.no_grad():
        plain = hf_model(folder)(torch.tensor([tokens])).logits[0]
        with mock.patch("torch.nn.functional.linear", quantized_inputs):
            want = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    assert (plain - want).abs().max() > 100 * (ours - want).abs().max()  # it did quantise


@pytest.mark.parametrize("arch", ["llama4", "gpt_oss"])
def test_fused_fp8_experts_equal_their_quantised_arithmetic(arch, tiny_model_dir):
    """Llama 4's and gpt-oss's fused experts (x @ W, stored column-major once quantised): each
    expert's rows through e4m3 weights with a scale per output column and inputs quantised
    per token, against that arithmetic written out in float64 from the unquantised weights."""
    from ringserve.model.fused_moe import FusedExperts

    with LLM(tiny_model_dir(arch), device="cpu", dtype="float32", quantization="fp8") as llm:
        experts = next(m for m in _weights(llm).modules() if isinstance(m, FusedExperts))
        assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj.stride(1) == 1
        num_experts, hidden, _ = experts.gate_up_proj.shape
        x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(0))
        ends = torch.tensor([3, 3, 9, 11][: num_experts - 1] + [11], dtype=torch.int32)
        got = experts.loop_forward(x, ends)

    def quantized(t):  # per row, read back
        q, scale = quantize_rows(t)
        return q.double() * scale.double()

    want, start = torch.empty(11, hidden, dtype=torch.float64), 0
    for e, end in enumerate(ends.tolist()):
        weights = {}
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)[e].double() * getattr(experts, name + "_scale")[e].double()
            weights[name] = w
        h = quantized(x[start:end]) @ weights["gate_up_proj"]
        if experts.gate_up_proj_bias is not None:
            h = h + experts.gate_up_proj_bias[e].double()
        act = experts.activation(h.float())
        y = quantized(act) @ weights["down_proj"]
        if experts.down_proj_bias is not None:
            y = y + experts.down_proj_bias[e].double()
        want[start:end] = y
        start = end
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_fp8_experts_share_the_down_rows_scales(tiny_model_dir):
    """TP splits each expert's intermediate size: gate/up rows are this rank's own, and the
    down projection's rows (their input split) take the whole row's scale."""
    folder = tiny_model_dir("qwen3_moe")
    held = {}
    for tp in (1, 2):
        with LLM(folder, device="cpu", dtype="float32", quantization="fp8", tp=tp, timeout_s=60) as llm:
            experts = next(m for m in _weights(llm).modules() if isinstance(m, Experts))
            held[tp] = {n: getattr(experts, n + "_scale").clone() for n in ("gate_proj", "down_proj")}
    half = held[1]["gate_proj"].shape[1] // 2
    torch.testing.assert_close(held[2]["gate_proj"], held[1]["gate_proj"][:, :half], rtol=0, atol=0)
    torch.testing.assert_close(held[2]["down_proj"], held[1]["down_proj"], rtol=0, atol=0)
