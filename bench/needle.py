"""Needle in a haystack (issue 29's long-context check of the FP8 KV cache): a sentence that
holds a five-digit number (the needle) is put at a depth of a long English text (the
haystack: license texts from /usr/share/common-licenses, real prose), and the model is asked
for the number after it; retrieved when its greedy answer contains the number. Each
configuration answers the same grid of context lengths x depths, each cell with its own
number; the table shows which cells each one retrieves, and which cells bf16 retrieves and
FP8 misses (what the issue asks: none).

  python bench/needle.py [--model FOLDER] [--lengths 1000 2000 4000 7800] [--depths 0.1 0.5 0.9]
                         [--configs auto fp8] [--dtype bfloat16] [--device cpu|cuda] [--out DIR]

Configurations: the KV cache's dtype (`auto`: the model's; `fp8`), `+w` for FP8 weights too
(e.g. `fp8+w`). Default: the built-in SmolLM2-135M-Instruct (8K context). JSON to
--out/needle.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from ringserve import LLM, SamplingParams  # noqa: E402

QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."


def haystack_sentences() -> list[str]:
    """Real English prose, by sentence: the license texts this machine carries."""
    text = " ".join(
        open(path, errors="ignore").read() for path in sorted(glob.glob("/usr/share/common-licenses/*"))
    )
    words = text.split()
    sentences, current = [], []
    for word in words:
        current.append(word)
        if word.endswith((".", "?", "!")) and len(current) > 3:
            sentences.append(" ".join(current))
            current = []
    return sentences


def build_prompt(tokenizer, sentences: list[str], length: int, depth: float, number: int) -> str:
    """Sentences up to about `length` tokens with the needle placed at `depth` (0: first,
    1: last) of them, then the question."""
    needle = f"The special magic number is {number}. Remember it: {number}."
    chosen, tokens = [], 0
    for sentence in sentences:
        n = len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        if tokens + n > length:
            break
        chosen.append(sentence)
        tokens += n
    chosen.insert(round(depth * len(chosen)), needle)
    return " ".join(chosen) + "\n\n" + QUESTION


def run_config(name: str, folder: str, prompts: list[str], args) -> list[str]:
    kv_cache_dtype, _, weights = name.partition("+")
    options = dict(dtype=args.dtype, max_model_len=max(args.lengths) + 200, kv_cache_dtype=kv_cache_dtype)
    if weights == "w":
        options["quantization"] = "fp8"
    if args.device:
        options["device"] = args.device
    params = SamplingParams(max_tokens=16, temperature=0)
    start = time.monotonic()
    with LLM(folder, **options) as llm:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    print(f"{name}: {len(prompts)} prompts in {time.monotonic() - start:.0f} s", flush=True)
    return [o.text for o in outputs]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1000, 2000, 4000, 7800])
    parser.add_argument("--depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    parser.add_argument("--configs", nargs="*", default=["auto", "fp8"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.model is None:
        from ringserve.model.gguf_import import builtin_model_path, converted_folder

        args.model = converted_folder(builtin_model_path())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sentences = haystack_sentences()
    rng = random.Random(0)
    cells = [
        (length, depth, rng.randrange(10000, 100000)) for length in args.lengths for depth in args.depths
    ]
    prompts = [build_prompt(tokenizer, sentences, length, depth, number) for length, depth, number in cells]
    results = {"model": args.model, "dtype": args.dtype, "cells": cells, "answers": {}, "found": {}}
    for name in args.configs:
        answers = run_config(name, args.model, prompts, args)
        results["answers"][name] = answers
        results["found"][name] = [str(number) in answer for (_, _, number), answer in zip(cells, answers)]
        with open(os.path.join(args.out, "needle.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(
        "\n| length | depth | "
        + " | ".join(args.configs)
        + " |\n| ---: | ---: |"
        + " :---: |" * len(args.configs)
    )
    for i, (length, depth, _) in enumerate(cells):
        marks = ["found" if results["found"][n][i] else "missed" for n in args.configs]
        print(f"| {length} | {depth} | " + " | ".join(marks) + " |")
    base = args.configs[0]
    for name in args.configs[1:]:
        lost = [
            cells[i][:2]
            for i, ok in enumerate(results["found"][base])
            if ok and not results["found"][name][i]
        ]
        print(f"{name}: finds {sum(results['found'][name])} of {len(cells)} ({base}: {sum(results['found'][base])}); "
              f"cells {base} finds and {name} misses: {lost or 'none'}")  # fmt: skip


if __name__ == "__main__":
    main()
