"""Where a constrained decode step's host time goes (bench/structured_overhead.py's setting):
the pending-token read, the grammars' advance, the masks and their application, and the whole
step, timed around the engine's own calls at one batch size, per maxLength of the strings.
With --trace, torch.profiler records a few constrained steps (host ops and CUDA runtime calls,
which shows a call that waits for the device) and prints its table; the trace goes to a file.

  PYTHONPATH=.:bench python bench/profile_structured.py --tokenizer TOKENIZER_FOLDER [--batch 64]
      [--max-lengths 16 0] [--trace FOLDER]
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
from gpu_serve import MODEL_DIR
from structured_overhead import decode_step_times, list_schema

import ringserve.engine.engine as engine_module
from ringserve import LLM
from ringserve.engine import structured_output


def timed(table, name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        finally:
            table[name].append(time.perf_counter() - start)

    return wrapper


def report(label: str, gaps: list[float], table: dict) -> None:
    print(f"{label}: step gap {1e3 * sum(gaps) / len(gaps):.2f} ms", flush=True)
    for name, times in table.items():
        times = sorted(times)
        print(
            f"  {name}: {len(times)} calls, mean {1e3 * sum(times) / len(times):.3f} ms, "
            f"p90 {1e3 * times[int(0.9 * len(times))]:.3f} ms",
            flush=True,
        )
    table.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--model-dir", default=MODEL_DIR)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--max-lengths", type=int, nargs="*", default=[16, 0])
    parser.add_argument("--trace", default="", help="a folder for torch.profiler's trace")
    args = parser.parse_args()
    table = collections.defaultdict(list)
    engine_module._pending_tokens = timed(table, "pending read", engine_module._pending_tokens)
    structured_output.GrammarMasks.advance = timed(table, "advance", structured_output.GrammarMasks.advance)
    structured_output.GrammarMasks.apply = timed(table, "masks + apply", structured_output.GrammarMasks.apply)
    with LLM(args.model_dir, max_num_seqs=args.batch) as llm:
        decode_step_times(llm, 2, list_schema(16), 8)  # warm: graphs, the grammar threads
        table.clear()
        llm.engine.step = timed(table, "step", llm.engine.step)
        report(f"batch {args.batch}, free", decode_step_times(llm, args.batch, None, args.steps), table)
        for max_length in args.max_lengths:
            gaps = decode_step_times(llm, args.batch, list_schema(max_length), args.steps)
            report(f"batch {args.batch}, maxLength {max_length}", gaps, table)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profile:
                decode_step_times(llm, args.batch, list_schema(args.max_lengths[0]), 16)
            profile.export_chrome_trace(os.path.join(args.trace, "constrained_steps.json"))
            print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


if __name__ == "__main__":
    main()
