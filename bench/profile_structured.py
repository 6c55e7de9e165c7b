"""Where a constrained decode step's host time goes (bench/structured_overhead.py's setting):
the pending-token read, the grammars' advance, the masks, and their application, timed around
the engine's own calls at one batch size.

  PYTHONPATH=.:bench python bench/profile_structured.py --tokenizer TOKENIZER_FOLDER [--batch 64]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from structured_overhead import decode_step_times, list_schema

import ringserve.engine.engine as engine_module
from ringserve import LLM
from ringserve.engine import structured_output


def timed(table, name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name].append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--model-dir", default="/tmp/llama8b-random")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    table = collections.defaultdict(list)
    engine_module._pending_tokens = timed(table, "pending read", engine_module._pending_tokens)
    structured_output.Grammar.advance = timed(table, "advance (one row)", structured_output.Grammar.advance)
    structured_output.GrammarMasks.apply = timed(table, "masks + apply", structured_output.GrammarMasks.apply)
    with LLM(args.model_dir, max_num_seqs=args.batch) as llm:
        decode_step_times(llm, 2, list_schema(16), 8)
        table.clear()
        llm.engine.step = timed(table, "step", llm.engine.step)
        gaps = decode_step_times(llm, args.batch, list_schema(16), 48)
        torch.cuda.synchronize()
    print(f"batch {args.batch}: step gap {1e3 * sum(gaps) / len(gaps):.2f} ms")
    for name, times in table.items():
        print(f"{name}: {len(times)} calls, mean {1e3 * sum(times) / len(times):.3f} ms")


if __name__ == "__main__":
    main()
