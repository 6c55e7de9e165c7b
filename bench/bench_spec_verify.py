"""What a speculative-decoding verify step costs on the GPU against a decode step (issue 30's
target: the k=4 verify step at most 1.15x a single-token decode step, Llama-3-8B shape, bf16,
batch 1, 1K context). A verify step is the last token and k drafts of each sequence, k + 1
new tokens reading the cached context in place: the same step as a prompt of 1K + k + 1
tokens whose first 1K are in the prefix cache, which is what is timed here (random weights
keep no drafts, so the engine's own verify steps are timed by shape). The decode step is
the engine's (CUDA graph) at the same context.

  python bench/bench_spec_verify.py [--context 1024] [--k 4] [--batch 1 16] [--eager] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_decode import prompt_batch, timed_ms  # noqa: E402
from common import machine_info, random_llama3_8b  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k", type=int, nargs="*", default=[4])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument(
        "--eager", action="store_true", help="no CUDA graphs for decode either (enforce_eager)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from ringserve.engine.engine import LLMEngine

    device = torch.device("cuda")
    folder, weights = random_llama3_8b()
    config = EngineConfig(max_model_len=args.context + 256, kv_cache_memory=8 << 30, enforce_eager=args.eager)
    engine = LLMEngine(folder, device=device, dtype=torch.bfloat16, engine_config=config, weights=weights)
    result = {"machine": machine_info(), "args": vars(args), "decode_ms": {}, "verify_ms": {}}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for batch in args.batch:
        # decode: the engine's steps at this context, after warm-up
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        ids = [
            engine.add_request(p.tolist(), params) for p in prompt_batch(batch, args.context, batch, 128256)
        ]
        for _ in range(8):
            engine.step()
        decode = timed_ms(lambda: [engine.step() for _ in range(32)], device) / 32
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        result["decode_ms"][batch] = decode
        # verify: k + 1 new tokens a sequence after its cached context
        prefixes = [p.tolist() for p in prompt_batch(batch, args.context, 100 + batch, 128256)]
        for prefix in prefixes:
            engine.add_request(prefix, one)
        while engine.has_unfinished():
            engine.step()
        for k in args.k:
            times = []
            for trial in range(12):
                tails = prompt_batch(batch, k + 1, 1000 * k + trial, 128256)
                for prefix, tail in zip(prefixes, tails):
                    engine.add_request(prefix + tail.tolist(), one)
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1000)
                while engine.has_unfinished():
                    engine.step()
            verify = statistics.median(times[2:])
            result["verify_ms"][f"{batch}_k{k}"] = verify
            print(
                f"batch {batch}, context {args.context}: decode {decode:.3f} ms, verify k={k} "
                f"({k + 1} tokens a sequence) {verify:.3f} ms = {verify / decode:.2f}x",
                flush=True,
            )
    with open(os.path.join(args.out, "spec_verify.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
