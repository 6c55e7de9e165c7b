"""The paged decode kernel alone on one GPU: achieved KV bandwidth per launch setting, for
the decode shapes of the figures (Llama-3-8B heads, bf16, 16-token blocks).

  python bench/bench_paged.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ringserve.attention import paged as pa  # noqa: E402

NH, NKV, D, BS = 32, 8, 128, 16
CASES = [(1, 1024), (1, 32768), (1, 131072), (16, 1024), (64, 1024), (16, 8192)]  # (batch, context)


def case(batch: int, context: int):
    blocks = batch * (context // BS)
    k_cache = torch.randn(blocks * BS, NKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device="cuda").int().view(batch, context // BS)
    q = torch.randn(batch, NH, D, device="cuda", dtype=torch.bfloat16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    rows = list(range(batch))
    return q, k_cache, v_cache, tables, rows, i32


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    settings = [
        {"block_n": n, "num_warps": w, "num_stages": s}
        for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    ]
    print(f"{'batch':>5s} {'context':>7s} {'splits':>6s}  best setting -> TB/s (default {pa.LAUNCH})")
    for batch, context in CASES:
        inputs = case(batch, context)
        rows, i32 = inputs[4], inputs[5]
        kv_bytes = 2 * batch * context * NKV * D * 2
        default_splits = pa.decode_splits(batch, NKV, context, sms)
        for splits in sorted({default_splits, max(1, default_splits // 2), min(64, default_splits * 2)}):
            paged = pa.PagedBatch(
                i32(rows),
                i32(list(range(batch + 1))),
                i32([context] * batch),
                i32(rows),
                i32([0] * batch),
                1,
                splits,
            )
            results = []
            for launch in settings:
                try:
                    ms = triton.testing.do_bench(
                        lambda launch=launch, paged=paged, x=inputs: pa._paged_triton(
                            *x[:4], paged, BS, D**-0.5, launch
                        ),
                        warmup=5,
                        rep=30,
                        return_mode="median",
                    )
                except Exception as e:  # a setting that does not fit (shared memory)
                    print(f"  {launch}: {type(e).__name__}")
                    continue
                results.append((kv_bytes / ms / 1e9, launch, ms))
            results.sort(key=lambda r: -r[0])
            default = next(r for r in results if r[1] == pa.LAUNCH)
            best = results[0]
            print(
                f"{batch:5d} {context:7d} {splits:6d}  default {default[2] * 1000:7.1f} us {default[0]:5.2f} TB/s"
                f" | best {best[1]} {best[2] * 1000:7.1f} us {best[0]:5.2f} TB/s"
            )


if __name__ == "__main__":
    main()
