"""FP8 on one GPU (issue 29): the FP8 kernels against their torch forms on the device, then a
Llama-3-8B-shaped model (random bf16 weights) four ways in one run: bf16, the FP8 KV cache
(--kv-cache-dtype fp8), FP8 weights (--quantization fp8), and both. For each: the tokens
that fit the same KV memory, decode ms per step at batch 1 / 64 after 1K prompts and at
batch 1 after long prompts, the time to first token of an 8K prompt, and that of 12 prompt
lengths of 900-1,200 tokens each met for the first time (a per-shape cost would show there).

  python bench/bench_fp8.py [--long 32768 131008] [--kv-gib 24] [--configs bf16 kv w kvw] [--out $OUT]

JSON to --out/fp8.json, a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from bench_decode import prompt_batch, timed_ms  # noqa: E402
from common import machine_info, random_llama3_8b  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402


def check_kernels(device) -> dict:
    """The FP8 store kernels (store, RoPE + store, q/k/v matmul + RoPE + store) against
    kernels/kv_quant.py's torch form, the skinny FP8 matmul and the experts' FP8 grouped
    matmul against scaled_mm, and the paged kernel over an FP8 cache against the gathered
    reference, bf16 on the device."""
    import torch.nn.functional as F

    from ringserve.attention import paged as pa
    from ringserve.kernels import elementwise as K
    from ringserve.kernels import skinny_matmul as S
    from ringserve.kernels.kv_quant import FP8_DTYPE, quantize_kv

    torch.manual_seed(0)
    dt, nq, nkv, d, t = torch.bfloat16, 32, 8, 128, 7
    scales = (torch.rand(nkv, device=device) * 0.05 + 0.01, torch.rand(nkv, device=device) * 0.02 + 0.005)
    out = {}

    def same(name, got, want):
        g, w = got.float(), want.float()
        exact = (g == w).float().mean().item()
        step = ((g - w).abs() <= w.abs() * 2**-3 + 2**-9).all().item()
        out[name] = {"exact_share": exact, "within_one_step": step}
        print(f"  {name}: {exact:.5f} of values bit-equal to torch's, all within one e4m3 step: {step}")

    k = (torch.randn(t, nkv, d, device=device) * 3).to(dt)
    v = torch.randn(t, nkv, d, device=device).to(dt)
    slots = torch.randperm(64, device=device)[:t]
    caches = [torch.zeros(64, nkv, d, dtype=FP8_DTYPE, device=device) for _ in range(2)]
    K._store_kv_triton(k, v, *caches, slots, scales)
    same("store_kv k", caches[0][slots], quantize_kv(k, scales[0]))
    same("store_kv v", caches[1][slots], quantize_kv(v, scales[1]))
    q = torch.randn(t, nq, d, device=device).to(dt)
    angle = torch.rand(t, 1, d // 2, device=device) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dt), torch.cat([angle.sin()] * 2, -1).to(dt)
    caches = [torch.zeros(64, nkv, d, dtype=FP8_DTYPE, device=device) for _ in range(2)]
    _, k_rot = K._rotary_triton(q, k, cos, sin, (v, *caches, slots, scales))
    same("rotary_store_kv k", caches[0][slots], quantize_kv(k_rot, scales[0]))
    same("rotary_store_kv v", caches[1][slots], quantize_kv(v, scales[1]))
    x = torch.randn(4, 4096, device=device).to(dt)
    w = (torch.randn((nq + 2 * nkv) * d, 4096, device=device) / 64).to(dt)
    caches = [torch.zeros(64, nkv, d, dtype=FP8_DTYPE, device=device) for _ in range(2)]
    fused = S.qkv_rope_store(x, w, None, cos[:4], sin[:4], *caches, slots[:4], kv_scales=scales)
    assert fused is not None, "the skinny q/k/v kernel did not take the FP8 cache"
    qq, kk, vv = (p.view(4, -1, d) for p in F.linear(x, w).split([nq * d, nkv * d, nkv * d], -1))
    _, kk = K.rotary_qk(qq, kk, cos[:4], sin[:4])
    same("qkv_rope_store k", caches[0][slots[:4]], quantize_kv(fused[1], scales[0]))
    same("qkv_rope_store v", caches[1][slots[:4]], quantize_kv(fused[2], scales[1]))

    # A prefill's SiLU-mul with the down projection's row quantisation in one pass, against
    # the two kernels it replaces (silu_mul, then the row quantisation): bit-equal values
    gate_up = (torch.randn(300, 2 * 14336, device=device) * 2).to(dt)
    fused = S.gated_quantized(gate_up, "silu")
    two, two_scale = S.quantize_rows(K.silu_mul(gate_up))
    same("silu_mul + row quantisation", fused.values, two)
    out["silu_mul_quantize_scales_equal"] = bool(torch.equal(fused.scale, two_scale))
    print(f"  silu_mul + row quantisation: scales equal {out['silu_mul_quantize_scales_equal']}")

    # FP8 weights: the skinny kernel (x quantised per row before it) against scaled_mm's
    # w8a8, and both against the dequantised weight in float32 (what the activations' per-row
    # scales lose)
    for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
        w8, w_scale = S.quantize_rows((torch.randn(n, k, device=device) / k**0.5).to(dt))
        w_scale = w_scale[:, 0].contiguous()
        for m in (1, 16):
            xm = torch.randn(m, k, device=device).to(dt)
            got = S.linear(xm, w8, weight_scale=w_scale).float()
            w8a8 = S.fp8_matmul(torch.cat([xm, xm]), w8, w_scale)[:m].float()  # 2m rows: scaled_mm
            exact = xm.float() @ w8.float().t() * w_scale
            err = ((got - w8a8).abs().max() / w8a8.abs().max()).item()
            err_exact = ((got - exact).abs().max() / exact.abs().max()).item()
            out[f"skinny_fp8_{n}x{k}_m{m}_rel_err"] = err
            out[f"skinny_fp8_{n}x{k}_m{m}_rel_err_to_float32"] = err_exact
            print(
                f"  skinny FP8 {n}x{k} rows {m}: max |diff| / max |y| against scaled_mm {err:.2e}, "
                f"against the float32 weights {err_exact:.2e}"
            )

    # FP8 experts: one grouped matmul (torch's scaled grouped mm) against each expert's
    # scaled_mm, Qwen3-30B-A3B's gate shape (128 experts, 768 x 2048), 2,000 rows unevenly
    # spread (some experts get none); and its time against the bf16 grouped matmul
    if S.fp8_grouped_mm_usable(device):
        experts, n, k = 128, 768, 2048
        w = (torch.randn(experts, n, k, device=device) / k**0.5).to(dt)
        w8, w_scale = S.quantize_rows(w.reshape(-1, k))
        w8, w_scale = w8.view(experts, n, k), w_scale.view(experts, n)
        counts = torch.distributions.Poisson(16.0).sample((experts,)).int()
        counts[::7] = 0
        ends = counts.cumsum(0).int().to(device)
        xg = torch.randn(int(ends[-1]), k, device=device).to(dt)
        got = S.fp8_grouped_mm(xg, w8.transpose(1, 2), w_scale, ends)
        want, start = torch.empty_like(got), 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                want[start:end] = S.fp8_matmul(xg[start:end], w8[e], w_scale[e])
            start = end
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        fp8_ms = min(
            timed_ms(lambda: S.fp8_grouped_mm(xg, w8.transpose(1, 2), w_scale, ends), device)
            for _ in range(20)
        )
        bf16_ms = min(
            timed_ms(lambda: torch._grouped_mm(xg, w.transpose(1, 2), offs=ends), device) for _ in range(20)
        )
        out["fp8_grouped_mm"] = {"rel_err": err, "fp8_ms": fp8_ms, "bf16_ms": bf16_ms, "rows": xg.shape[0]}
        print(
            f"  FP8 grouped matmul ({xg.shape[0]} rows, 128 experts {n}x{k}): max |diff| / max |y| against "
            f"per-expert scaled_mm {err:.2e}; {fp8_ms:.3f} ms against bf16's {bf16_ms:.3f} ms"
        )

    # paged decode over FP8 pages: 3 sequences, split-KV
    bs, lens = 16, [1000, 37, 4100]
    blocks = sum(-(-n // bs) for n in lens)
    kc = quantize_kv(torch.randn(blocks * bs, nkv, d, device=device) * 3, scales[0])
    vc = quantize_kv(torch.randn(blocks * bs, nkv, d, device=device), scales[1])
    tables = torch.zeros(3, 300, dtype=torch.int32, device=device)
    perm, used = torch.randperm(blocks, device=device), 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb].int()
        used += nb
    qd = torch.randn(3, nq, d, device=device).to(dt)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    batch = pa.PagedBatch(
        i32([0, 1, 2]), i32([0, 1, 2, 3]), i32(lens), i32([0, 1, 2]), i32([0, 0, 0]), 1, 8,
        [0, 1, 2, 3], lens, [0, 1, 2],
    )  # fmt: skip
    got, _ = pa.paged_attention(qd, kc, vc, tables, batch, bs, d**-0.5, kv_scales=scales)
    want, _ = pa.paged_attention_reference(qd, kc, vc, tables, batch, bs, d**-0.5, kv_scales=scales)
    err = (got.float() - want.float()).abs().max().item()
    out["paged_fp8_max_abs_err"] = err
    print(f"  paged kernel over FP8 pages against the gathered reference: max |diff| {err:.2e}")
    return out


CONFIGS = {  # name -> (kv_cache_dtype, quantization)
    "bf16": ("auto", None),
    "kv": ("fp8", None),
    "w": ("auto", "fp8"),
    "kvw": ("fp8", "fp8"),
}


def bench_engine(name: str, folder, weights, args, device) -> dict:
    from ringserve.engine.engine import LLMEngine

    kv_dtype, quantization = CONFIGS[name]

    longest = max([*args.long, 8192]) + 64
    config = EngineConfig(
        max_model_len=longest,
        max_num_batched_tokens=max(longest, 64 * 1024 + 64),
        kv_cache_memory=int(args.kv_gib * (1 << 30)),
        enable_prefix_caching=False,
        kv_cache_dtype=kv_dtype,
        quantization=quantization,
    )
    start = time.monotonic()
    engine = LLMEngine(folder, device=device, dtype=torch.bfloat16, engine_config=config, weights=weights)
    res = {"startup_s": round(time.monotonic() - start, 1)}
    res["cache_tokens"] = engine.block_manager.num_blocks * engine.block_manager.block_size
    print(
        f"  kv {kv_dtype}: engine in {res['startup_s']} s, {res['cache_tokens']} tokens fit {args.kv_gib} GiB"
    )
    seeds = iter(range(1000, 2000))

    def decode_at(batch: int, prompt: int, steps: int = 32) -> float:
        params = SamplingParams(max_tokens=steps + 12, temperature=0, ignore_eos=True)
        ids = [
            engine.add_request(r.tolist(), params) for r in prompt_batch(batch, prompt, next(seeds), 128256)
        ]
        for _ in range(8):  # the prefill, then warm-up steps
            engine.step()

        def run():
            for _ in range(steps):
                engine.step()

        ms = timed_ms(run, device) / steps
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        print(f"  {name}: batch {batch} after {prompt}: {ms:.3f} ms/step", flush=True)
        return ms

    def once(length: int) -> None:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.add_request(prompt_batch(1, length, next(seeds), 128256)[0].tolist(), params)
        while engine.has_unfinished():
            engine.step()

    def prefill_ms(length: int) -> float:
        once(length)  # warm-up of the shape
        return min(timed_ms(lambda: once(length), device) for _ in range(3))

    # Lengths as traffic sends them, each met for the first time: a per-shape cost of an FP8
    # path (a plan, a compile, an autotune) shows here, where a repeated length hides it.
    lengths = random.Random(0).sample(range(900, 1201), 12)
    first = sorted(timed_ms(lambda n=n: once(n), device) for n in lengths)
    res["prefill_new_lengths_ms"] = {"lengths": lengths, "p50": first[len(first) // 2], "max": first[-1]}
    print(
        f"  {name}: prefill of 12 new lengths 900-1200: p50 {first[len(first) // 2]:.1f}, max {first[-1]:.1f} ms"
    )
    res["prefill_8k_ms"] = prefill_ms(8192)
    print(f"  {name}: prefill 8K {res['prefill_8k_ms']:.1f} ms", flush=True)
    res["decode_ms"] = {}
    for batch, prompt in [(1, 1024), (64, 1024)] + [(1, n) for n in args.long]:
        res["decode_ms"][f"b{batch}_{prompt}"] = decode_at(batch, prompt)
    engine.close()
    return res


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long", type=int, nargs="*", default=[32768, 131008])
    parser.add_argument("--kv-gib", type=float, default=24.0, help="KV-cache memory of each engine")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    device = torch.device("cuda")
    data = {"machine": machine_info(), "args": vars(args)}
    print(data["machine"], flush=True)
    if not args.skip_kernels:
        data["kernels"] = check_kernels(device)
    folder, weights = random_llama3_8b()
    for name in args.configs:
        try:
            data[name] = bench_engine(name, folder, weights, args, device)
        except Exception as e:  # one config failing leaves the others' figures
            import traceback

            traceback.print_exc()
            data[name] = {"error": repr(e)}
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            json.dump(data, f, indent=1)
    done = [n for n in args.configs if "error" not in data[n]]
    print("\n| | " + " | ".join(done) + " |\n| --- |" + " ---: |" * len(done))
    base = data[done[0]]
    for key in base["decode_ms"]:
        cells = [
            f"{data[n]['decode_ms'][key]:.3f} ms ({data[n]['decode_ms'][key] / base['decode_ms'][key]:.2f})"
            for n in done
        ]
        print(f"| decode {key} | " + " | ".join(cells) + " |")
    cells = [
        f"{data[n]['prefill_8k_ms']:.1f} ms ({base['prefill_8k_ms'] / data[n]['prefill_8k_ms']:.2f}x)"
        for n in done
    ]
    print("| prefill 8K | " + " | ".join(cells) + " |")
    cells = ["{p50:.1f} / {max:.1f} ms".format(**data[n]["prefill_new_lengths_ms"]) for n in done]
    print("| first prefill of new 900-1200 lengths, p50 / max | " + " | ".join(cells) + " |")
    cells = [
        f"{data[n]['cache_tokens']} ({data[n]['cache_tokens'] / base['cache_tokens']:.2f})" for n in done
    ]
    print(f"| tokens in {args.kv_gib} GiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
