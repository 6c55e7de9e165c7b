"""Speculative decoding's speed-up on the copy dataset (issue 30): the same requests, one at a
time (batch 1) or all at once (--batch N), with and without prompt lookup; output tokens per
second, the mean acceptance length (tokens a verified run gives), and whether the outputs are
the same (greedy: they must be).

  python bench/bench_speculative.py [--model FOLDER | FILE.gguf] [--device cpu|cuda] [--dtype float32]
                                    [--num-prompts 8] [--passage-len 200] [--batch 1]
                                    [--k 4] [--lookup-min 2] [--lookup-max 4] [--text FILE] [--out DIR]

Default: the built-in SmolLM2-135M-Instruct on this machine's CPU, passages of the GPL-3 text
(/usr/share/common-licenses). JSON to --out/speculative.json.

--draft-model FOLDER also runs a draft model; --draft-layers N makes one from the model's
own first N layers (its embeddings, last norm and head kept: a "layer skip" draft, the only
real-weights draft this machine has for the built-in model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from common import machine_info  # noqa: E402

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
    parser.add_argument("--draft-model", default=None, help="a draft model's folder")
    parser.add_argument(
        "--draft-layers", type=int, default=None, help="a draft of the model's first N layers"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    if args.model is None:
        args.model = builtin_model_path()
    if args.model.endswith(".gguf"):  # a GGUF file (the built-in model's, carried to a GPU)
        args.model = converted_folder(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = copy_requests(
        args.text, tokenizer, args.num_prompts, args.passage_len, np.random.default_rng(0)
    )
    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    )
    if args.draft_layers is not None:
        args.draft_model = first_layers(args.model, args.draft_layers)
    result = {
        "machine": machine_info(),
        "args": vars(args),
        "plain": run(args, requests, None),
        "ngram": run(args, requests, spec),
    }
    if args.draft_model is not None:
        draft = {"model": args.draft_model, "num_speculative_tokens": args.k}
        result["draft_model"] = run(args, requests, draft)
    plain = result["plain"]
    for method in ("ngram", "draft_model"):
        if method not in result:
            continue
        m = result[method]
        m["speedup"] = m["tokens_per_s"] / plain["tokens_per_s"]
        m["same_tokens"] = plain["token_ids"] == m["token_ids"]
        print(
            f"{method}: batch {args.batch}, {args.num_prompts} copy prompts of ~{args.passage_len} tokens on "
            f"{args.device}: {plain['tokens_per_s']:.1f} -> {m['tokens_per_s']:.1f} tokens/s ({m['speedup']:.2f}x), "
            f"mean acceptance length {m['mean_acceptance_length']:.2f} "
            f"({m['num_accepted_tokens']} of {m['num_draft_tokens']} drafts kept), "
            f"same tokens: {m['same_tokens']}"
        )
    with open(os.path.join(args.out, "speculative.json"), "w") as f:
        json.dump(result, f, indent=1)


def first_layers(folder: str, layers: int) -> str:
    """A copy of the model in `folder` with its first `layers` layers only (and its tokenizer)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    out = tempfile.mkdtemp()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    for name in os.listdir(folder):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(folder, name), out)
    return out


if __name__ == "__main__":
    main()
