"""Speculative decoding's speed-up on the copy dataset (issue 30): the same requests, one at a
time (batch 1) or all at once (--batch N), with and without prompt lookup; output tokens per
second, the mean acceptance length (tokens a verified run gives), and whether the outputs are
the same (greedy: they must be).

  python bench/bench_speculative.py [--model FOLDER] [--device cpu|cuda] [--dtype float32]
                                    [--num-prompts 8] [--passage-len 200] [--batch 1]
                                    [--k 4] [--lookup-min 2] [--lookup-max 4] [--text FILE] [--out DIR]

Default: the built-in SmolLM2-135M-Instruct on this machine's CPU, passages of the GPL-3 text
(/usr/share/common-licenses). JSON to --out/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from ringserve import LLM, SamplingParams  # noqa: E402
from ringserve.benchmarks.datasets import copy_requests  # noqa: E402


def run(args, requests, speculative_config) -> dict:
    options = dict(device=args.device, dtype=args.dtype, speculative_config=speculative_config)
    with LLM(args.model, **options) as llm:
        messages = [[{"role": "user", "content": r.prompt}] for r in requests]
        params = [SamplingParams(max_tokens=r.expected_output_len, temperature=0) for r in requests]
        llm.chat(messages[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
        start, outputs = time.perf_counter(), []
        for i in range(0, len(messages), args.batch):
            outputs += llm.chat(messages[i : i + args.batch], params[i : i + args.batch], use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.engine.spec_stats
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "token_ids": [list(o.token_ids) for o in outputs],
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--passage-len", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.model is None:
        from ringserve.model.gguf_import import builtin_model_path, converted_folder

        args.model = converted_folder(builtin_model_path())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = copy_requests(
        args.text, tokenizer, args.num_prompts, args.passage_len, np.random.default_rng(0)
    )
    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    )
    result = {"args": vars(args), "plain": run(args, requests, None), "ngram": run(args, requests, spec)}
    plain, ngram = result["plain"], result["ngram"]
    result["speedup"] = ngram["tokens_per_s"] / plain["tokens_per_s"]
    result["same_tokens"] = plain["token_ids"] == ngram["token_ids"]
    with open(os.path.join(args.out, "speculative.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"batch {args.batch}, {args.num_prompts} copy prompts of ~{args.passage_len} tokens on {args.device}: "
        f"{plain['tokens_per_s']:.1f} -> {ngram['tokens_per_s']:.1f} tokens/s ({result['speedup']:.2f}x), "
        f"mean acceptance length {ngram['mean_acceptance_length']:.2f} "
        f"({ngram['num_accepted_tokens']} of {ngram['num_draft_tokens']} drafts kept), "
        f"same tokens: {result['same_tokens']}"
    )


if __name__ == "__main__":
    main()
