"""Accuracy of FP8 on real weights (issue 29): the KV cache's choices of scale measured on
the same text, then the engine's own paths.

1. Formats, by transformers with its cache's K and V quantised and read back (e4m3, as
   kernels/kv_quant.py stores them) under each choice of scale: one of 1.0 per tensor
   (vLLM's default without calibrated scales); calibrated per tensor (per layer) and per KV
   head, with headroom 1, 4 (the engine's) and 16; and dynamic, one scale per token and head
   (amax / 448 of each vector as it is written). Calibration is the engine's own
   (engine/kv_calibration_text.py). Perplexity of a fixed English text in windows, its
   change from the unquantised cache, the mean KL divergence of the next-token
   distributions from it, and how often the top token agrees.
2. The engine four ways: as is, --kv-cache-dtype fp8, --quantization fp8 (FP8 weights), and
   both: perplexity through its own steps (engine_logits: half of each window as a prompt,
   the rest in chunks of 64 read through the cache), KL from the engine as is, and greedy
   continuations of 20 chat prompts, 32 tokens each: how many equal the unquantised
   engine's in all 32.

  python bench/fp8_accuracy.py [--model FOLDER] [--text FILE] [--dtype bfloat16] [--skip-formats]

Default: the built-in SmolLM2-135M-Instruct, the GPL-3 text in /usr/share/common-licenses.
JSON to --out/fp8_accuracy.json, tables last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from ringserve.config import DTYPES  # noqa: E402
from ringserve.engine.kv_calibration_text import CALIBRATION_TEXT  # noqa: E402
from ringserve.kernels.kv_quant import FP8_MAX, dequantize_kv, quantize_kv  # noqa: E402

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a linked list in Python?",
    "List five tips for better sleep.",
    "Why do cats purr?",
    "Describe the water cycle step by step.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning, how are you?' into French.",
    "What is the capital of Australia and why was it chosen?",
    "Write a haiku about the ocean.",
    "How does a bill become a law in the United States?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a week of hiking?",
    "Compare electric cars with petrol cars.",
    "Tell me a fun fact about octopuses.",
    "How do vaccines train the immune system?",
    "Write a polite email declining a meeting.",
]


def fake_quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """x [B, NKV, T, D] (transformers' cache) stored in e4m3 and read back; scale [NKV], or
    "token": one scale per token and head, amax / 448 of its vector."""
    if isinstance(scale, str):
        s = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
    rows = x[0].transpose(0, 1)  # [T, NKV, D]
    return dequantize_kv(quantize_kv(rows, scale), scale, x.dtype).transpose(0, 1)[None]


def hf_logits(model, tokens: list[int], scales) -> torch.Tensor:
    """[T, V] float32 logits of tokens with the cache quantised by scales ([layers, 2, NKV],
    "token", or None: unquantised)."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    if scales is not None:
        update = past.update

        def quantizing(keys, values, layer, *args, **kwargs):
            pick = (lambda i: scales) if isinstance(scales, str) else (lambda i: scales[layer, i])
            return update(
                fake_quantize(keys, pick(0)), fake_quantize(values, pick(1)), layer, *args, **kwargs
            )

        past.update = quantizing
    with torch.no_grad():
        return model(torch.tensor([tokens]), past_key_values=past, use_cache=True).logits[0].float()


def calibrated_amax(model, tokens: list[int]) -> torch.Tensor:
    """[layers, 2, NKV]: the largest |k| (after RoPE) and |v| per KV head on tokens."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([tokens]), past_key_values=past, use_cache=True)
    return torch.stack(
        [
            torch.stack([layer.keys.abs().amax((0, 2, 3)), layer.values.abs().amax((0, 2, 3))])
            for layer in past.layers
        ]
    ).float()


def score(logits: torch.Tensor, tokens: list[int], ref: torch.Tensor | None) -> dict:
    logp = torch.log_softmax(logits[:-1], -1)
    nll = -logp.gather(1, torch.tensor(tokens[1:])[:, None]).mean().item()
    out = {"nll": nll}
    if ref is not None:
        ref_logp = torch.log_softmax(ref[:-1], -1)
        out["kl"] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        out["top1"] = (ref_logp.argmax(-1) == logp.argmax(-1)).float().mean().item()
    return out


def mean_of(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-formats", action="store_true", help="only the engine's four ways")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringserve import LLM, SamplingParams
    from ringserve.engine.logits_probe import engine_logits
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    folder = args.model or converted_folder(builtin_model_path())
    dtype = DTYPES[args.dtype]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with open(args.text, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)
    windows = [ids[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
    windows = [w for w in windows if len(w) == args.window]
    print(
        f"{folder}: {len(windows)} windows of {args.window} tokens from {args.text}, {args.dtype}", flush=True
    )

    results = {}
    if not args.skip_formats:
        results["formats"] = formats(model, tok, windows)

    configs = {"bf16": {}, "FP8 KV": {"kv_cache_dtype": "fp8"}, "FP8 weights": {"quantization": "fp8"}}
    configs["FP8 weights + KV"] = {**configs["FP8 KV"], **configs["FP8 weights"]}
    engine = {}
    half = args.window // 2
    chunks = [64] * ((args.window - half) // 64)
    for name, kw in configs.items():
        with LLM(folder, dtype=args.dtype, max_model_len=args.window + 64, **kw) as llm:
            logits = [
                engine_logits(llm.engine, w[: half + sum(chunks)], prefill=half, chunks=chunks)
                for w in windows
            ]
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            greedy = [
                o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
            ]
        engine[name] = {"logits": logits, "greedy": greedy}
        print(f"  engine {name}: done", flush=True)
    base = engine["bf16"]
    scored = [w[: half + sum(chunks)] for w in windows]
    results["engine"] = {}
    for name, run in engine.items():
        m = mean_of([score(x, w, r) for x, w, r in zip(run["logits"], scored, base["logits"])])
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(a, f)) if x != y), len(a))
            for a, f in zip(base["greedy"], run["greedy"])
        ]
        results["engine"][name] = {
            "ppl": math.exp(m["nll"]),
            "kl": m["kl"],
            "top1": m["top1"],
            "greedy_equal_prompts": sum(d == args.new_tokens for d in first_diff),
            "greedy_first_difference": first_diff,
        }
    with open(os.path.join(args.out, "fp8_accuracy.json"), "w") as f:
        json.dump({"model": folder, "dtype": args.dtype, "text": args.text, "results": results}, f, indent=1)

    if "formats" in results:
        print(
            f"\n| KV cache format ({args.dtype} weights, transformers) | perplexity | change | KL | top-1 agreement |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        ref = results["formats"]["bf16 KV"]["ppl"]
        for name, r in results["formats"].items():
            kl = f"{r['kl']:.2e}" if "kl" in r else ""
            top1 = f"{100 * r['top1']:.2f}%" if "top1" in r else ""
            print(f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] / ref - 1):+.2f}% | {kl} | {top1} |")
    print(
        f"\n| engine ({args.dtype}) | perplexity | change | KL from bf16 | top-1 | greedy {args.new_tokens} equal |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ref = results["engine"]["bf16"]["ppl"]
    for name, r in results["engine"].items():
        print(
            f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] / ref - 1):+.2f}% | {r['kl']:.2e} | "
            f"{100 * r['top1']:.2f}% | {r['greedy_equal_prompts']} of {len(PROMPTS)} |"
        )


def formats(model, tok, windows) -> dict:
    """Part 1: each choice of KV scale, by transformers."""
    from ringserve.worker.kv_calibration import HEADROOM

    amax = calibrated_amax(model, tok.encode(CALIBRATION_TEXT, add_special_tokens=True))
    per_tensor = amax.amax(-1, keepdim=True).expand_as(amax)
    variants = {
        "scale 1.0 per tensor (vLLM default)": torch.ones_like(amax),
        "calibrated per tensor, headroom 4": per_tensor * 4 / FP8_MAX,
        "calibrated per head, headroom 1": amax / FP8_MAX,
        f"calibrated per head, headroom {HEADROOM:g} (ringserve)": amax * HEADROOM / FP8_MAX,
        "calibrated per head, headroom 16": amax * 16 / FP8_MAX,
        "dynamic per token and head": "token",
    }
    refs = [hf_logits(model, w, None) for w in windows]
    base = mean_of([score(r, w, None) for r, w in zip(refs, windows)])
    results = {"bf16 KV": {"ppl": math.exp(base["nll"])}}
    for name, scales in variants.items():
        m = mean_of([score(hf_logits(model, w, scales), w, r) for w, r in zip(windows, refs)])
        results[name] = {"ppl": math.exp(m["nll"]), "kl": m["kl"], "top1": m["top1"]}
        print(f"  {name}: ppl {results[name]['ppl']:.4f}, KL {m['kl']:.2e}", flush=True)
    return results


if __name__ == "__main__":
    main()
