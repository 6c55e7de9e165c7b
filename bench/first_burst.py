"""Where the first wide burst after start-up loses its time (issue 26, item 3): the first
16-wide burst of ~1K prompts after the server starts took 1.9-2.9x its prefill bound, where
the same burst later in a run took 1.10x (BENCHMARKS.md, commits 54596f2 and 13c4e6a).

Through the engine alone, built as `ringserve serve` builds it (default options, a
Llama-3-8B-shaped model with random bf16 weights): one 1K warm-up request (as the benchmark
client's warm-ups), then bursts of 16 fresh prompts of 870-1,180 tokens arriving together,
128 tokens out, one after the other. For each burst: every request's TTFT, each step's wall
time, the Triton kernels compiled during it (new entries in a fresh TRITON_CACHE_DIR), the
device allocations the caching allocator made, and under --profile the slowest Python
functions of the first and last bursts (cProfile, both profiled alike).

  TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python bench/first_burst.py [--bursts 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from bench.common import gpu_state, machine_info, random_llama3_8b, write_json
from ringserve.config import EngineConfig
from ringserve.engine.engine import LLMEngine
from ringserve.sampling_params import SamplingParams


def triton_root() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


def triton_kernels() -> set[str]:
    """The compiled kernels in the Triton cache: (cache entry, kernel name) strings."""
    root = triton_root()
    found = set()
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        for name in os.listdir(os.path.join(root, entry)):
            if name.endswith(".json") and not name.startswith("__grp__"):
                found.add(f"{entry}/{name[:-5]}")
    return found


def kernel_variant(key: str) -> str:
    """What a compiled kernel was specialised on (its cache entry's metadata, abridged)."""
    try:
        with open(os.path.join(triton_root(), key + ".json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return key
    keep = {k: meta[k] for k in ("name", "constants", "num_warps", "num_stages", "launch_pdl") if k in meta}
    return json.dumps(keep)[:600]


def burst(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, profile: bool) -> dict:
    """All prompts added at once; stepped to the end -> TTFTs, step times, compiles, allocations."""
    kernels, allocs = triton_kernels(), torch.cuda.memory_stats().get("num_device_alloc", 0)
    profiler = cProfile.Profile() if profile else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        for p in prompts
    ]
    first, steps = {}, []
    if profiler:
        profiler.enable()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(round((now - step_start) * 1000, 2))
        for out in outputs:
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = (now - start) * 1000
    if profiler:
        profiler.disable()
    end = time.perf_counter()
    ttfts = sorted(first.values())
    result = {
        "requests": len(ids),
        "ttft_ms": [round(t, 1) for t in ttfts],
        "last_ttft_ms": ttfts[-1],
        "total_ms": (end - start) * 1000,
        "step_ms": steps,
        "new_triton_kernels": [kernel_variant(k) for k in sorted(triton_kernels() - kernels)],
        "device_allocations": torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs,
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        result["profile"] = text.getvalue()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    data = {"machine": machine_info(), "gpu_state": gpu_state(), "bursts": []}
    print(data["machine"], data["gpu_state"], flush=True)
    if triton_kernels():
        print(
            f"warning: the Triton cache {triton_root()} is not empty: kernels found there load "
            "instead of compiling, and the compiles this bench looks for do not show",
            flush=True,
        )
    folder, weights = random_llama3_8b()
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, 40000, (n,), generator=g).tolist()

    start = time.monotonic()
    engine = LLMEngine(folder, device="cuda", dtype="bfloat16", weights=weights, engine_config=EngineConfig())
    data["build_s"] = time.monotonic() - start
    data["kernels_after_build"] = len(triton_kernels())
    print(
        f"engine built in {data['build_s']:.1f} s, {data['kernels_after_build']} Triton kernels", flush=True
    )
    data["warm_up"] = burst(engine, [prompt(1024)], 8, profile=False)
    print("warm-up request:", {k: v for k, v in data["warm_up"].items() if k != "step_ms"}, flush=True)
    for i in range(args.bursts):
        lengths = torch.randint(870, 1181, (args.width,), generator=g).tolist()
        profile = args.profile and i in (0, args.bursts - 1)
        result = burst(engine, [prompt(n) for n in lengths], args.max_tokens, profile)
        result["prompt_tokens"] = sum(lengths)
        data["bursts"].append(result)
        print(
            f"burst {i}: {sum(lengths)} prompt tokens, TTFT p50 {result['ttft_ms'][len(lengths) // 2]:.0f} "
            f"last {result['last_ttft_ms']:.0f} ms, total {result['total_ms']:.0f} ms, "
            f"first steps {result['step_ms'][:6]} ms, new kernels {result['new_triton_kernels']}, "
            f"device allocations {result['device_allocations']}",
            flush=True,
        )
        if "profile" in result:
            print(result["profile"][:6000], flush=True)
    bound = burst(
        engine, [prompt(n) for n in torch.randint(870, 1181, (args.width,), generator=g).tolist()], 1, False
    )
    data["bound_one_token"] = bound
    print(
        f"the same burst with one token out (its prefill bound): last TTFT {bound['last_ttft_ms']:.0f} ms",
        flush=True,
    )
    engine.close()
    write_json("first_burst.json", data)


if __name__ == "__main__":
    main()
