"""llguidance against xgrammar on the host work that structured output adds to each step.

For each engine and grammar: the time to compile the grammar for a request, and the time to
compute one token mask (the work that must hide behind the device step), over seeded random
walks through the grammar. Run on the CPU; xgrammar is measured where it is installed
(`pip install --no-deps xgrammar apache-tvm-ffi`: it is not a ringserve dependency).

  PYTHONPATH=. python bench/grammar_engines.py --tokenizer .whl/tok [--steps 300] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
GRAMMARS = {"schema": SCHEMA, "json_object": {"type": "object"}}


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [words] bitmask -> the allowed token ids."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def summary(times_s: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times_s)
    return {"mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2], "p99_ms": ms[int(len(ms) * 0.99)]}


def walk(step, consume, done, vocab: int, steps: int, seed: int) -> list[float]:
    """A random walk: at each step time the mask, then take a random allowed token."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        mask = step()
        times.append(time.perf_counter() - start)
        ids = allowed_ids(mask, vocab)
        if ids.numel() == 0:
            break
        consume(int(ids[torch.randint(ids.numel(), (1,), generator=gen)]))
    return times


def bench_llguidance(tokenizer, grammars: dict, steps: int, walks: int) -> dict:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    result = {"tokenizer_s": time.perf_counter() - start}
    vocab = lltok.vocab_size
    for name, schema in grammars.items():
        compile_s, times = [], []
        for seed in range(walks):
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
            compile_s.append(time.perf_counter() - start)
            assert not matcher.is_error(), matcher.get_error()
            mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

            def step(matcher=matcher, mask=mask):
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
                return mask

            times += walk(step, matcher.consume_token, matcher.is_stopped, vocab, steps, seed)
        result[name] = {"compile": summary(compile_s), "mask": summary(times), "tokens": len(times)}
    return result


def bench_xgrammar(tokenizer, grammars: dict, steps: int, walks: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    result = {"tokenizer_s": time.perf_counter() - start}
    vocab = info.vocab_size
    for name, schema in grammars.items():
        compile_s, times = [], []
        for seed in range(walks):
            start = time.perf_counter()
            matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
            compile_s.append(time.perf_counter() - start)
            mask = xgrammar.allocate_token_bitmask(1, vocab)

            def step(matcher=matcher, mask=mask):
                matcher.fill_next_token_bitmask(mask)
                return mask[0]

            times += walk(step, matcher.accept_token, matcher.is_terminated, vocab, steps, seed)
        result[name] = {"compile": summary(compile_s), "mask": summary(times), "tokens": len(times)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    parser.add_argument("--steps", type=int, default=300, help="tokens a walk at most")
    parser.add_argument("--walks", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    results = {
        "vocab": len(tokenizer),
        "llguidance": bench_llguidance(tokenizer, GRAMMARS, args.steps, args.walks),
    }
    try:
        results["xgrammar"] = bench_xgrammar(tokenizer, GRAMMARS, args.steps, args.walks)
    except ImportError as e:
        results["xgrammar"] = f"not installed: {e}"
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
