"""Decode's weight matmuls: y = x @ W^T + b for a few rows of x (a decode batch of at most
`MAX_ROWS`), as one Triton program per BLOCK_N output columns that streams its rows of W
once over all of K.

Why our own: at decode a matmul is a read of W, and what a step costs is how close each one
comes to the memory's bandwidth. cuBLAS tiles these shapes for larger M; on an H200 it
reads Llama-3-8B's o_proj (4096 x 4096) at ~3.0 TB/s and down_proj with a split-K reduce
kernel after it. Measured inside a CUDA graph of the 32 layers' matmuls
(bench/bench_decode_chain.py), this kernel takes the chain from 4.30 to 4.06 ms at batch 1,
and the engine's whole decode step from 4.80 to 4.44-4.51 ms (BENCHMARKS.md).

Everywhere else (the CPU, float32, more rows, shards too narrow to fill the GPU, K that no
block divides) `linear` is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

MAX_ROWS = 16  # decode batches up to here; the dot's tile has 16 rows either way
_HALF = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), x [M, K], weight [N, K]; the skinny kernel where it pays."""
    plan = skinny_plan(x, weight)
    if plan is None:
        return F.linear(x, weight, bias)
    return skinny_linear(x, weight, bias, plan)


def skinny_plan(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_stages) where the skinny kernel runs x @ weight^T, else None."""
    if triton is None or not x.is_cuda or x.dtype not in _HALF or weight.dtype != x.dtype:
        return None
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0 or x.stride(-1) != 1:
        return None
    if not weight.is_contiguous():
        return None
    n, k = weight.shape
    return _plan(n, k, _multiprocessors(x.device.index))


def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count  # cached by torch


def _plan(n: int, k: int, multiprocessors: int) -> tuple[int, int, int] | None:
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
    if block_k is None:
        return None
    return block_n, block_k, 4 if block_k >= 256 else 3


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: tuple[int, int, int]
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, stages = plan
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, m, n, x.stride(0), K=k, HAS_BIAS=bias is not None,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, K: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # y[M, N] = x[M, K] @ w[N, K]^T: program p owns columns p * BLOCK_N ..; its [BLOCK_N,
        # BLOCK_K] tiles of w are read once, pipelined over K (a constexpr: K % BLOCK_K == 0),
        # against x's rows padded to BLOCK_M (masked loads; x is tiny and stays in L2).
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        n_ok = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # int64: the LM head passes 2^31 elements
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok, other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok[None, :]
        )
