"""The Triton RMSNorm (with and without the residual add) and RoPE kernels (kernels/elementwise.py)
against their torch references, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1,
set before the kernels are defined: hence a fresh process).

float32 must agree to rounding. In bfloat16 the interpreter rounds float32 -> bfloat16 by
truncation (a GPU rounds to nearest), so there each rounding may differ by one bfloat16 step.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from ringserve.kernels import elementwise as K

torch.manual_seed(0)
tokens, hidden, eps = 7, 96, 1e-6  # 96: not a power of two, masked columns
# bfloat16: up to three truncations in a row (sum, normalised value, product), each a step of
# 2^-7 relative; RoPE's difference of two rounded products, a step of the larger (|x| < 4).
for dtype, rtol, atol in ((torch.float32, 1e-6, 1e-6), (torch.bfloat16, 3 * 2**-7, 2**-5)):
    def check(got, want):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)

    # add + norm over a residual stream whose rows are strided (a view of a wider tensor)
    x = torch.randn(tokens, hidden).to(dtype)
    residual = torch.randn(tokens, 2 * hidden).to(dtype)[:, :hidden]
    weight = torch.rand(hidden).add(0.5).to(dtype)
    normed, total = K._rms_norm_triton(x, residual, weight, eps)
    check(total, residual + x)
    check(normed, K._rms_norm_torch(residual + x, weight, eps))
    check(K._rms_norm_triton(x, None, weight, eps)[0], K._rms_norm_torch(x, weight, eps))

    # q/k heads read straight out of a fused qkv output: q [T, NH, D] at a token stride
    nh, nkv, d = 4, 2, 24
    qkv = torch.randn(tokens, (nh + 2 * nkv) * d).to(dtype)
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k = q.view(tokens, nh, d), k.view(tokens, nkv, d)
    w_head = torch.rand(d).add(0.5).to(dtype)
    check(K._rms_norm_triton(q, None, w_head, eps)[0], K._rms_norm_torch(q, w_head, eps))
    check(K._rms_norm_triton(k, None, w_head, eps)[0], K._rms_norm_torch(k, w_head, eps))

    # RoPE on q and k in one launch, positions far apart (large angles)
    positions = torch.tensor([0, 1, 2, 3, 1000, 4095, 70000]).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, D]
    q_rot, k_rot = K._rotary_triton(q, k, cos, sin)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    check(q_rot, K.apply_rotary(q, cos, sin))
    check(k_rot, K.apply_rotary(k, cos, sin))
    assert torch.equal(qkv[:, : nh * d].view(tokens, nh, d), q)  # inputs untouched
    # the same launch also writing the rotated k and v (a view of qkv) to their cache slots
    v = v.view(tokens, nkv, d)
    k_cache, v_cache = torch.zeros(50, nkv, d).to(dtype), torch.zeros(50, nkv, d).to(dtype)
    slots = torch.tensor([3, 17, 4, 49, 0, 22, 8])
    q_rot2, k_rot2 = K._rotary_triton(q, k, cos, sin, (v, k_cache, v_cache, slots, None))
    assert torch.equal(q_rot2, q_rot) and torch.equal(k_rot2, k_rot)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[slots], want_v[slots] = k_rot, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

# No tokens: nothing launched, empty outputs.
empty = torch.randn(0, hidden)
assert K._rms_norm_triton(empty, empty, weight.float(), eps)[0].shape == (0, hidden)
assert K._rotary_triton(q[:0], k[:0], cos[:0], sin[:0])[0].shape == (0, nh, d)
# silu(gate) * up over the fused gate_up output (width not a multiple of the block)
for dtype in (torch.float32, torch.bfloat16):
    gate_up = torch.randn(5, 2 * 1500).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    got = K._silu_mul_triton(gate_up)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 2**-6, atol=1e-6)

# new K/V rows to their cache slots; v a view into a fused qkv output
qkv = torch.randn(6, 3 * 2 * 16)
k = qkv[:, 32:64].view(6, 2, 16).contiguous()
v = qkv[:, 64:].view(6, 2, 16)
k_cache, v_cache = torch.zeros(40, 2, 16), torch.zeros(40, 2, 16)
slots = torch.tensor([3, 17, 4, 39, 0, 22])
K._store_kv_triton(k, v, k_cache, v_cache, slots)
want_k, want_v = torch.zeros(40, 2, 16), torch.zeros(40, 2, 16)
want_k[slots], want_v[slots] = k, v
assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
# An FP8 cache (kernels/kv_quant.py): the store kernel and RoPE + store quantise as the torch
# form does, with each KV head's scale (heads of different ranges; values past 448 x scale
# saturate). The interpreter's float32 -> e4m3 drops the carry where a value rounds up to a
# power of two (127.9 -> 64, not 128); elsewhere it rounds as torch does. (A GPU's is checked
# by bench/gpu_checks.py.)
from ringserve.kernels.kv_quant import FP8_DTYPE, quantize_kv

def check_fp8(got, want):
    assert got.dtype == want.dtype == FP8_DTYPE
    g, w = got.float(), want.float()
    carry_lost = (g == w / 2) & (torch.frexp(w).mantissa.abs() == 0.5)
    assert ((g == w) | carry_lost).all() and (g == w).float().mean() > 0.95

nkv, d = 3, 24
ranges = torch.tensor([0.05, 1.0, 30.0])[None, :, None]
scales = (torch.tensor([0.0004, 0.004, 0.05]), torch.tensor([0.0002, 0.003, 0.06]))
k = torch.randn(6, nkv, d) * ranges
v = torch.randn(6, nkv, d) * ranges
k_cache, v_cache = torch.zeros(40, nkv, d, dtype=FP8_DTYPE), torch.zeros(40, nkv, d, dtype=FP8_DTYPE)
K._store_kv_triton(k, v, k_cache, v_cache, slots, scales)
check_fp8(k_cache[slots], quantize_kv(k, scales[0]))
check_fp8(v_cache[slots], quantize_kv(v, scales[1]))
assert k_cache[slots].float().abs().max() == 448  # saturated, not inf or NaN
others = torch.ones(40, dtype=torch.bool)
others[slots] = False
assert (k_cache[others].float() == 0).all() and (v_cache[others].float() == 0).all()
q = torch.randn(6, 4, d)
positions = torch.tensor([0, 5, 17, 300, 4095, 9]).float()
inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
cos, sin = emb.cos()[:, None], emb.sin()[:, None]
k_cache.zero_(), v_cache.zero_()
q_rot, k_rot = K._rotary_triton(q, k, cos, sin, (v, k_cache, v_cache, slots, scales))
check_fp8(k_cache[slots], quantize_kv(K.apply_rotary(k, cos, sin), scales[0]))
check_fp8(v_cache[slots], quantize_kv(v, scales[1]))
torch.testing.assert_close(k_rot, K.apply_rotary(k, cos, sin), rtol=1e-6, atol=1e-5)
# the sampler's Gumbel noise: the fused 32-bit hash equals the int64 tensor-op hash
from ringserve.engine import sampler as S
key = torch.tensor([0, 1, 2**32 - 1, 123456789, 987654321], dtype=torch.int64)
key2 = S._mix32(key ^ 0x85EBCA6B)
h = S._mix32(S._mix32(key[:, None] ^ torch.arange(3000)) ^ key2[:, None])
# the keys as SamplingTensors holds them: columns of one [S, 4] tensor (strided)
fields = torch.stack([torch.zeros_like(key), torch.full_like(key, 7), key, key2], dim=1)
torch.testing.assert_close(
    S._gumbel_triton(fields[:, 2], fields[:, 3], 3000), S._gumbel_of_hash(h), rtol=1e-6, atol=1e-6
)
# argmax per row: chunks reduced in parallel, then the chunks' winners; ties go to the first
# index (across chunks, across lanes, within a lane), a row of -inf to index 0; rows strided
vocab = 1000
x = torch.randn(6, vocab + 8)[:, :vocab]
x[1, [700, 70]] = 9.0  # a tie across chunks
x[2, [37, 5]] = 9.0  # across lanes of one chunk
x[3, [67, 3]] = 9.0  # within one lane (chunk 128, block 64)
x[4] = float("-inf")
x[5, -1] = 50.0  # in the last, partial chunk
for chunk in (64, 128, 4096):
    got = S._argmax_triton(x, chunk=chunk)
    assert torch.equal(got, x.argmax(dim=-1)), (chunk, got, x.argmax(dim=-1))
# A decode step's rows, lengths and KV slots in one kernel (engine/step_state.py) against the
# torch form: the inputs a slice of a wider buffer (as DecodeGraphs passes them), two KV
# groups, positions either side of block boundaries (blocks of 16), a pad row.
from ringserve.worker import step_state as St
tables = torch.randint(0, 50, (2, 6, 9), dtype=torch.int32)
buffer = torch.zeros(4, 24, dtype=torch.int64)
buffer[1, :5] = torch.tensor([0, 15, 16, 63, 130])
buffer[2, :5] = torch.tensor([3, 0, 5, 1, 2])
buffer[3, :5] = buffer[1, :5] + 1
got = St._decode_step_triton(buffer[:, :5], tables, 16)
want = St.decode_step_tensors(buffer[:, :5], tables, 16)
for g, w in zip(got, want):
    assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
assert got[2][1, 4] == tables[1, 2, 8] * 16 + 2 and got[2][0, 2] == tables[0, 5, 1] * 16
print("ok")
"""


def test_triton_norm_and_rope_kernels_match_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
