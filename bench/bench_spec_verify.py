"""What a speculative-decoding verify step costs on the GPU against a decode step (issue 30's
target: the k=4 verify step at most 1.15x a single-token decode step, Llama-3-8B shape, bf16,
batch 1, 1K context). One engine with prompt lookup on; its drafter is replaced by one that
gives every decoding sequence k drafts each step (random weights would keep too few to time
by themselves), or none for the decode steps. Both are the engine's own steps (CUDA graphs,
verify steps replaying the decode graphs with a row per new token), timed over 32 steps
after a 1K prompt.

--draft also times a step with a draft model of Llama-3.2-1B's shape (random bf16 weights,
saved to a temporary folder): its k passes (graphs), the read of its drafts, and the verify
step, with k drafts forced each step (random weights keep none, which would make adaptive k
draft one); and the speed-up that step predicts for a draft whose guesses are each kept with
probability a: (1 - a^(k+1)) / (1 - a) tokens a step for (draft step / decode step) the time.

--eagle times the same with an EAGLE-3 head for Llama-3-8B (random bf16 weights in the
published layout, a 32K draft vocabulary).

  python bench/bench_spec_verify.py [--context 1024] [--k 2 4 8] [--batch 1 16] [--eager]
                                    [--draft] [--eagle] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_decode import prompt_batch, timed_ms  # noqa: E402
from common import machine_info, random_llama3_8b  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402


def forced_drafts(k: int):
    """A drafter's propose_all that gives each decoding sequence k drafts (0: none)."""

    def propose_all(running, max_context, drafting=True):
        for seq in running:
            decoding = seq.num_uncomputed_tokens == 1 and not seq.ends_when_read
            room = seq.params.max_tokens - len(seq.output_token_ids) - 1
            seq.draft_token_ids = [1000 + i for i in range(min(k, room))] if decoding else []

    return propose_all


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    parser.add_argument("--draft", action="store_true", help="also a draft model of Llama-3.2-1B's shape")
    parser.add_argument("--eagle", action="store_true", help="also an EAGLE-3 head")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from ringserve.engine.engine import LLMEngine
    from ringserve.options import EngineOptions

    device = torch.device("cuda")
    folder, weights = random_llama3_8b()
    config = EngineConfig(max_model_len=args.context + 512, kv_cache_memory=8 << 30, enforce_eager=args.eager)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": max(args.k)})
    options = EngineOptions.from_configs(
        config, model=folder, device="cuda", dtype="bfloat16", speculative_config=spec
    )
    engine = LLMEngine.from_options(options, weights=weights)
    result = {"machine": machine_info(), "args": vars(args), "decode_ms": {}, "verify_ms": {}}

    def step_ms(batch: int, k: int, seed: int) -> float:
        engine.drafter.propose_all = forced_drafts(k)
        return timed_steps(engine, batch, k, seed, args.context, device)

    for batch in args.batch:
        decode = step_ms(batch, 0, batch)
        result["decode_ms"][batch] = decode
        for k in args.k:
            verify = step_ms(batch, k, 100 * batch + k)
            result["verify_ms"][f"{batch}_k{k}"] = verify
            print(
                f"batch {batch}, context {args.context}: decode {decode:.3f} ms, verify k={k} "
                f"({k + 1} tokens a sequence) {verify:.3f} ms = {verify / decode:.2f}x",
                flush=True,
            )
    engine.close()
    engine = weights = None  # the memory back for the next engine
    torch.cuda.empty_cache()
    for method in ["draft_model"] * args.draft + ["eagle3"] * args.eagle:
        result[f"{method}_ms"] = draft_steps(args, config, folder, device, result["decode_ms"], method)
    with open(os.path.join(args.out, "spec_verify.json"), "w") as f:
        json.dump(result, f, indent=1)


def timed_steps(engine, batch: int, k: int, seed: int, context: int, device) -> float:
    """ms a step of `batch` sequences decoding after a `context`-token prompt (k: drafts)."""
    params = SamplingParams(max_tokens=8 + 40 * (k + 1), temperature=0, ignore_eos=True)
    ids = [engine.add_request(p.tolist(), params) for p in prompt_batch(batch, context, seed, 128256)]
    for _ in range(6):  # the prefill, then warm-up steps
        engine.step()
    ms = timed_ms(lambda: [engine.step() for _ in range(32)], device) / 32
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return ms


def draft_steps(args, config, folder: str, device, decode_ms: dict, method: str) -> dict:
    """ms a step with a draft model of Llama-3.2-1B's shape (or an EAGLE-3 head) and k forced
    drafts, and the speed-up it predicts at several acceptance rates."""
    import tempfile

    from common import llama3_8b_config, llama32_1b_config, random_eagle3_head, random_model_folder

    from ringserve.engine.engine import LLMEngine
    from ringserve.options import EngineOptions

    if method == "eagle3":
        draft = random_eagle3_head(llama3_8b_config(), tempfile.mkdtemp())
    else:
        draft = random_model_folder(llama32_1b_config(), tempfile.mkdtemp())
    _, weights = random_llama3_8b()
    spec = {"method": method, "model": draft, "num_speculative_tokens": max(args.k)}
    options = EngineOptions.from_configs(
        config, model=folder, device="cuda", dtype="bfloat16", speculative_config=spec
    )
    engine = LLMEngine.from_options(options, weights=weights)
    out = {}
    for batch in args.batch:
        for k in args.k:
            drafter = engine.drafter
            drafter.num_drafts = lambda seq, max_context, k=k: (
                min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
                if seq.num_uncomputed_tokens == 1 and not seq.ends_when_read
                else 0
            )
            ms = timed_steps(engine, batch, k, 300 * batch + k, args.context, device)
            decode = decode_ms[batch]
            predicted = {a: (1 - a ** (k + 1)) / (1 - a) * decode / ms for a in (0.5, 0.6, 0.7, 0.8, 0.9)}
            out[f"{batch}_k{k}"] = {"ms": ms, "predicted_speedup": predicted}
            print(
                f"batch {batch}: {method} + verify, k={k}: {ms:.3f} ms a step = "
                f"{ms / decode:.2f}x decode; predicted speed-up at acceptance "
                + ", ".join(f"{a}: {v:.2f}x" for a, v in predicted.items()),
                flush=True,
            )
    engine.close()
    return out


if __name__ == "__main__":
    main()
