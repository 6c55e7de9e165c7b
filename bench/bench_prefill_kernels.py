"""Prefill attention kernels with no per-shape cost (issue 26, item 1), on one GPU with
Llama-3-8B's heads (32 query heads, 8 KV heads, 128 dims, bf16):

- first calls: raw cuDNN at new lengths (the plan build), then `dense_block` (bounded
  shapes) at many distinct lengths: first-call time and how many shapes cuDNN saw;
- causal prompts: cuDNN against the flash kernel, TFLOP/s by length;
- chunks after a cached prefix: the paged Triton kernel (in place) against gathering the
  prefix and running `dense_per_sequence` (cuDNN at bounded shapes), by chunk and prefix;
- correctness: `dense_block` against float32 math at odd lengths, gathered against paged.

  PYTHONPATH=. python bench/bench_prefill_kernels.py   # JSON in $OUT/prefill_kernels.json
"""

from __future__ import annotations

import random
from functools import partial

import torch

from bench.common import event_time_ms, gpu_state, machine_info, wall_ms, write_json
from ringserve.attention import dense as attention
from ringserve.attention.dense import dense_block, dense_block_math, dense_per_sequence
from ringserve.attention.paged import PagedBatch, gather_plan, paged_attention, tile_queries

NH, NKV, D = 32, 8, 128
SCALE = D**-0.5
DEV = "cuda"


def rand(n, heads):
    return torch.randn(n, heads, D, device=DEV, dtype=torch.bfloat16)


def causal_flops(n: int) -> float:
    return 4 * NH * D * n * n / 2


def first_calls(data: dict) -> None:
    rows = []
    for n in (1000, 1037, 3001, 8111):  # raw cuDNN: a plan per new length
        q, k, v = rand(n, NH), rand(n, NKV), rand(n, NKV)
        call = partial(attention._cudnn_block, q, k, v, True, SCALE)
        first, again = wall_ms(call), wall_ms(call)
        rows.append({"kernel": "cudnn raw", "len": n, "first_ms": first, "again_ms": again})
        print(f"cudnn raw L={n}: first {first:.2f} ms, again {again:.3f} ms", flush=True)
    seen = set()
    real = attention._cudnn_block

    def counting(q, k, v, causal, scale):
        seen.add((q.shape[0], k.shape[0], causal))
        return real(q, k, v, causal, scale)

    attention._cudnn_block = counting
    rng = random.Random(0)
    lengths = sorted(rng.randrange(900, 40_000) for _ in range(60))
    firsts = []
    for n in lengths:
        q, k, v = rand(n, NH), rand(n, NKV), rand(n, NKV)
        call = partial(dense_block, q, k, v, True, SCALE)
        firsts.append(wall_ms(call))
        again = wall_ms(call)
        rows.append({"kernel": "dense_block", "len": n, "first_ms": firsts[-1], "again_ms": again})
    attention._cudnn_block = real
    data["first_calls"] = rows
    data["distinct_lengths"] = len(set(lengths))
    data["cudnn_shapes"] = len(seen)
    print(
        f"dense_block at {len(set(lengths))} distinct lengths 900-40K: cuDNN saw {len(seen)} shapes; "
        f"first calls median {sorted(firsts)[len(firsts) // 2]:.2f} ms, max {max(firsts):.1f} ms",
        flush=True,
    )


def causal_speed(data: dict) -> None:
    rows = []
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        q, k, v = rand(n, NH), rand(n, NKV), rand(n, NKV)
        row = {"len": n}
        for name, fn in (("cudnn", attention._cudnn_block), ("flash", attention._flash_block)):
            ms = event_time_ms(partial(fn, q, k, v, True, SCALE), warmup=2, reps=10)
            row[name + "_ms"] = ms
            row[name + "_tflops"] = causal_flops(n) / ms / 1e9
        rows.append(row)
        print(
            f"causal L={n}: cudnn {row['cudnn_ms']:.3f} ms ({row['cudnn_tflops']:.0f} TF/s), "
            f"flash {row['flash_ms']:.3f} ms ({row['flash_tflops']:.0f} TF/s)",
            flush=True,
        )
    data["causal"] = rows


def paged_setup(lq: int, prefix: int, block_size: int = 16):
    n = prefix + lq
    blocks = -(-n // block_size)
    table = torch.randperm(blocks + 8, device=DEV, dtype=torch.int64)[:blocks].to(torch.int32)[None, :]
    k_cache = rand((blocks + 8) * block_size, NKV)
    v_cache = rand((blocks + 8) * block_size, NKV)
    qpt = tile_queries(NH, NKV, False)
    tile_q0 = list(range(0, lq, qpt))
    i32 = dict(dtype=torch.int32, device=DEV)
    batch = PagedBatch(
        torch.zeros(1, **i32), torch.tensor([0, lq], **i32), torch.tensor([n], **i32),
        torch.zeros(len(tile_q0), **i32), torch.tensor(tile_q0, **i32), qpt, 1, [0, lq], [n], [0],
    )  # fmt: skip
    return rand(lq, NH), k_cache, v_cache, table, batch


def paged_chunk(q, k_cache, v_cache, table, batch):
    return paged_attention(q, k_cache, v_cache, table, batch, 16, SCALE)


def gathered_chunk(q, k_cache, v_cache, table, batch):
    slots, varlen = gather_plan(table, batch, 16, attention.FULL_ATTENTION, DEV)
    k, v = k_cache[slots], v_cache[slots]
    return dense_per_sequence(q, k, v, varlen.q_bounds, varlen.k_bounds, SCALE)


def chunk_speed(data: dict) -> None:
    rows = []
    for lq in (512, 2048, 8192, 16384):
        for prefix in (4096, 32768, 122880):
            setup = paged_setup(lq, prefix)
            flops = 4 * NH * D * lq * (prefix + lq / 2)
            paged, gathered = partial(paged_chunk, *setup), partial(gathered_chunk, *setup)
            ref, _ = paged()
            got, _ = gathered()
            err = (ref.float() - got.float()).abs().max().item()
            row = {"lq": lq, "prefix": prefix, "max_abs_diff": err}
            for name, fn in (("paged", paged), ("gathered", gathered)):
                ms = event_time_ms(fn, warmup=2, reps=5)
                row[name + "_ms"] = ms
                row[name + "_tflops"] = flops / ms / 1e9
            rows.append(row)
            print(
                f"chunk {lq} after {prefix}: paged {row['paged_ms']:.2f} ms ({row['paged_tflops']:.0f} TF/s), "
                f"gathered {row['gathered_ms']:.2f} ms ({row['gathered_tflops']:.0f} TF/s), diff {err:.2e}",
                flush=True,
            )
    data["chunks"] = rows


def correctness(data: dict) -> None:
    rows = []
    for lq, lk, causal in ((2049, 2049, True), (3001, 3001, True), (2500, 7001, False), (4100, 2300, False)):
        q, k, v = rand(lq, NH), rand(lk, NKV), rand(lk, NKV)
        out, lse = dense_block(q, k, v, causal, SCALE)
        ref, ref_lse = dense_block_math(q, k, v, causal, SCALE)
        rows.append(
            {
                "lq": lq, "lk": lk, "causal": causal,
                "out_err": (out.float() - ref.float()).abs().max().item(),
                "lse_err": (lse - ref_lse).abs().max().item(),
            }
        )  # fmt: skip
        print("correctness", rows[-1], flush=True)
    data["correctness"] = rows


def main() -> None:
    data = {"machine": machine_info(), "gpu_state": gpu_state()}
    print(data["machine"], data["gpu_state"], flush=True)
    torch.manual_seed(0)
    for part in (first_calls, correctness, causal_speed, chunk_speed):
        part(data)
        write_json("prefill_kernels.json", data)


if __name__ == "__main__":
    main()
