"""Decode's weight matmuls at batch 1 and 16: cuBLAS (torch.matmul) against a Triton
skinny-GEMM sweep, for Llama-3-8B's shapes, to see whether a kernel of our own would pay
before writing one into the model (profile: qkv and o_proj run at ~3.1 TB/s, gate_up and
down at ~4.0, with split-K reduce kernels on top).

  PYTHONPATH=. python bench/bench_gemv.py

Prints per shape and batch: cuBLAS us and TB/s, the best Triton config's, and its error.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    # y[M, N] = x[M, K] @ w[N, K]^T; one program per BLOCK_N output columns, all of K.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def skinny(x, w, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages
    )
    return y


def main():
    shapes = {
        "qkv": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }
    configs = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5)))
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x @ w.t()
            gb = n * k * 2 / 1e9
            t_cublas = triton.testing.do_bench(lambda x=x, w=w: x @ w.t(), warmup=20, rep=100) * 1000
            best = None
            for bn, bk, warps, stages in configs:
                try:
                    y = skinny(x, w, bn, bk, warps, stages)
                    err = (y.float() - ref.float()).abs().max().item()
                    t = (
                        triton.testing.do_bench(
                            lambda c=(x, w, bn, bk, warps, stages): skinny(*c), warmup=10, rep=50
                        )
                        * 1000
                    )
                except Exception as e:  # a config that does not fit in shared memory
                    print(f"  skip {bn},{bk},{warps},{stages}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, (bn, bk, warps, stages), err)
            t, cfg, err = best
            print(
                f"{name:8s} M={m:3d} N={n:6d} K={k:5d}: cuBLAS {t_cublas:7.1f} us {gb / t_cublas * 1e3:5.2f} TB/s | "
                f"triton {t:7.1f} us {gb / t * 1e3:5.2f} TB/s (BLOCK_N, BLOCK_K, warps, stages = {cfg}), max err {err:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
