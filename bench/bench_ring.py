"""Issue 4's one-GPU figures: the ring's attention path against cuDNN, and a model of the ring.

  python bench/bench_ring.py [--kernels-only]    # writes $OUT/bench_ring.json, prints two tables

1. Kernel efficiency: for 8K..128K tokens (Llama-3-8B heads: 32 query, 8 KV, dim 128, bf16),
   all N x N ring steps of a zigzag prefill over N = 2, 4, 8 ranks, each through the engine's attention op
   (`attention_rows` on each rank's share, with LSE, plus the merge), timed back to back on
   one GPU, against one cuDNN causal call over the whole sequence: the same useful work.
2. Ring model: for N = 2, 4, 8 and 128K..1M tokens, each rank's N partial-attention steps
   timed in turn (one layer); load balance = slowest rank / mean per step; the TTFT predicted
   for N GPUs = 32 layers x sum over steps of max(slowest rank's attention, KV transfer at
   the NVLink rate) + the linear layers' FLOPs over N at the measured matmul rate.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import event_time_ms, machine_info, measure_ceilings, write_json  # noqa: E402

from ringserve.attention.dense import attention_rows, dense_block  # noqa: E402
from ringserve.engine.block_manager import BlockManager  # noqa: E402
from ringserve.engine.sequence import Sequence  # noqa: E402
from ringserve.kernels.lse_merge import merge_partials  # noqa: E402
from ringserve.parallel.cp.plan import RingStep  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402

NH, NKV, D, LAYERS = 32, 8, 128, 32
LINEAR_PARAMS = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)  # Llama-3-8B body
NVLINK_BYTES_PER_S = 450e9  # H200 NVLink, one direction (a lead; issue 6 measures it)
BLOCK = 256


def ring_step_for(tokens: int, n: int) -> RingStep:
    """A whole prompt's step over n ranks, placed by the engine's block manager and CP layout."""
    manager = BlockManager(-(-tokens // BLOCK) * n, BLOCK, False, n)  # ample room on every rank
    seq = Sequence("0", [0] * tokens, SamplingParams())
    seq.row = 0
    assert manager.allocate(seq, tokens)
    return RingStep(manager.layout.step([seq], [tokens]), [tokens], n)


def ring_inputs(step: RingStep, device):
    g = torch.Generator(device=device).manual_seed(0)
    ranks = range(step.num_ranks)
    qs = [
        torch.randn(step.num_queries(r), NH, D, device=device, dtype=torch.bfloat16, generator=g)
        for r in ranks
    ]
    ks = [
        torch.randn(step.num_keys(r), NKV, D, device=device, dtype=torch.bfloat16, generator=g) for r in ranks
    ]
    vs = [
        torch.randn(step.num_keys(r), NKV, D, device=device, dtype=torch.bfloat16, generator=g) for r in ranks
    ]
    return qs, ks, vs


def step_fn(step: RingStep, qs, ks, vs, rank, src):
    batch = step.varlen(rank, src, "cuda")
    return lambda: attention_rows(qs[rank], ks[src], vs[src], batch, D**-0.5)


def kernel_efficiency(tokens: int, cps=(2, 4, 8)) -> list[dict]:
    causal_flops = 2 * tokens * tokens * NH * D  # 4 * (T^2 / 2) * NH * D: useful causal work
    q = torch.randn(tokens, NH, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, NKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, NKV, D, device="cuda", dtype=torch.bfloat16)
    cudnn_ms = event_time_ms(lambda: dense_block(q, k, v, True, D**-0.5), warmup=2, reps=5)
    rows = []
    for n in cps:
        step = ring_step_for(tokens, n)
        qs, ks, vs = ring_inputs(step, "cuda")
        steps = [step_fn(step, qs, ks, vs, r, (r - j) % n) for r in range(n) for j in range(n)]
        calls = sum(
            len(g) for r in range(n) for j in range(n) for g in step.varlen(r, j, "cpu").plan().groups
        )

        def whole_ring(steps=steps, n=n, qs=qs):
            for r in range(n):
                parts = [steps[r * n + j]() for j in range(n)]
                merge_partials(
                    [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], len(qs[r])
                )

        ring_ms = event_time_ms(whole_ring, warmup=2, reps=5)
        rows.append(
            {
                "tokens": tokens,
                "cp": n,
                "dense_calls": calls,
                "cudnn_causal_ms": cudnn_ms,
                "ring_ms": ring_ms,
                "cudnn_tflops": causal_flops / cudnn_ms / 1e9,
                "ring_tflops": causal_flops / ring_ms / 1e9,
                "ring_over_cudnn": cudnn_ms / ring_ms,
            }
        )
    return rows


def ring_model(tokens: int, n: int, matmul_flops: float) -> dict:
    step = ring_step_for(tokens, n)
    qs, ks, vs = ring_inputs(step, "cuda")
    # step_ms[j][r]: rank r's attention at ring step j (KV from rank r - j)
    step_ms = [
        [event_time_ms(step_fn(step, qs, ks, vs, r, (r - j) % n), warmup=1, reps=2) for r in range(n)]
        for j in range(n)
    ]
    kv_bytes = max(step.num_keys(r) for r in range(n)) * 2 * NKV * D * 2
    transfer_ms = kv_bytes / NVLINK_BYTES_PER_S * 1000
    per_layer = sum(max(max(row), transfer_ms if j + 1 < n else 0.0) for j, row in enumerate(step_ms))
    rank_totals = [sum(step_ms[j][r] for j in range(n)) for r in range(n)]
    balance = max(max(row) / (sum(row) / n) for row in step_ms)
    linear_ms = 2 * LINEAR_PARAMS * tokens / n / matmul_flops * 1000
    return {
        "tokens": tokens,
        "cp": n,
        "attention_ms_per_layer": per_layer,
        "transfer_ms_per_step": transfer_ms,
        "load_balance_worst_step": balance,
        "rank_totals_ms": rank_totals,
        "predicted_ttft_s": (LAYERS * per_layer + linear_ms) / 1000,
    }


def main():
    info = machine_info()
    ceilings = measure_ceilings()
    print(info, f"matmul {ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    kernels = []
    print(
        f"{'tokens':>8s} {'cp':>3s} {'calls':>6s} {'cuDNN causal':>13s} {'ring path':>10s} {'TFLOP/s cuDNN':>14s} "
        f"{'ring':>6s} {'ratio':>6s}"
    )
    for tokens in (8192, 16384, 32768, 65536, 131072):
        for row in kernel_efficiency(tokens):
            kernels.append(row)
            print(
                f"{tokens:8d} {row['cp']:3d} {row['dense_calls']:6d} {row['cudnn_causal_ms']:11.2f}ms "
                f"{row['ring_ms']:8.2f}ms {row['cudnn_tflops']:14.0f} {row['ring_tflops']:6.0f} "
                f"{row['ring_over_cudnn']:6.2f}",
                flush=True,
            )
    if "--kernels-only" in sys.argv:
        write_json("bench_ring.json", {"machine": info, "ceilings": ceilings, "kernels": kernels})
        return
    models = []
    print(
        f"\n{'tokens':>8s} {'cp':>3s} {'attn/layer':>11s} {'xfer/step':>10s} {'balance':>8s} {'TTFT (pred)':>12s}"
    )
    for n in (2, 4, 8):
        for tokens in (131072, 262144, 524288, 1048576):
            row = ring_model(tokens, n, ceilings["bf16_matmul_flops"])
            models.append(row)
            print(
                f"{tokens:8d} {n:3d} {row['attention_ms_per_layer']:9.1f}ms {row['transfer_ms_per_step']:8.2f}ms "
                f"{row['load_balance_worst_step']:8.3f} {row['predicted_ttft_s']:10.2f} s",
                flush=True,
            )
            torch.cuda.empty_cache()
    write_json(
        "bench_ring.json", {"machine": info, "ceilings": ceilings, "kernels": kernels, "ring_model": models}
    )


if __name__ == "__main__":
    main()
