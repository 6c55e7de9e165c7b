"""The FP8 KV cache (--kv-cache-dtype fp8; kernels/kv_quant.py, worker/kv_calibration.py):
its number format against a float64 reference, the engine against transformers with its
cache quantised the same way, twice the tokens in the same memory, and every parallel layout
equal to the single rank. (The kernels' FP8 paths: tests/test_kernels.py,
test_skinny_matmul.py and test_paged_attention.py, under Triton's interpreter.)"""

import math

import pytest
import torch
from transformers import DynamicCache

from ringserve import LLM, SamplingParams
from ringserve.engine.logits_probe import engine_logits
from ringserve.kernels.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv
from ringserve.model.tiny_models import hf_model
from ringserve.options import EngineOptions, OptionError

from helpers import fp8_layout_run, prompts_of_lengths, run_requests, scored


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3fn value, from its definition (1 sign, 4 exponent bits
    with bias 7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN), in float64, with
    whether its mantissa's last bit is 0 (the even one a tie rounds to)."""
    values, even = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            even.append(m % 2 == 0)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(even)


def _round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (float64) to the nearest e4m3 value, ties to the even mantissa, saturated at 448."""
    grid, even = _e4m3_grid()
    mag = x.abs().clamp(max=FP8_MAX)
    dist = (mag[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    pick = torch.where(tied & even, 0, torch.where(tied, 1, 2)).argmin(-1)  # an even tie first
    return grid[pick] * x.sign()


def test_quantize_rounds_to_nearest_e4m3_and_saturates():
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([2.0**-5, 0.0371, 3.0])  # per KV head: exact, inexact, large
    x = torch.randn(64, 3, 40, generator=g, dtype=torch.float64) * torch.tensor([1.0, 30.0, 3000.0])[:, None]
    # exact ties (a value half-way between two e4m3 values) and the extremes
    x[0, 0, :6] = torch.tensor([1.0625, 1.1875, 300.0, 460.0, 1e6, -1e6]) * 2.0**-5
    got = quantize_kv(x.float(), scale.float())
    assert got.dtype == FP8_DTYPE
    want = _round_to_e4m3(x.float().double() / scale.float().double()[:, None])
    assert torch.equal(got.double(), want)
    assert got[0, 0, :6].double().tolist() == [1.0, 1.25, 288.0, 448.0, 448.0, -448.0]  # ties to even
    # read back: within half a step of e4m3 (2^-4 relative) where no value saturated
    back = dequantize_kv(got, scale.float(), torch.float64)
    inside = (x.abs() / scale[:, None] <= FP8_MAX) & (x.abs() / scale[:, None] >= 2**-6)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12)[inside].all()


def test_option_is_checked():
    with pytest.raises(OptionError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="int8")
    assert EngineOptions(kv_cache_dtype="fp8_e4m3").engine_config().kv_cache_dtype == "fp8_e4m3"


def _cache(llm):
    return llm.engine.executor.worker.kv_cache


def test_twice_the_tokens_in_the_same_memory(tiny_model_dir):
    common = dict(device="cpu", dtype="bfloat16", block_size=4, kv_cache_memory=1 << 20, max_model_len=256)
    with LLM(tiny_model_dir("llama"), **common) as llm:
        bf16_blocks = llm.engine.block_manager.num_blocks
        assert _cache(llm).k.dtype == torch.bfloat16
    with LLM(tiny_model_dir("llama"), kv_cache_dtype="fp8", **common) as llm:
        assert llm.engine.block_manager.num_blocks == 2 * bf16_blocks
        cache = _cache(llm)
        assert cache.k.dtype == cache.v.dtype == FP8_DTYPE
        # the budget, besides the scratch block of padded rows
        assert cache.nbytes * cache.num_blocks // (cache.num_blocks + 1) <= 1 << 20


def _fake_quantized(x, scales):
    """x [B, NKV, T, D] (transformers' cache layout) as the FP8 cache returns it."""
    return dequantize_kv(quantize_kv(x[0].transpose(0, 1), scales), scales, x.dtype).transpose(0, 1)[None]


def test_engine_matches_transformers_with_its_cache_quantized_alike(tiny_model_dir):
    """Every step attends over K and V as the FP8 cache holds them (as vLLM's do): the
    prompt, a chunk after it, and decode steps must give transformers' logits when its
    cache's K and V are quantised and read back with the engine's calibrated scales, to
    float32 tolerance; and they must not agree with the unquantised cache's."""
    folder = tiny_model_dir("llama")
    tokens = prompts_of_lengths([40], seed=3)[0]
    with LLM(folder, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8") as llm:
        ours = engine_logits(llm.engine, tokens, prefill=17, chunks=[7])
        scales = _cache(llm).scales.clone()  # [layers, 2, NKV]
    assert not torch.equal(scales, torch.ones_like(scales))  # calibrated

    hf = hf_model(folder)
    past = DynamicCache(config=hf.config)
    update = past.update

    def quantizing_update(keys, values, layer_idx, *args, **kwargs):
        keys = _fake_quantized(keys, scales[layer_idx, 0])
        values = _fake_quantized(values, scales[layer_idx, 1])
        return update(keys, values, layer_idx, *args, **kwargs)

    past.update = quantizing_update
    with torch.no_grad():
        want = hf(torch.tensor([tokens]), past_key_values=past, use_cache=True).logits[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)

    with LLM(folder, device="cpu", dtype="float32", block_size=4) as llm:
        unquantized = engine_logits(llm.engine, tokens, prefill=17, chunks=[7])
    assert (unquantized - want).abs().max() > 100 * (ours - want).abs().max()


def test_calibrated_scales_keep_greedy_output_close(tiny_model_dir):
    """Against the unquantised cache, greedy tokens of long decodes agree for most of their
    length, and the next-token distributions stay close (the tiny model's logits are near
    ties, so some divergence is expected)."""
    folder = tiny_model_dir("llama")
    prompts = prompts_of_lengths([30, 50, 70], seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        with LLM(folder, device="cpu", dtype="float32", block_size=4, kv_cache_dtype=kv) as llm:
            runs[kv] = [o.token_ids for o in llm.generate(prompts, params)]
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*runs.values())
    ]
    assert sum(agree) >= 0.5 * sum(map(len, runs["auto"])), agree


LAYOUTS = [
    dict(tp=2),
    dict(cp=2, cp_algo="pass_kv"),
    dict(cp=2, cp_algo="pass_q"),
    dict(dp=2),
]


@pytest.fixture(scope="module")
def single_rank_fp8(tiny_model_dir):
    return fp8_layout_run(tiny_model_dir("llama"), kv_cache_dtype="fp8")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_every_layout_equals_the_single_rank(layout, tiny_model_dir, single_rank_fp8):
    ref_tokens, ref_logits, ref_scales = single_rank_fp8
    tokens, logits, scales = fp8_layout_run(tiny_model_dir("llama"), kv_cache_dtype="fp8", **layout)
    if scales is not None:  # every CP rank, and each replica, calibrated alike
        torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    if logits is not None:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_gemma3_windows_through_the_fp8_ring(tiny_model_dir):
    """Sliding-window layers under pass-KV send only the FP8 keys a window reaches."""
    folder = tiny_model_dir("gemma3")
    tokens = prompts_of_lengths([70], seed=9)[0]
    results = []
    for layout in ({}, dict(cp=2, cp_algo="pass_kv")):
        with LLM(
            folder, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8", timeout_s=60, **layout
        ) as llm:
            results.append(engine_logits(llm.engine, tokens, prefill=50, chunks=[8]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    assert math.isfinite(results[0].abs().max().item())


def _with_kv_scales(folder: str, out: str, scales: dict) -> str:
    """A copy of the tiny checkpoint in folder with FP8 KV-cache scales added (name -> tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    path = f"{out}/model.safetensors"
    save_file({**load_file(path), **scales}, path, metadata={"format": "pt"})
    return out


def test_a_checkpoints_kv_scales_are_used(tiny_model_dir, tmp_path):
    """llm-compressor's kv_cache_scheme: each layer's self_attn.k_scale / v_scale, one per
    tensor (a scalar) or one per KV head; TP ranks take their heads' scales."""
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.03),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.01]),
        "model.layers.1.self_attn.k_scale": torch.tensor([0.02, 0.05]),  # per KV head
        "model.layers.1.self_attn.v_scale": torch.tensor(0.004),
    }
    folder = _with_kv_scales(tiny_model_dir("llama"), str(tmp_path / "scaled"), scales)
    want = torch.tensor([[[0.03, 0.03], [0.01, 0.01]], [[0.02, 0.05], [0.004, 0.004]]])
    with LLM(folder, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8") as llm:
        torch.testing.assert_close(_cache(llm).scales, want)
        logits = engine_logits(llm.engine, prompts_of_lengths([30], seed=2)[0], prefill=20)
    with LLM(
        folder, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8", tp=2, timeout_s=60
    ) as llm:
        tp_logits = engine_logits(llm.engine, prompts_of_lengths([30], seed=2)[0], prefill=20)
    torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match="model.layers.1.self_attn.v_scale"):
        partial = dict(scales)
        del partial["model.layers.1.self_attn.v_scale"]
        folder = _with_kv_scales(tiny_model_dir("llama"), str(tmp_path / "partial"), partial)
        LLM(folder, device="cpu", dtype="float32", kv_cache_dtype="fp8")


def test_prefix_hits_and_preemption_read_the_same_fp8_blocks(tiny_model_dir):
    """The scales are fixed, so a block is read the same by the step that wrote it, by a later
    request that finds it in the prefix cache, and after its sequence was preempted and
    recomputed: each request alone, then again (prefix hits), then all together in a cache
    too small for them (preemption) give the same tokens and log-probabilities."""
    folder = tiny_model_dir("llama")
    prompts = prompts_of_lengths([40, 35, 30, 45, 20, 38], seed=2)
    common = dict(device="cpu", dtype="float32", block_size=8, kv_cache_dtype="fp8", max_model_len=128)
    with LLM(folder, **common) as llm:
        alone = [run_requests(llm.engine, [p], scored(16))[0] for p in prompts]
        ids = [llm.engine.add_request(p, scored(1)) for p in prompts]
        hits = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                hits[out.request_id] = out.num_cached_tokens
        assert all(hits[i] > 0 for i in ids)
        again = [run_requests(llm.engine, [p], scored(16))[0] for p in prompts]
    with LLM(folder, num_blocks=20, **common) as llm:
        together = run_requests(llm.engine, prompts, scored(16))
        assert llm.engine.num_preemptions > 0
    for a, b, c in zip(alone, again, together):
        assert a[0] == b[0] == c[0]
        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(c[1], a[1], rtol=1e-5, atol=1e-5, equal_nan=True)
