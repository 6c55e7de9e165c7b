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

Everywhere else (the CPU, float32, more rows, shards too narrow to fill the GPU, K that no
block divides) `linear` is F.linear and `gated_linear` F.linear and the activation kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.kernels import gelu_tanh_mul, silu_mul
from ringserve.pdl import launch_options

try:
    import triton
    import triton.language as tl

    from ringserve.pdl import wait_for_previous
except ImportError:  # CPU builds of torch come without Triton
    triton = None

MAX_ROWS = 16  # decode batches up to here; the dot's tile has 16 rows either way
_HALF = (torch.bfloat16, torch.float16)
# act(gate) * up of a [M, 2I] gate/up output, by the config's hidden_act; and the kernel's
# code for the same activation in its epilogue.
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
_ACTIVATION_CODE = {"silu": 1, "gelu_pytorch_tanh": 2}


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), x [M, K], weight [N, K]; the skinny kernel where it pays
    (pdl: launched with programmatic dependent launch where the GPU has it, ringserve.pdl).
    out: a contiguous [M, N] tensor (float32 for the LM head's logits) to write the result
    into, rounded to x's dtype first, as F.linear(...).to(out.dtype) would be."""
    plan = skinny_plan(x, weight)
    if plan is None:
        y = F.linear(x, weight, bias)
        return y if out is None else out.copy_(y)
    return skinny_linear(x, weight, bias, plan, pdl=pdl, out=out)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, activation: str, pdl: bool = True) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) [M, I] for weight [2I, K] (gate rows, then up rows), as HF's
    `act_fn(gate_proj(x)) * up_proj(x)`: each matmul's and the activation's result rounded to
    x's dtype before the product."""
    plan = skinny_plan(x, weight, gated=True)
    if plan is None:
        return GATED_ACTIVATIONS[activation](F.linear(x, weight))
    return skinny_linear(x, weight, None, plan, activation, pdl=pdl)


def skinny_plan(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_stages) where the skinny kernel runs x @ weight^T, else None.
    gated: BLOCK_N counts the output's columns, each of which reads a gate and an up row."""
    if triton is None or not x.is_cuda or x.dtype not in _HALF or weight.dtype != x.dtype:
        return None
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0 or x.stride(-1) != 1:
        return None
    if not weight.is_contiguous():
        return None
    n, k = weight.shape
    return _plan(n, k, _multiprocessors(x.device.index), gated)


def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count  # cached by torch


def _plan(n: int, k: int, multiprocessors: int, gated: bool = False) -> tuple[int, int, int] | None:
    """Tiles from the sweep in bench/bench_decode_chain.py (H200, Llama-3-8B's shapes):
    32 columns and K in 512s where N is at most 4096 (o_proj, down_proj: 128 programs, each
    with much in flight), 64 columns and K in 256s or 128s for wider ones (qkv, gate_up,
    the LM head). A shard too narrow to give each multiprocessor a third of a program's
    columns is left to cuBLAS, which splits K."""
    block_n = 32 if n <= 4096 else 64
    if triton.cdiv(n, block_n) < multiprocessors // 3:
        return None
    preferred = 512 if n <= 4096 else 256 if n <= 8192 else 128
    block_k = next((b for b in (preferred, 256, 128, 64) if b <= preferred and k % b == 0), None)
    if block_k is None or (gated and n % 2):
        return None
    # gated: the same rows in flight per program, half of them gate rows, half up rows
    return block_n // 2 if gated else block_n, block_k, 4 if block_k >= 256 else 3


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: tuple[int, int, int],
    activation: str | None = None,
    pdl: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias; with an activation, act(gate) * up of the two halves of weight.
    out: [M, N] contiguous, of any float dtype, written instead of a new tensor of x's."""
    m, k = x.shape
    n = weight.shape[0] if activation is None else weight.shape[0] // 2
    block_n, block_k, stages = plan
    if out is not None and (out.shape != (m, n) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor, not {tuple(out.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    launch = launch_options(x, pdl)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, m, n, x.stride(0), K=k, HAS_BIAS=bias is not None,
        ACT=0 if activation is None else _ACTIVATION_CODE[activation],
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PDL=bool(launch), num_warps=4, num_stages=stages,
        **launch,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def stream_weights(
        x_ptr, w_rows, up_rows, stride_x, rm, rk, m_ok, n_ok, K: tl.constexpr, GATED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """(x @ w^T, x @ up^T) [BLOCK_M, BLOCK_N] float32 for one program's weight rows
        (w_rows, and up_rows when GATED: pointers [BLOCK_N, 1]), read once over all of K
        (K % BLOCK_K == 0) against x's rows padded to BLOCK_M (masked; x stays in L2)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok, other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
            if GATED:
                w_up = tl.load(up_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
                acc_up += tl.dot(x, tl.trans(w_up))
        return acc, acc_up

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
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, K: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr,  # 0: y = x @ w^T; 1 silu, 2 gelu (tanh): y = act(x @ gate^T) * x @ up^T
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # y[M, N] = x[M, K] @ w[N, K]^T: program p owns columns p * BLOCK_N .., its [BLOCK_N,
        # BLOCK_K] tiles of w pipelined over K. With ACT, w is [2N, K]: the program also
        # reads the up rows N + its columns.
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm[:, None] < M
        n_ok = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # int64: the LM head passes 2^31 elements
        wait_for_previous(PDL)
        acc, acc_up = stream_weights(
            x_ptr, w_rows, w_rows + N * K, stride_x, rm, tl.arange(0, BLOCK_K), m_ok, n_ok, K, ACT != 0,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dt = x_ptr.dtype.element_ty
        if ACT != 0:
            acc = gated_activation(acc, acc_up, dt, ACT)
        # Rounded to x's dtype whatever y's (float32 logits hold the bfloat16 values).
        y = acc.to(dt).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=m_ok & n_ok[None, :])
