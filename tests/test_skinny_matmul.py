"""The skinny decode matmul (ringserve/kernels/skinny_matmul.py) against F.linear, run on the CPU by
Triton's interpreter (TRITON_INTERPRET=1, set before the kernel is defined: hence a fresh
process), in float32 (the interpreter's bfloat16 dot is not usable); and where it is chosen.
"""

import os
import subprocess
import sys

import pytest
import torch

from ringserve.kernels import skinny_matmul as S

SCRIPT = r"""
import torch
import torch.nn.functional as F
from ringserve.kernels import skinny_matmul as S
from ringserve.kernels.kv_quant import FP8_DTYPE

torch.manual_seed(0)
# rows 1 (batch 1), 5 (a partial tile), 16 (the tile); N not a multiple of BLOCK_N; x a view
# of a wider tensor (rows strided, as o_proj reads attention's output); bias or not.
# Plans writing fewer columns than their tile (the rest masked off): 23 of 32, 47 of 64.
for m, n, k, plan in (
    (1, 100, 256, (32, 128, 3)), (5, 64, 512, (64, 256, 4)), (16, 40, 128, (32, 64, 3)),
    (3, 100, 256, (32, 128, 3, 23)), (2, 100, 512, (64, 256, 4, 47)),
):
    wide = torch.randn(m, k + 24)
    x = wide[:, :k]
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n)
    for bias in (None, b):
        got = S.skinny_linear(x, w, bias, plan)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
# The gate/up matmul with its activation in the epilogue: [2I, K] weights (gate rows, then
# up rows), I not a multiple of BLOCK_N, against F.linear and the activation kernel's CPU form.
for m, inter, k, plan in ((1, 100, 256, (32, 128, 3)), (7, 48, 128, (16, 64, 3)), (4, 100, 128, (32, 128, 3, 27))):
    x = torch.randn(m, k)
    w = torch.randn(2 * inter, k) / k**0.5
    for activation, act_mul in S.GATED_ACTIVATIONS.items():
        got = S.skinny_linear(x, w, None, plan, activation)
        torch.testing.assert_close(got, act_mul(F.linear(x, w)), rtol=1e-5, atol=1e-5)
# q/k/v with RoPE and the KV store in the epilogue, against F.linear and rotary_store_kv's CPU
# form: rows 1, 5 and 16 (x strided); tiles of 32 and 16 pairs (one, two and four programs a
# head); a bias; the cache slots written and no other.
from ringserve.kernels.elementwise import rotary_store_kv
for m, nq, nkv, d, k, bias, plan in (
    (1, 4, 2, 64, 128, False, (64, 64, 3)), (5, 6, 2, 128, 256, True, (64, 64, 3)),
    (16, 2, 1, 64, 64, True, (32, 64, 3)), (2, 2, 1, 128, 64, False, (32, 64, 3)),
):
    x = torch.randn(m, k + 8)[:, :k]
    w = torch.randn((nq + 2 * nkv) * d, k) / k**0.5
    b = torch.randn(w.shape[0]) if bias else None
    angle = 100 * torch.rand(m, 1, d // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.randperm(40)[:m]
    caches = [torch.randn(40, nkv, d) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    got = S.skinny_qkv_rope(x, w, b, cos, sin, *caches, slots, plan)
    q, kk, v = (t.view(m, -1, d) for t in F.linear(x, w, b).split([nq * d, nkv * d, nkv * d], -1))
    q, kk = rotary_store_kv(q, kk, v, cos, sin, *want_caches, slots)
    for a, e in zip((*got, *caches), (q, kk, v, *want_caches)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
# ... storing to an FP8 cache (kernels/kv_quant.py): k and v divided by their head's scale,
# in e4m3, as rotary_store_kv's CPU form stores them (the interpreter's e4m3 rounding drops
# the carry into a power of two, as tests/test_kernels.py says: 127.9 -> 64, not 128).
for m, nq, nkv, d, k, plan in ((1, 4, 2, 64, 128, (64, 64, 3)), (5, 2, 2, 64, 64, (32, 64, 3))):
    x = torch.randn(m, k)
    w = torch.randn((nq + 2 * nkv) * d, k) / k**0.5 * torch.logspace(-1, 1, nq + 2 * nkv).repeat_interleave(d)[:, None]
    angle = 100 * torch.rand(m, 1, d // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.randperm(40)[:m]
    scales = (torch.rand(nkv) * 0.05 + 0.001, torch.rand(nkv) * 0.05 + 0.001)
    caches = [torch.zeros(40, nkv, d, dtype=FP8_DTYPE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    got = S.skinny_qkv_rope(x, w, None, cos, sin, *caches, slots, plan, kv_scales=scales)
    q, kk, v = (t.view(m, -1, d) for t in F.linear(x, w).split([nq * d, nkv * d, nkv * d], -1))
    q, kk = rotary_store_kv(q, kk, v, cos, sin, *want_caches, slots, kv_scales=scales)
    for a, e in zip(got, (q, kk, v)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    for a, e in zip(caches, want_caches):
        a, e = a.float(), e.float()
        carry_lost = (a == e / 2) & (torch.frexp(e).mantissa.abs() == 0.5)
        assert ((a == e) | carry_lost).all() and (a == e).float().mean() > 0.95 and e.abs().max() > 100
# FP8 weights (--quantization fp8): e4m3 rows with a float32 scale each, x quantised per row
# in the kernel, against fp8_matmul's torch form (exact products, float32 sums in another
# order); plain, with a bias, gated, and q/k/v with RoPE and the store (rows 1, 5 and 16).
# x's rows are e4m3 values times a power of two, each with a 448 in it: their quantisation is
# exact, so the interpreter's float32 -> e4m3 (which drops a rounding's carry into a power of
# two, tests/test_kernels.py) does not enter; a GPU's rounding is checked by bench/gpu_checks.py.
from ringserve.kernels.kv_quant import FP8_DTYPE

def exact_rows(m, k, zero_row=False):
    q = (torch.randn(m, k) * 60).clamp(-448, 448).to(FP8_DTYPE).float()
    q[:, 3] = 448.0
    x = q * 2.0 ** torch.randint(-12, 0, (m, 1)).float()
    if zero_row:
        x[0] = 0.0
    return x

# the one-pass row quantisation of a prefill's activations (K not a power of two)
x = exact_rows(9, 300, zero_row=True)
got, got_scale = S._quantize_rows_triton(x)
want, want_scale = S.quantize_rows(x)
assert torch.equal(got.float(), want.float()) and torch.equal(got_scale, want_scale) and want_scale[0] == 1
# act(gate) * up quantised per row in one pass (a prefill's MLP before an FP8 down_proj): the
# values of the silu_mul kernel's formula, then quantize_rows (I not a power of two; a row of
# zeros). Besides the dropped carry, the interpreter's e4m3 rounds some subnormals (below
# 2^-6) one step of 2^-9 down.
gate_up = torch.randn(7, 2 * 300) * 3
gate_up[2] = 0.0
got, got_scale = S._silu_mul_quantize_triton(gate_up)
gate, up = gate_up.chunk(2, -1)
want, want_scale = S.quantize_rows(gate / (1.0 + torch.exp(-gate)) * up)
assert torch.equal(got_scale, want_scale) and want_scale[2] == 1
g, w = got.float(), want.float()
carry_lost = (g == w / 2) & (torch.frexp(w).mantissa.abs() == 0.5)
subnormal_step = (w.abs() < 2**-6) & ((g - w).abs() <= 2**-9)
assert ((g == w) | carry_lost | subnormal_step).all() and (g == w).float().mean() > 0.95
for m, n, k, plan in ((1, 64, 256, (32, 128, 3)), (5, 100, 512, (64, 256, 4)), (16, 40, 128, (32, 64, 3))):
    x = exact_rows(m, k, zero_row=m > 1)
    w8, w_scale = S.quantize_rows(torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None])
    w_scale = w_scale[:, 0]
    b = torch.randn(n)
    for bias in (None, b):
        got = S.skinny_linear(x, w8, bias, plan, weight_scale=w_scale)
        torch.testing.assert_close(got, S.fp8_matmul(x, w8, w_scale, bias), rtol=1e-5, atol=1e-5)
    gated = S.skinny_linear(x, w8, None, (plan[0] // 2, *plan[1:]), "silu", weight_scale=w_scale)
    torch.testing.assert_close(gated, S.silu_mul(S.fp8_matmul(x, w8, w_scale)), rtol=1e-4, atol=1e-5)
for m, nq, nkv, d, k, plan in ((1, 4, 2, 64, 128, (64, 64, 3)), (5, 2, 2, 64, 64, (32, 64, 3))):
    x = exact_rows(m, k) / 100
    w8, w_scale = S.quantize_rows(torch.randn((nq + 2 * nkv) * d, k) / k**0.5)
    w_scale = w_scale[:, 0]
    angle = 100 * torch.rand(m, 1, d // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.randperm(40)[:m]
    caches = [torch.zeros(40, nkv, d) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    got = S.skinny_qkv_rope(x, w8, None, cos, sin, *caches, slots, plan, weight_scale=w_scale)
    q, kk, v = (t.view(m, -1, d) for t in S.fp8_matmul(x, w8, w_scale).split([nq * d, nkv * d, nkv * d], -1))
    q, kk = rotary_store_kv(q, kk, v, cos, sin, *want_caches, slots)
    for a, e in zip((*got, *caches), (q, kk, v, *want_caches)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
# out: float32 logits from float16 x and w (the LM head into a decode graph's static logits)
# hold the values rounded to float16, as F.linear(...).float() does: each one a float16
# value, and F.linear's own or the float16 next to it (the float32 sums differ in order).
x, w = torch.randn(3, 256).half(), (torch.randn(100, 256) / 16).half()
out = torch.full((3, 100), float("nan"))
assert S.skinny_linear(x, w, None, (32, 128, 3), out=out) is out
want = F.linear(x.float(), w.float()).half().float()
assert torch.equal(out, out.half().float())
assert ((out - want).abs() <= want.abs() * 2**-10 + 1e-7).all() and (out == want).float().mean() > 0.9
print("ok")
"""


@pytest.mark.skipif(S.triton is None, reason="needs Triton (its CPU interpreter)")
def test_skinny_kernel_matches_f_linear():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_skinny_plan_only_where_it_pays():
    # Llama-3-8B's shapes on 132 multiprocessors: the swept tiles.
    assert S._plan(4096, 4096, 132) == (32, 512, 4, 32)  # o_proj
    assert S._plan(4096, 14336, 132) == (32, 512, 4, 32)  # down_proj: 14336 = 28 x 512
    assert S._plan(6144, 4096, 132) == (64, 256, 4, 64)  # qkv
    assert S._plan(28672, 4096, 132) == (64, 128, 3, 64)  # gate_up
    # A K that 512 does not divide takes the largest block that does; none: cuBLAS.
    assert S._plan(4096, 1792, 132) == (32, 256, 4, 32)
    assert S._plan(4096, 1000, 132) is None
    # A tensor-parallel shard too narrow to spread over the GPU: cuBLAS (it splits K).
    assert S._plan(768, 4096, 132) is None
    # Never on the CPU, in float32, or for more rows than a decode tile.
    x, w = torch.randn(1, 4096), torch.randn(4096, 4096)
    assert S.skinny_plan(x, w) is None and S.skinny_plan(x.bfloat16(), w.bfloat16()) is None
    assert torch.equal(S.linear(x, w), torch.nn.functional.linear(x, w))
    # The gated form's columns each read a gate and an up row: half the columns per program.
    # Llama-3-8B's 14336 columns in one wave of four programs a multiprocessor (an H200's):
    # 512 of 28 (of the tile's 32); a tp=2 shard's 7168 would need 14, half the tile: 224 of
    # 32; where the programs a multiprocessor holds are not known, whole tiles.
    assert S._plan(28672, 4096, 132, gated=True, resident=4) == (32, 128, 3, 28)
    assert S._plan(14336, 4096, 132, gated=True, resident=4) == (32, 128, 3, 32)
    assert S._plan(28672, 4096, 132, gated=True) == (32, 128, 3, 32)
    assert S._plan(4096, 4096, 132, gated=True, resident=4) == (16, 512, 4, 16)
    assert S.skinny_plan(x, w, gated=True) is None
    assert torch.equal(S.gated_linear(x, w, "silu"), S.silu_mul(torch.nn.functional.linear(x, w)))
