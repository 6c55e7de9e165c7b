"""The skinny matmul's tiles for FP8 weights (issue 29: decode at batch 1 with FP8 weights took
0.72x the bf16 floor at 8d22063, against 0.6x asked). The tiles in use were swept for bf16
(skinny_matmul._plan: BLOCK_K in elements, so an FP8 tile reads half the bytes a bf16 one
does). Here each of Llama-3-8B's decode matmuls (q/k/v, o, gate/up with SiLU-mul, down) runs
over 32 layers' distinct FP8 weights (no layer's weight left in L2 for the next replay),
captured in one CUDA graph, for every tile in a grid, at batch 1 and 16; printed per shape:
the plan in use, the best tile, their microseconds a layer and TB/s of weight read, and the
bf16 weight's time with its plan. x's row quantisation (its own small kernel, once a matmul)
is timed alone too.

  PYTHONPATH=. python bench/bench_fp8_skinny.py [--batch 1 16] [--out $OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

from ringserve.kernels.skinny_matmul import _ACTIVATION_CODE, _skinny_kernel, quantize_rows, skinny_plan

LAYERS = 32
# name: (rows of the weight, K, gated)
SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, True),
    "down": (4096, 14336, False),
}


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds a call of fn (which runs all LAYERS once) takes / LAYERS, replayed in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps / LAYERS)
    return best


def launch(x, x_scale, w, w_scale, y, gated, tile):
    block_n, block_k, stages, cols, warps = tile
    m, n = y.shape
    _skinny_kernel[(triton.cdiv(n, cols),)](
        x, x_scale if x_scale is not None else y, w, w_scale if w_scale is not None else y, y, y,
        m, n, x.stride(0), K=w.shape[1], HAS_BIAS=False, ACT=_ACTIVATION_CODE["silu"] if gated else 0,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, COLS=cols, W_FP8=w_scale is not None,
        PDL=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def tiles(n_out: int, gated: bool, sms: int):
    for block_n, block_k, stages, warps in itertools.product(
        (32, 64, 128), (256, 512, 1024), (3, 4, 6), (4, 8)
    ):
        if warps == 8 and block_n < 64:
            continue
        if gated:  # block_n counts gate + up rows: half of them give output columns
            half = block_n // 2
            yield half, block_k, stages, half, warps
            wave = triton.cdiv(n_out, 4 * sms)  # one wave of 4 programs a multiprocessor
            if half // 2 < wave < half:
                yield half, block_k, stages, wave, warps
        else:
            yield block_n, block_k, stages, block_n, warps


def sweep_shape(name: str, rows: int, k: int, gated: bool, batches, device, sms: int) -> dict:
    """One of SHAPES at each batch size: its plans' and the grid's times (main's table)."""
    n_out = rows // 2 if gated else rows
    bf16 = [torch.randn(rows, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    fp8 = [(q, s[:, 0].contiguous()) for q, s in (quantize_rows(w) for w in bf16)]
    tb = lambda us, nbytes: nbytes / us / 1e6  # noqa: E731
    found_rows = {}

    def one_batch(m: int):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        xq, xs = quantize_rows(x, pdl=False)
        y = torch.empty(m, n_out, device=device, dtype=torch.bfloat16)
        plan = skinny_plan(x, fp8[0][0], gated=gated)
        in_use = (*plan[:3], plan[3], 4)
        bf16_plan = (*skinny_plan(x, bf16[0], gated=gated), 4)

        def run_bf16():
            for w in bf16:
                launch(x, None, w, None, y, gated, bf16_plan)

        def run_fp8(tile):
            for w, s in fp8:
                launch(xq, xs, w, s, y, gated, tile)

        def run_quantize():
            for _ in range(LAYERS):
                quantize_rows(x, pdl=False)

        bf16_us = graph_us(run_bf16)
        found = {}
        for tile in dict.fromkeys([in_use, *tiles(n_out, gated, sms)]):
            try:
                found[tile] = graph_us(lambda t=tile: run_fp8(t))
            except Exception as e:  # out of shared memory or registers: not a candidate
                print(f"  {name} m={m} {tile}: {type(e).__name__}", flush=True)
        best = min(found, key=found.get)
        quant_us = graph_us(run_quantize)
        fp8_bytes, bf16_bytes = rows * k, rows * k * 2
        row = {
            "bf16_plan": list(bf16_plan), "bf16_us": bf16_us, "bf16_tbs": tb(bf16_us, bf16_bytes),
            "in_use": list(in_use), "in_use_us": found[in_use], "in_use_tbs": tb(found[in_use], fp8_bytes),
            "best": list(best), "best_us": found[best], "best_tbs": tb(found[best], fp8_bytes),
            "quantize_x_us": quant_us,
            "top5": [[list(t), found[t]] for t in sorted(found, key=found.get)[:5]],
        }  # fmt: skip
        found_rows[f"{name}_m{m}"] = row
        print(
            f"{name} m={m}: bf16 {bf16_us:.1f} us ({row['bf16_tbs']:.2f} TB/s); FP8 in use {in_use} "
            f"{found[in_use]:.1f} us ({row['in_use_tbs']:.2f}); best {best} {found[best]:.1f} us "
            f"({row['best_tbs']:.2f}); x quantisation {quant_us:.1f} us",
            flush=True,
        )
        print("   top5:", row["top5"], flush=True)

    for m in batches:
        one_batch(m)
    return found_rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    results = {"device": torch.cuda.get_device_name(device), "shapes": {}}
    for name in args.shapes:
        results["shapes"].update(sweep_shape(name, *SHAPES[name], args.batch, device, sms))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "fp8_skinny.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
