"""Prefill on the CPU: the built-in model (SmolLM2-135M-Instruct), ringserve against transformers.

The default a new user runs is the built-in model on a CPU; this times one prompt of random
token ids (2,001 and 6,001 tokens by default) through each, side by side, float32:

- ringserve with the prompt in one step (max_num_batched_tokens above the prompt), and
  with the default chunking (2,048 tokens a step: chunks after a cached prefix);
- transformers: one forward with logits_to_keep=1 (the same work: every layer over every
  token, logits of the last row only).

Each figure is the median of --reps runs after one warm-up on a short prompt, the three
taking turns so that other load on the machine falls on all alike. CPU only:
    python bench/bench_cpu.py [--lengths 2001 6001] [--reps 2] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# This checkout's ringserve, not whichever one the environment has installed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_CHUNK = 2048  # EngineConfig.max_num_batched_tokens's default


def interleaved_medians(runs: dict, reps: int) -> dict:
    """Median wall time (s) of each of runs' functions, the functions taking turns rep by
    rep, so that a change in the machine's load (other processes on shared cores) falls
    on all of them alike."""
    times = {key: [] for key in runs}
    for _ in range(reps):
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def ringserve_prefill(folder: str, prompt: list[int], batched_tokens: int):
    """A function that runs the prompt through a fresh request (max_tokens=1: prefill and
    the first token), on an engine made once (prefix caching off, so every run prefills)."""
    from ringserve.config import EngineConfig
    from ringserve.engine.engine import LLMEngine
    from ringserve.sampling_params import SamplingParams

    engine = LLMEngine(
        folder,
        device="cpu",
        dtype="float32",
        engine_config=EngineConfig(
            max_num_batched_tokens=batched_tokens, max_model_len=8192, enable_prefix_caching=False
        ),
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tokens=prompt):
        engine.add_request("", params, prompt_token_ids=tokens)
        while engine.has_unfinished():
            engine.step()

    return engine, run


def transformers_prefill(folder: str, prompt: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def run(tokens=ids):
        model(input_ids=tokens, logits_to_keep=1, use_cache=False)

    return model, run


def builtin_folder() -> str:
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    return converted_folder(builtin_model_path())


def random_model(config_folder: str) -> str:
    """A folder with random float32 weights of the config's shape (safetensors, as saved)."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tempfile.mkdtemp()
    config = AutoConfig.from_pretrained(config_folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2001, 6001])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-chunked", action="store_true", help="skip the default-chunking runs")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--random-from-config",
        metavar="FOLDER",
        help="random weights of the shape in FOLDER/config.json (bench/configs/smollm2_135m is the built-in's) instead of the built-in model (for a quiet "
        "machine without the model's package: the same work, so the same times)",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = random_model(args.random_from_config) if args.random_from_config else builtin_folder()
    vocab = json.load(open(f"{folder}/config.json"))["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(0, vocab, (64,), generator=gen).tolist()
    rows = []
    for n in args.lengths:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        budgets = {"ringserve_one_step_s": max(n, DEFAULT_CHUNK)}
        if not args.no_chunked and n > DEFAULT_CHUNK:
            budgets["ringserve_chunked_s"] = DEFAULT_CHUNK
        runs, keep = {}, []
        for key, budget in budgets.items():
            engine, runs[key] = ringserve_prefill(folder, prompt, budget)
            keep.append(engine)
        model, runs["transformers_s"] = transformers_prefill(folder, prompt)
        for key in runs:  # warm-up: first calls allocate and pick kernels
            runs[key](torch.tensor([warm]) if key == "transformers_s" else warm)
        row = {"tokens": n, **interleaved_medians(runs, args.reps)}
        for engine in keep:
            engine.close()
        del runs, keep, model
        rows.append(row)
        print(row, flush=True)

    print(f"\nprefill on the CPU, {args.threads} threads, float32, median of {args.reps}")
    print(f"{'tokens':>7} {'ringserve':>10} {'chunked':>10} {'transformers':>13} {'ratio':>6}")
    for r in rows:
        chunked = f"{r['ringserve_chunked_s']:10.2f}" if "ringserve_chunked_s" in r else f"{'-':>10}"
        ratio = r["ringserve_one_step_s"] / r["transformers_s"]
        print(
            f"{r['tokens']:>7} {r['ringserve_one_step_s']:10.2f} {chunked} "
            f"{r['transformers_s']:13.2f} {ratio:6.2f}"
        )
    print("(seconds; ratio: ringserve one step / transformers)")
    if args.json:
        info = {"torch": torch.__version__, "threads": args.threads, "reps": args.reps}
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
