"""Where a small ring step's time goes: host and device time of each dense call.

  python bench/bench_ring_calls.py [--chunks-only]

For the distinct block shapes of a zigzag prefill (8K and 16K tokens over CP4 and CP8,
Llama-3-8B heads), the host time to enqueue one call and its device time, for cuDNN and
for the flash kernel, and the same for the LSE merge of N parts (Triton and torch); and a
prefill chunk after a cached prefix, flash varlen against cuDNN's bottom-right causal call.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_ring import NH, NKV, D, ring_step_for  # noqa: E402
from common import event_time_ms, machine_info, write_json  # noqa: E402

from ringserve.attention.dense import dense_block  # noqa: E402
from ringserve.kernels import lse_merge  # noqa: E402


def host_us(fn, reps: int = 50) -> float:
    """Mean host time to enqueue fn(), with the device kept busy so enqueueing never waits."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return host


def flash_block(q, k, v, causal: bool):
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], 0.0, causal, False, scale=D**-0.5
    )[:2]


def profile_ring(tokens: int, n: int) -> None:
    """Kernel and op times of one whole ring (all ranks' steps and merges), by the profiler."""
    from bench_ring import ring_inputs, step_fn
    from torch.profiler import ProfilerActivity, profile

    step = ring_step_for(tokens, n)
    qs, ks, vs = ring_inputs(step, "cuda")
    steps = [step_fn(step, qs, ks, vs, r, (r - j) % n) for r in range(n) for j in range(n)]

    def whole_ring():
        for r in range(n):
            parts = [steps[r * n + j]() for j in range(n)]
            lse_merge.merge_partials(
                [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], len(qs[r])
            )

    for _ in range(3):
        whole_ring()
    torch.cuda.synchronize()
    start = time.perf_counter()
    whole_ring()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        whole_ring()
        torch.cuda.synchronize()
    print(f"\n== {tokens} tokens, CP{n}: host {host * 1e3:.2f} ms to enqueue, {wall * 1e3:.2f} ms to finish")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


def chunk_after_prefix() -> list[dict]:
    """A prefill chunk after its cached prefix (chunked prefill, a follow-up turn): one flash
    varlen call against per-sequence cuDNN calls with the bottom-right causal mask."""
    from ringserve.attention.dense import (
        VarlenBatch,
        _cudnn_per_sequence,
        _flash_varlen,
    )

    rows = []
    for chunk, prefix in ((2048, 6144), (8192, 24576), (16384, 114688)):
        total = chunk + prefix
        q = torch.randn(chunk, NH, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, NKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu_q, cu_k = [0, chunk], [0, total]
        batch = VarlenBatch(
            torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
            torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
            chunk,
            total,
            torch.arange(prefix, total, device="cuda"),
            torch.arange(total, device="cuda"),
            True,
            cu_q,
            cu_k,
        )
        args = (q, k, v, batch, cu_q, cu_k)
        row = {
            "chunk": chunk,
            "prefix": prefix,
            "flash_ms": event_time_ms(lambda a=args: _flash_varlen(a[0], a[1], a[2], a[3], D**-0.5)),
        }
        row["cudnn_ms"] = event_time_ms(
            lambda a=args: _cudnn_per_sequence(a[0], a[1], a[2], a[4], a[5], D**-0.5)
        )
        whole = torch.randn(total, NH, D, device="cuda", dtype=torch.bfloat16)
        row["cudnn_whole_context_ms"] = event_time_ms(
            lambda w=whole, a=args: dense_block(w, a[1], a[2], True, D**-0.5)
        )
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    info = machine_info()
    print(info)
    if "--chunks-only" in sys.argv:
        write_json("bench_chunks.json", {"machine": info, "rows": chunk_after_prefix()})
        return
    for tokens, n in ((8192, 4), (8192, 8), (16384, 4)):
        profile_ring(tokens, n)
    rows = []
    seen = set()
    for tokens in (8192, 16384):
        for n in (4, 8):
            step = ring_step_for(tokens, n)
            for r in range(n):
                for j in range(n):
                    plan = step.varlen(r, j, "cpu").plan()
                    for group in plan.groups:
                        for b in group:
                            shape = (b.q1 - b.q0, b.k1 - b.k0, b.causal)
                            if shape in seen:
                                continue
                            seen.add(shape)
                            q = torch.randn(shape[0], NH, D, device="cuda", dtype=torch.bfloat16)
                            k = torch.randn(shape[1], NKV, D, device="cuda", dtype=torch.bfloat16)
                            v = torch.randn_like(k)
                            row = {
                                "tokens": tokens,
                                "cp": n,
                                "q": shape[0],
                                "k": shape[1],
                                "causal": shape[2],
                            }
                            for name, fn in (
                                (
                                    "cudnn",
                                    lambda q=q, k=k, v=v, c=shape[2]: dense_block(q, k, v, c, D**-0.5),
                                ),
                                ("flash", lambda q=q, k=k, v=v, c=shape[2]: flash_block(q, k, v, c)),
                            ):
                                row[f"{name}_device_us"] = event_time_ms(fn, warmup=3, reps=20) * 1000
                                row[f"{name}_host_us"] = host_us(fn)
                            rows.append(row)
                            print(row, flush=True)
    for parts, tokens in ((4, 2048), (8, 1024), (4, 4096), (8, 2048)):
        outs = [torch.randn(tokens, NH, D, device="cuda", dtype=torch.bfloat16) for _ in range(parts)]
        lses = [torch.randn(tokens, NH, device="cuda") for _ in range(parts)]
        row = {"merge_parts": parts, "tokens": tokens}
        for name, fn in (
            ("triton", lambda outs=outs, lses=lses: lse_merge.merge_partials(outs, lses)),
            ("torch", lambda outs=outs, lses=lses: lse_merge._merge_torch(outs, lses)),
        ):
            row[f"{name}_device_us"] = event_time_ms(fn, warmup=3, reps=20) * 1000
            row[f"{name}_host_us"] = host_us(fn)
        rows.append(row)
        print(row, flush=True)
    # Small elementwise ops, for scale: what a launch costs on this host.
    x = torch.empty(1024, 32, 128, device="cuda", dtype=torch.bfloat16)
    print(
        {
            "zero_fill_host_us": host_us(lambda: x.zero_()),
            "empty_host_us": host_us(lambda: torch.empty_like(x)),
        }
    )
    write_json("bench_ring_calls.json", {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
