"""Where a decode step's time goes (one GPU, Llama-3-8B shape, random bf16): the engine's
whole step against its graph replay alone (the difference is host work not overlapped with
the device), and the kernels of one replay by device time.

  python bench/profile_decode.py [--batch 1 16 64] [--context 1024] [--max-model-len N --kv-gib G]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_llama3_8b  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.engine.engine import LLMEngine  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402


def per_step_ms(fn, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument(
        "--max-model-len", type=int, help="size the engine for this context (default: just the run's)"
    )
    parser.add_argument("--kv-gib", type=float, default=8.0)
    parser.add_argument("--trace-dir", default=os.environ.get("OUT"), help="chrome traces of 8 engine steps")
    args = parser.parse_args()
    folder, weights = random_llama3_8b()
    engine = LLMEngine(
        folder,
        device="cuda",
        dtype="bfloat16",
        weights=weights,
        engine_config=EngineConfig(
            max_model_len=args.max_model_len or args.context + 2 * args.steps + 64,
            max_num_batched_tokens=max(args.batch) * args.context + 64,
            max_num_seqs=max(args.batch),
            kv_cache_memory=int(args.kv_gib * (1 << 30)),
            enable_prefix_caching=False,
        ),
    )
    del weights
    runner = engine.executor.worker.runner
    params = SamplingParams(max_tokens=2 * args.steps + 16, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for _ in range(batch):
            engine.add_request(torch.randint(1000, 100000, (args.context,), generator=g).tolist(), params)
        for _ in range(4):
            engine.step()
        step_ms = per_step_ms(engine.step, args.steps)
        engine.async_scheduling = False  # the same engine, each step's tokens read before the next
        sync_ms = per_step_ms(engine.step, args.steps)
        engine.async_scheduling = True
        graphs = runner.graphs
        graph = graphs.graphs[graphs.graph_key(batch, args.context + args.steps)]
        replay_ms = per_step_ms(graph.replay, args.steps)
        print(
            f"batch {batch:3d}: engine.step {step_ms:6.2f} ms (async scheduling), {sync_ms:6.2f} ms "
            f"(synchronous), graph replay alone {replay_ms:6.2f} ms"
        )
        if args.trace_dir:  # the whole engine.step, host and device, to find the device's idle gaps
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                for _ in range(8):
                    engine.step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"decode_steps_b{batch}.json"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 5 / 1000
        count = sum(e.count for e in events) / 5
        print(f"  kernels per replay {count:.0f}, device time {total:.2f} ms")
        for e in events[:14]:
            print(f"  {e.device_time_total / 5 / 1000:7.3f} ms  x{e.count / 5:5.0f}  {e.key[:90]}")
        while engine.has_unfinished():
            engine.step()
    engine.close()


if __name__ == "__main__":
    main()
