"""Decode's weight matmuls: y = x @ W^T + b for a few rows of x (a decode batch of at most
`MAX_ROWS`), as one Triton program per BLOCK_N output columns that streams its rows of W
once over all of K.

Why our own: at decode a matmul is a read of W, and what a step costs is how close each one
comes to the memory's bandwidth. cuBLAS tiles these shapes for larger M; on an H200 it
reads Llama-3-8B's o_proj (4096 x 4096) at ~3.0 TB/s and down_proj with a split-K reduce
kernel after it. Measured inside a CUDA graph of the 32 layers' matmuls
(bench/bench_decode_chain.py), this kernel takes the chain from 4.30 to 4.06 ms at batch 1,
and the engine's whole decode step from 4.80 to 4.44-4.51 ms (BENCHMARKS.md).

`gated_linear` is the MLP's gate/up matmul with its activation in the epilogue: each program
reads its columns' gate rows and up rows and writes act(gate) * up, so no [M, 2I] output is
written and read back and no separate activation kernel runs.

`qkv_rope_store` is attention's q/k/v matmul with RoPE and the KV store in its epilogue
(each program reads the weight rows of column pairs (i, i + D/2) of one head, the pairs the
rotation mixes), so no RoPE + store kernel runs between it and the paged attention kernel.

Everywhere else (the CPU, float32, more rows, shards too narrow to fill the GPU, K that no
block divides) `linear` is F.linear, `gated_linear` F.linear and the activation kernel, and
`qkv_rope_store` returns None (the caller runs F.linear and kernels.rotary_store_kv).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ringserve.kernels.elementwise import gelu_tanh_mul, silu_mul
from ringserve.kernels.kv_quant import FP8_DTYPE
from ringserve.kernels.kv_quant import FP8_MAX as FP8_MAX_VALUE
from ringserve.kernels.kv_quant import TL_FP8_MAX as FP8_MAX
from ringserve.kernels.pdl import launch_options

try:
    import triton
    import triton.language as tl

    from ringserve.kernels.pdl import wait_for_previous
except ImportError:  # CPU builds of torch come without Triton
    triton = None

MAX_ROWS = 16  # decode batches up to here; the dot's tile has 16 rows either way
_HALF = (torch.bfloat16, torch.float16)
# act(gate) * up of a [M, 2I] gate/up output, by the config's hidden_act; and the kernel's
# code for the same activation in its epilogue.
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}  # config.names.GATED_ACTIVATIONS
_ACTIVATION_CODE = {"silu": 1, "gelu_pytorch_tanh": 2}


class QuantizedRows(NamedTuple):
    """Activations already quantised per row for FP8 matmuls (quantize_rows' format), by the
    kernel that produced them or once for several weights that read them: values e4m3
    [M, K], scale float32 [M, 1], dtype the activations' own (the matmul's output's)."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = True,
    out: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), x [M, K], weight [N, K]; the skinny kernel where it pays
    (pdl: launched with programmatic dependent launch where the GPU has it, ringserve.kernels.pdl).
    out: a contiguous [M, N] tensor (float32 for the LM head's logits) to write the result
    into, rounded to x's dtype first, as F.linear(...).to(out.dtype) would be.
    weight_scale: weight is FP8 with this float32 scale per row [N] (fp8_matmul); x may then
    come quantised already (QuantizedRows)."""
    if isinstance(x, QuantizedRows):
        y = fp8_matmul(x, weight, weight_scale, bias)
        return y if out is None else out.copy_(y)
    plan = skinny_plan(x, weight)
    if plan is None:
        y = F.linear(x, weight, bias) if weight_scale is None else fp8_matmul(x, weight, weight_scale, bias)
        return y if out is None else out.copy_(y)
    return skinny_linear(x, weight, bias, plan, pdl=pdl, out=out, weight_scale=weight_scale)


def gated_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str,
    pdl: bool = True,
    weight_scale=None,
    quantize_output: bool = False,
) -> torch.Tensor | QuantizedRows:
    """act(x @ gate^T) * (x @ up^T) [M, I] for weight [2I, K] (gate rows, then up rows), as HF's
    `act_fn(gate_proj(x)) * up_proj(x)`: each matmul's and the activation's result rounded to
    x's dtype before the product. weight_scale: as linear's. quantize_output: the result feeds
    an FP8 matmul; where that matmul quantises its input (more rows than the skinny kernel
    takes), the result comes quantised from the activation's own pass (gated_quantized)."""
    plan = skinny_plan(x, weight, gated=True)
    if plan is None:
        y = F.linear(x, weight) if weight_scale is None else fp8_matmul(x, weight, weight_scale)
        # (decode rows on a GPU: the skinny down projection quantises its input itself)
        if quantize_output and not (x.is_cuda and x.shape[0] <= MAX_ROWS):
            return gated_quantized(y, activation)
        return GATED_ACTIVATIONS[activation](y)
    return skinny_linear(x, weight, None, plan, activation, pdl=pdl, weight_scale=weight_scale)


def qkv_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    pdl: bool = True,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Attention's q/k/v projection with RoPE and the KV store in its epilogue: (q [T, NH, D],
    k, v [T, NKV, D]) of x [T, K] @ weight^T + bias, weight [(NH + 2 NKV) * D, K] (q heads,
    then k, then v), q and k rotated by HF's RoPE (cos, sin [T, 1, D], in x's dtype) and k, v
    written to the caches [S, NKV, D] at slots [T], rounded where F.linear and
    kernels.rotary_store_kv round (kv_scales: (k_scale, v_scale) [NKV] float32 of an FP8
    cache, stored as kernels/kv_quant.py says). One kernel instead of the matmul and the RoPE + store
    kernel after it. Each program reads the weight rows of BLOCK_N column pairs (i, i + D/2)
    of one head, the pairs the rotation mixes: the skinny plan's rows, half of them partners.
    None where the skinny kernel does not run: the caller runs the matmul and
    kernels.rotary_store_kv."""
    plan = skinny_plan(x, weight)
    head_dim = k_cache.shape[2]
    if plan is None or head_dim % plan[0] or weight.shape[0] % head_dim:
        return None
    cache_dtype = x.dtype if kv_scales is None else FP8_DTYPE
    if (
        k_cache.dtype != cache_dtype
        or v_cache.dtype != cache_dtype
        or slots.dim() != 1
        or slots.stride(0) != 1
    ):
        return None
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return None
    return skinny_qkv_rope(
        x, weight, bias, cos, sin, k_cache, v_cache, slots, plan, pdl, kv_scales, weight_scale
    )


def skinny_qkv_rope(
    x,
    weight,
    bias,
    cos,
    sin,
    k_cache,
    v_cache,
    slots,
    plan,
    pdl: bool = True,
    kv_scales=None,
    weight_scale=None,
):
    """qkv_rope_store's kernel with plan's tile (skinny_plan's for the weight): its BLOCK_N
    rows a program are BLOCK_N / 2 column pairs, BLOCK_N dividing the head_dim."""
    tokens = x.shape[0]
    num_kv, head_dim = k_cache.shape[1], k_cache.shape[2]
    half = head_dim // 2
    num_q = weight.shape[0] // head_dim - 2 * num_kv
    q = torch.empty(tokens, num_q, head_dim, dtype=x.dtype, device=x.device)
    k = torch.empty(tokens, num_kv, head_dim, dtype=x.dtype, device=x.device)
    v = torch.empty(tokens, num_kv, head_dim, dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    pairs, block_k, stages = plan[0] // 2, plan[1], plan[2]
    x_scale = cos  # read only if W_FP8
    if weight_scale is not None:  # x's rows in e4m3 once, before the matmul's programs read them
        x, x_scale = quantize_rows(x, pdl=pdl)
    launch = launch_options(x, pdl)
    k_scale, v_scale = kv_scales if kv_scales is not None else (cos, cos)  # read only if QUANT
    _qkv_rope_kernel[((num_q + 2 * num_kv) * (half // pairs),)](
        x, x_scale, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else x, cos, sin,
        q, k, v, k_cache, v_cache, slots, k_scale, v_scale, tokens, x.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), K=x.shape[1],
        HAS_BIAS=bias is not None, QUANT=kv_scales is not None, W_FP8=weight_scale is not None,
        NUM_Q=num_q, NUM_KV=num_kv,
        HEAD_DIM=head_dim, BLOCK_M=16, BLOCK_N=pairs, BLOCK_K=block_k, PDL=bool(launch),
        num_warps=4, num_stages=stages, **launch,
    )  # fmt: skip
    return q, k, v


def quantize_rows(
    x: torch.Tensor, amax: torch.Tensor | None = None, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scale [M, 1]) of x [M, K], one scale per row: amax / 448 (1 for a
    row of zeros), x / scale rounded to nearest even once, in float32. amax [M, 1]: the rows'
    largest |value| to use instead of x's own (a shard of longer rows)."""
    if amax is None and triton is not None and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        return _quantize_rows_triton(x, pdl)
    if amax is None:
        amax = x.abs().amax(-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX_VALUE, torch.ones_like(amax))
    return (x.float() / scale).clamp_(-FP8_MAX_VALUE, FP8_MAX_VALUE).to(FP8_DTYPE), scale


def gated_quantized(gate_up: torch.Tensor, activation: str) -> QuantizedRows:
    """quantize_rows(act(gate) * up) of gate_up [M, 2I] (GATED_ACTIVATIONS' input): on a GPU
    for silu one pass that reads gate_up and writes the e4m3 rows (a program per row holds
    its I values), where the activation's kernel and the quantisation's would write [M, I] in
    x's dtype and read it back (at 8K tokens of Llama-3-8B, 0.47 GB a layer). The same values
    as the two kernels, bit for bit."""
    if activation != "silu" or triton is None or not gate_up.is_cuda or gate_up.shape[0] == 0:
        return QuantizedRows(*quantize_rows(GATED_ACTIVATIONS[activation](gate_up)), gate_up.dtype)
    return QuantizedRows(*_silu_mul_quantize_triton(gate_up), gate_up.dtype)


def _silu_mul_quantize_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, width = gate_up.shape
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    half = width // 2
    out = torch.empty(m, half, dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    block = triton.next_power_of_2(half)
    _silu_mul_quantize_kernel[(m,)](
        gate_up, out, scale, gate_up.stride(0), half, BLOCK=block, num_warps=min(16, max(4, block // 1024))
    )
    return out, scale


def _quantize_rows_triton(x: torch.Tensor, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one pass on the GPU: a program per row reads it once (torch's form
    makes five passes over a prefill's activations, which cost more than FP8's matmul saves;
    at decode, once for the few rows rather than in each program of the matmul after it)."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        launch = launch_options(x, pdl)
        _quantize_rows_kernel[(m,)](
            x, out, scale, x.stride(0), k, BLOCK=block, PDL=bool(launch), num_warps=min(16, max(4, block // 1024)),
            **launch,
        )  # fmt: skip
    return out, scale


def fp8_matmul(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ (weight x weight_scale)^T + bias in x's dtype, the FP8 weights' matmul (--quantization
    fp8): weight [N, K] e4m3 with a float32 scale per row [N]; x [M, K] quantised to e4m3 per
    row (per token, dynamic); the products of the e4m3 values summed in float32 and scaled by
    both. torch's scaled_mm on a GPU with FP8 tensor cores; the same arithmetic in float32
    elsewhere (the skinny kernel's too, at decode). x may come quantised already
    (QuantizedRows)."""
    xq, x_scale, dtype = x if isinstance(x, QuantizedRows) else (*quantize_rows(x), x.dtype)
    n, k = weight.shape
    if xq.is_cuda and torch.cuda.get_device_capability(xq.device) >= (8, 9) and n % 16 == 0 and k % 16 == 0:
        return torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], bias=bias, out_dtype=dtype
        )
    y = (xq.float() @ weight.float().t()) * x_scale * weight_scale[None, :]
    if bias is not None:
        y += bias.float()
    return y.to(dtype)


def fp8_grouped_mm_usable(device: torch.device) -> bool:
    """Whether fp8_grouped_mm runs as one grouped matmul: torch's row-wise FP8 grouped
    kernels are Hopper's (compute capability 9.x)."""
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
    )


def fp8_grouped_mm(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    ends: torch.Tensor,
) -> torch.Tensor:
    """Each group of x's rows times its expert's FP8 weight, fp8_matmul's arithmetic in one
    grouped matmul (fp8_grouped_mm_usable): x [N, K] (rows sorted by group, group e's ending
    at ends[e], int32 on the device), or QuantizedRows for an x that several weights read;
    weight [E, K, Nout] e4m3 laid out column-major (stride(1) == 1: each expert's [Nout, K]
    rows contiguous), weight_scale [E, Nout] float32 -> [N, Nout] in x's dtype."""
    xq, x_scale, dtype = x if isinstance(x, QuantizedRows) else (*quantize_rows(x), x.dtype)
    return torch._scaled_grouped_mm(xq, weight, x_scale[:, 0], weight_scale, offs=ends, out_dtype=dtype)


def skinny_plan(
    x: torch.Tensor, weight: torch.Tensor, gated: bool = False
) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_stages, columns a program writes) where the skinny kernel runs
    x @ weight^T, else None. gated: BLOCK_N counts the output's columns, each of which reads
    a gate and an up row."""
    if triton is None or not x.is_cuda or x.dtype not in _HALF or weight.dtype not in (x.dtype, FP8_DTYPE):
        return None
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0 or x.stride(-1) != 1:
        return None
    if not weight.is_contiguous():
        return None
    n, k = weight.shape
    props = torch.cuda.get_device_properties(x.device.index or 0)  # cached by torch
    # Hopper, where the gated tile was measured to run four programs a multiprocessor
    return _plan(n, k, props.multi_processor_count, gated, resident=4 if props.major == 9 else 0)


def _plan(
    n: int, k: int, multiprocessors: int, gated: bool = False, resident: int = 0
) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_stages, columns a program writes), from the sweeps in
    bench/bench_decode_chain.py (H200, Llama-3-8B's shapes): 32 columns and K in 512s where N
    is at most 4096 (o_proj, down_proj: 128 programs, each with much in flight), 64 columns
    and K in 256s or 128s for wider ones (qkv, gate_up, the LM head). A shard too narrow to
    give each multiprocessor a third of a program's columns is left to cuBLAS, which splits K.

    gate/up (gated) writes fewer columns than its tile where that makes one wave of the
    `resident` programs a multiprocessor holds at once (4 on an H200; 0: unknown, whole
    tiles): Llama-3-8B's 14336 in 512 programs of 28, not 448 of 32 (the tile's other rows
    masked off), 0.01-0.03 ms a step faster in the chain; 531 or more programs (a second
    wave) were slower."""
    block_n = 32 if n <= 4096 else 64
    if triton.cdiv(n, block_n) < multiprocessors // 3:
        return None
    preferred = 512 if n <= 4096 else 256 if n <= 8192 else 128
    block_k = next((b for b in (preferred, 256, 128, 64) if b <= preferred and k % b == 0), None)
    if block_k is None or (gated and n % 2):
        return None
    stages = 4 if block_k >= 256 else 3
    if not gated:
        return block_n, block_k, stages, block_n
    # the same rows in flight per program, half of them gate rows, half up rows
    block_n //= 2
    cols = triton.cdiv(n // 2, max(1, resident * multiprocessors))
    return block_n, block_k, stages, cols if resident and block_n // 2 < cols < block_n else block_n


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: tuple[int, ...],
    activation: str | None = None,
    pdl: bool = True,
    out: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias; with an activation, act(gate) * up of the two halves of weight.
    plan: skinny_plan's, or (BLOCK_N, BLOCK_K, num_stages) writing BLOCK_N columns a program.
    out: [M, N] contiguous, of any float dtype, written instead of a new tensor of x's.
    weight_scale: weight is FP8 (fp8_matmul's format); x's rows are quantised first, once."""
    m, k = x.shape
    n = weight.shape[0] if activation is None else weight.shape[0] // 2
    block_n, block_k, stages = plan[:3]
    cols = plan[3] if len(plan) > 3 else block_n  # at most block_n: the tile's rest masked off
    if out is not None and (out.shape != (m, n) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor, not {tuple(out.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    x_scale = y  # read only if W_FP8
    if weight_scale is not None:  # x's rows in e4m3 once, before the matmul's programs read them
        x, x_scale = quantize_rows(x, pdl=pdl)
    launch = launch_options(x, pdl)
    _skinny_kernel[(triton.cdiv(n, cols),)](
        x, x_scale, weight, weight_scale if weight_scale is not None else y, bias if bias is not None else y, y,
        m, n, x.stride(0), K=k, HAS_BIAS=bias is not None, ACT=0 if activation is None else _ACTIVATION_CODE[activation],
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, COLS=cols, W_FP8=weight_scale is not None,
        PDL=bool(launch), num_warps=4,
        num_stages=stages,
        **launch,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def stream_weights(
        x_ptr, w_rows, up_rows, stride_x, rm, rk, m_ok, n_ok, K: tl.constexpr, GATED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FP8: tl.constexpr = False,
    ):  # fmt: skip
        """(x @ w^T, x @ up^T) [BLOCK_M, BLOCK_N] float32 for one program's weight rows
        (w_rows, and up_rows when GATED: pointers [BLOCK_N, 1]), read once over all of K
        (K % BLOCK_K == 0) against x's rows padded to BLOCK_M (masked; x stays in L2).

        W_FP8: x and w hold e4m3 values (quantize_rows' and fp8_matmul's formats: the caller
        multiplies by both scales), converted to float16 exactly, so the products are exact
        and their sums float32."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok, other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            if W_FP8:  # to float16, exact for e4m3 and one conversion instruction (bfloat16 takes more)
                x, w = x.to(tl.float16), w.to(tl.float16)
            acc += tl.dot(x, tl.trans(w))
            if GATED:
                w_up = tl.load(up_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
                if W_FP8:
                    w_up = w_up.to(tl.float16)
                acc_up += tl.dot(x, tl.trans(w_up))
        return acc, acc_up

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, out_ptr, scale_ptr, stride_x, K, BLOCK: tl.constexpr, PDL: tl.constexpr = False
    ):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * K + cols, q.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _silu_mul_quantize_kernel(x_ptr, out_ptr, scale_ptr, stride_x, half, BLOCK: tl.constexpr):
        # elementwise._silu_mul_kernel's values (act and product rounded to x's dtype), then
        # _quantize_rows_kernel's arithmetic on them: one program holds its row's I values
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + half + cols, mask=ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
        amax = tl.max(tl.abs(y), 0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * half + cols, q.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def gated_activation(gate_acc, up_acc, dt: tl.constexpr, ACT: tl.constexpr):
        """act(gate) * up in float32 (ACT 1: silu, 2: gelu with tanh), rounded to dt where HF
        rounds: each projection, the activation, the product (the caller's store)."""
        gate = gate_acc.to(dt).to(tl.float32)
        if ACT == 1:
            act = gate / (1.0 + tl.exp(-gate))
        else:  # 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (1 + e^(2u))
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner)))
        return act.to(dt).to(tl.float32) * up_acc.to(dt).to(tl.float32)

    @triton.jit
    def _skinny_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, M, N, stride_x, K: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr,  # 0: y = x @ w^T; 1 silu, 2 gelu (tanh): y = act(x @ gate^T) * x @ up^T
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr,
        W_FP8: tl.constexpr = False,  # x and w in e4m3, a float32 scale per row of each (fp8_matmul's format)
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # y[M, N] = x[M, K] @ w[N, K]^T: program p owns columns p * COLS .. + COLS (COLS <=
        # BLOCK_N, the tile's other rows masked off), its [BLOCK_N, BLOCK_K] tiles of w
        # pipelined over K. With ACT, w is [2N, K]: the program also reads the up rows N + its
        # columns.
        pid = tl.program_id(0)
        rn = pid * COLS + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm[:, None] < M
        n_ok = rn < N
        if COLS < BLOCK_N:
            n_ok = n_ok & (tl.arange(0, BLOCK_N) < COLS)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # int64: the LM head passes 2^31 elements
        wait_for_previous(PDL)
        dt = x_ptr.dtype.element_ty
        if W_FP8:  # x holds e4m3: the activations' dtype is y's
            dt = y_ptr.dtype.element_ty
        acc, acc_up = stream_weights(
            x_ptr, w_rows, w_rows + N * K, stride_x, rm, tl.arange(0, BLOCK_K), m_ok, n_ok, K, ACT != 0,
            BLOCK_M, BLOCK_N, BLOCK_K, W_FP8,
        )  # fmt: skip
        if W_FP8:  # the sums of quantised products times both scales
            x_scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=1.0)
            acc = acc * x_scale[:, None] * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
            if ACT != 0:
                acc_up = (
                    acc_up * x_scale[:, None] * tl.load(w_scale_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
                )
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc = gated_activation(acc, acc_up, dt, ACT)
        # Rounded to x's dtype whatever y's (float32 logits hold the bfloat16 values).
        y = acc.to(dt).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=m_ok & n_ok[None, :])

    @triton.jit
    def _qkv_rope_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, k_cache, v_cache, slots_ptr,
        k_scale_ptr, v_scale_ptr, M, stride_x, stride_cos, stride_sin, stride_kc, stride_kc_head, stride_vc,
        stride_vc_head, K: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, W_FP8: tl.constexpr,
        NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # Program p: head h = p // (D / 2 / BLOCK_N) of the q, k, v heads stacked in w, and
        # within it columns j = rj and j + D/2 (rj: BLOCK_N of the first half).
        HALF: tl.constexpr = HEAD_DIM // 2
        pid = tl.program_id(0)
        head = pid // (HALF // BLOCK_N)
        rj = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = head * HEAD_DIM + rj
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm[:, None] < M
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        wait_for_previous(PDL)
        dt = q_ptr.dtype.element_ty
        acc, acc_up = stream_weights(
            x_ptr, w_rows, w_rows + HALF * K, stride_x, rm, tl.arange(0, BLOCK_K), m_ok, rj < HALF, K, True,
            BLOCK_M, BLOCK_N, BLOCK_K, W_FP8,
        )  # fmt: skip
        if W_FP8:  # the sums of quantised products times both scales
            x_scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=1.0)
            acc = acc * x_scale[:, None] * tl.load(w_scale_ptr + rows)[None, :]
            acc_up = acc_up * x_scale[:, None] * tl.load(w_scale_ptr + rows + HALF)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
            acc_up += tl.load(b_ptr + rows + HALF).to(tl.float32)[None, :]
        # F.linear's output (x1: first-half columns, x2: their partners), rounded to x's dtype
        x1, x2 = acc.to(dt), acc_up.to(dt)
        if head < NUM_Q + NUM_KV:
            # HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to x's
            # dtype (kernels._rotate_heads); both halves of cos and sin are equal
            c = tl.load(cos_ptr + rm[:, None] * stride_cos + rj[None, :], mask=m_ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + rm[:, None] * stride_sin + rj[None, :], mask=m_ok, other=0.0).to(tl.float32)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            x1 = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)).to(dt)
            x2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
        if head < NUM_Q:
            out = q_ptr + rm[:, None] * (NUM_Q * HEAD_DIM) + head * HEAD_DIM + rj[None, :]
        elif head < NUM_Q + NUM_KV:
            out = k_ptr + rm[:, None] * (NUM_KV * HEAD_DIM) + (head - NUM_Q) * HEAD_DIM + rj[None, :]
        else:
            out = v_ptr + rm[:, None] * (NUM_KV * HEAD_DIM) + (head - NUM_Q - NUM_KV) * HEAD_DIM + rj[None, :]
        tl.store(out, x1, mask=m_ok)
        tl.store(out + HALF, x2, mask=m_ok)
        if head >= NUM_Q:  # k or v: also to this token's cache slot
            slot = tl.load(slots_ptr + rm, mask=rm < M, other=0).to(tl.int64)[:, None]
            if head < NUM_Q + NUM_KV:
                cached = k_cache + slot * stride_kc + (head - NUM_Q) * stride_kc_head + rj[None, :]
                scale_ptr = k_scale_ptr + head - NUM_Q
            else:
                cached = v_cache + slot * stride_vc + (head - NUM_Q - NUM_KV) * stride_vc_head + rj[None, :]
                scale_ptr = v_scale_ptr + head - NUM_Q - NUM_KV
            # as the cache stores them; each branch one dtype (head is known only at run time)
            c1, c2 = x1.to(k_cache.dtype.element_ty), x2.to(k_cache.dtype.element_ty)
            if QUANT:  # an FP8 cache: e4m3 of x / the head's scale, saturated (kernels/kv_quant.py)
                scale = tl.load(scale_ptr)
                c1 = tl.clamp(tl.math.div_rn(x1.to(tl.float32), scale), -FP8_MAX, FP8_MAX).to(
                    k_cache.dtype.element_ty
                )
                c2 = tl.clamp(tl.math.div_rn(x2.to(tl.float32), scale), -FP8_MAX, FP8_MAX).to(
                    k_cache.dtype.element_ty
                )
            tl.store(cached, c1, mask=m_ok)
            tl.store(cached + HALF, c2, mask=m_ok)
