"""Prefill as traffic meets it, through the engine (issue 26, items 1, 2 and 4), on one GPU
with a Llama-3-8B-shaped model (random bf16 weights, seed 0):

- TTFT of fresh prompts of distinct lengths (900-1,200 tokens, one at a time): every new
  length would pay a cuDNN plan if shapes were not bounded; against the 1K one-step prefill
  plus two decode steps (the issue's target);
- a 4K cached prefix plus 200 new tokens against a fresh 200-token prompt (prefix hits);
- long prompts (32K, 128K) with the default options, first and again, against one step
  (max_num_batched_tokens = max_prefill_tokens = the prompt) and against 2,048-token chunks
  throughout (max_prefill_tokens = 2048).

  PYTHONPATH=. python bench/bench_prefill_engine.py   # JSON in $OUT/prefill_engine.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from bench.common import gpu_state, machine_info, random_llama3_8b, write_json
from ringserve.config import EngineConfig
from ringserve.engine.engine import LLMEngine
from ringserve.sampling_params import SamplingParams

KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (k, v) x KV heads x dims x bf16


class Prompts:
    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(1000, 100000, (n,), generator=self.g).tolist()


def run_to_first_token(engine: LLMEngine, tokens: list[int], max_tokens: int = 1) -> tuple[float, float]:
    """(ms to the first token, ms to the end) of one request alone, stepping the engine."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first - start) * 1000, (end - start) * 1000


def make_engine(folder, weights, max_len: int, **config) -> LLMEngine:
    start = time.monotonic()
    engine = LLMEngine(
        folder,
        device="cuda",
        dtype="bfloat16",
        weights=weights,
        engine_config=EngineConfig(
            max_model_len=max_len, kv_cache_memory=int((max_len + 4096) * KV_BYTES_PER_TOKEN * 1.1), **config
        ),
    )
    print(f"engine {config or 'default'} ready in {time.monotonic() - start:.1f} s", flush=True)
    return engine


def free_memory() -> None:
    """Give a dropped engine's GPU memory back before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", type=int, nargs="+", default=[32768, 131072])
    args = parser.parse_args()
    data = {"machine": machine_info(), "gpu_state": gpu_state(), "long": {}}
    print(data["machine"], data["gpu_state"], flush=True)
    folder, weights = random_llama3_8b()
    max_len = max(args.long) + 256
    prompts = Prompts()

    engine = make_engine(folder, weights, max_len)
    run_to_first_token(engine, prompts(1024))  # first request: allocator and kernels warm
    one_k = statistics.median(run_to_first_token(engine, prompts(1024))[0] for _ in range(5))
    _, gen = run_to_first_token(engine, prompts(1024), max_tokens=65)
    decode_ms = (gen - one_k) / 64
    lengths = list(range(900, 1201, 15))  # 21 distinct lengths, each met for the first time
    ttfts = [run_to_first_token(engine, prompts(n))[0] for n in lengths]
    data["ttft_varying"] = {
        "lengths": lengths,
        "ttft_ms": ttfts,
        "one_step_1k_ms": one_k,
        "decode_step_ms": decode_ms,
        "target_ms": one_k + 2 * decode_ms,
    }
    print(
        f"1K prefill {one_k:.1f} ms, decode step {decode_ms:.2f} ms; TTFT at 21 new lengths 900-1200: "
        f"median {statistics.median(ttfts):.1f} ms, max {max(ttfts):.1f} ms (target {one_k + 2 * decode_ms:.1f})",
        flush=True,
    )
    # Prefix hits: a 4K prefix cached, 200 new tokens after it, each time a new suffix.
    prefix = prompts(4096)
    run_to_first_token(engine, prefix)
    hits = [run_to_first_token(engine, prefix + prompts(200))[0] for _ in range(5)]
    fresh = [run_to_first_token(engine, prompts(200))[0] for _ in range(5)]
    data["prefix_hit"] = {"hit_ms": hits, "fresh_200_ms": fresh}
    print(
        f"4K cached + 200 new: {statistics.median(hits):.1f} ms; fresh 200: {statistics.median(fresh):.1f} ms"
    )
    for n in args.long:
        first, again = (run_to_first_token(engine, prompts(n))[0] for _ in range(2))
        data["long"][str(n)] = {"default_first_ms": first, "default_ms": again}
        print(f"{n} tokens, default options: {first:.0f} ms first, {again:.0f} ms again", flush=True)
    engine.close()
    del engine
    free_memory()
    write_json("prefill_engine.json", data)

    for name, config in (
        ("one_step", dict(max_num_batched_tokens=max_len, max_prefill_tokens=max_len)),
        ("chunks_2k", dict(max_num_batched_tokens=2048, max_prefill_tokens=2048)),
    ):
        engine = make_engine(folder, weights, max_len, **config)
        run_to_first_token(engine, prompts(1024))
        for n in args.long:
            run_to_first_token(engine, prompts(n))  # shapes met once
            data["long"][str(n)][name + "_ms"] = ms = run_to_first_token(engine, prompts(n))[0]
            print(f"{n} tokens, {name}: {ms:.0f} ms", flush=True)
        engine.close()
        del engine
        free_memory()
        write_json("prefill_engine.json", data)
    for n, row in data["long"].items():
        row["default_of_one_step"] = row["one_step_ms"] / row["default_ms"]
        print(f"{n}: default reaches {row['default_of_one_step']:.3f} of the one-step speed")
    write_json("prefill_engine.json", data)


if __name__ == "__main__":
    main()
