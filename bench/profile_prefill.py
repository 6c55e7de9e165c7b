"""Where a short prefill's time goes (one GPU, Llama-3-8B shape, random bf16): time to first
token of a fresh prompt through the engine, with async scheduling on and off, against the
model's forward alone on the same tokens; then the host ops and kernels of one prefill.

  python bench/profile_prefill.py [--lengths 1024 2048] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_llama3_8b, wall_ms  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.engine.engine import LLMEngine  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--trace-dir", default=os.environ.get("OUT"))
    # bench_decode.py sizes its engine for 128K prompts and 64 x 1K batches: the same here
    # shows whether a short prefill pays for the engine's size.
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--kv-gib", type=float, default=8)
    args = parser.parse_args()
    folder, weights = random_llama3_8b()
    engine = LLMEngine(
        folder,
        device="cuda",
        dtype="bfloat16",
        weights=weights,
        engine_config=EngineConfig(
            max_model_len=args.max_model_len or max(args.lengths) + 64,
            max_num_batched_tokens=args.max_num_batched_tokens or max(args.lengths) + 64,
            max_num_seqs=64,
            kv_cache_memory=int(args.kv_gib * (1 << 30)),
            enable_prefix_caching=False,
        ),
    )
    del weights
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prefill_once(length: int) -> int:
        engine.add_request(torch.randint(1000, 100000, (length,), generator=g).tolist(), params)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return steps

    for length in args.lengths:
        for mode in (True, False):
            engine.async_scheduling = mode
            prefill_once(length)
            steps = prefill_once(length)
            ms = statistics.median(wall_ms(lambda n=length: prefill_once(n)) for _ in range(args.reps))
            print(
                f"{length} tokens, async_scheduling={mode}: {ms:7.2f} ms in {steps} engine steps", flush=True
            )
        engine.async_scheduling = True
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            prefill_once(length)
            torch.cuda.synchronize()
        if args.trace_dir:
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"prefill_{length}.json"))
        events = list(prof.key_averages())
        cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        cuda.sort(key=lambda e: -e.device_time_total)
        print(
            f"  kernels: {sum(e.count for e in cuda)}, device time {sum(e.device_time_total for e in cuda) / 1000:.2f} ms"
        )
        for e in cuda[:12]:
            print(f"  {e.device_time_total / 1000:7.3f} ms  x{e.count:4d}  {e.key[:90]}")
        host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        host.sort(key=lambda e: -e.cpu_time_total)
        print("  host ops by total time:")
        for e in host[:25]:
            print(
                f"  {e.cpu_time_total / 1000:7.3f} ms (self {e.self_cpu_time_total / 1000:6.3f})  x{e.count:4d}  {e.key[:80]}"
            )
    engine.close()


if __name__ == "__main__":
    main()
