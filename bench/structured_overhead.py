"""What structured output costs a decode step (issue 27): the engine on the Llama-3-8B-shaped
model of gpu_serve.py (random bf16 weights, the given tokenizer), B requests decoding at once,
free against each following a JSON schema (a list of short strings: a random model walks
through it without ending, so every row stays constrained for the whole run).

Per batch size, the mean time of a decode step (engine.step() with only decodes in it) over
the steps after the prefill, free then constrained, and their ratio; the target is at most
1.05 at batch 64.

  PYTHONPATH=. python bench/structured_overhead.py --tokenizer TOKENIZER_FOLDER [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from gpu_serve import MODEL_DIR, make_model

from ringserve import LLM, SamplingParams, StructuredOutputsParams


def list_schema(max_length: int) -> dict:
    """A list of strings, never complete within the run (every step stays masked). With a
    maxLength, each string state needs llguidance's full token walk (its fast path for string
    bodies does not apply): the costly case; without one, the common case."""
    string = {"type": "string", "maxLength": max_length} if max_length else {"type": "string"}
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": string, "minItems": 1000}},
        "required": ["items"],
    }


def decode_step_times(llm: LLM, batch: int, schema: dict | None, steps: int) -> list[float]:
    engine = llm.engine
    structure = StructuredOutputsParams(json=schema) if schema is not None else None
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 8, temperature=1.0, seed=i, ignore_eos=True, structured_outputs=structure
        )
        engine.add_request([100 + (i * 7 + j) % 1000 for j in range(128)], params)
    # No sync per step: under async scheduling a step's host work overlaps the device's, and
    # the steady gap between step ends is the decode step time that a client sees.
    ends = []
    while engine.has_unfinished():
        prefilling = any(seq.num_computed_tokens < seq.num_tokens - 1 for seq in engine.seqs.values())
        engine.step()
        if not prefilling:
            ends.append(time.perf_counter())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return gaps[2:-2]  # not the first steps after the prefill, nor the tail as rows end


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def check_outputs(llm: LLM, n: int = 16) -> dict:
    """On this device's path (CUDA graphs, async scheduling): n sampled outputs of a bounded
    schema parse, with its keys and types (jsonschema is not on the GPU machine)."""
    structure = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=structure)
        for i in range(n)
    ]
    outs = llm.generate([[100 + i, 200 + i, 300] for i in range(n)], params)
    valid = 0
    for out in outs:
        try:
            value = json.loads(out.text)
        except ValueError:
            continue
        ok = set(value) == {"name", "age", "tags"} and len(value["name"]) <= 12 and 0 <= value["age"] <= 120
        valid += ok and all(t in "abc" for t in value["tags"]) and len(value["tags"]) <= 4
    return {"outputs": n, "valid": valid, "finished_by_stop": sum(o.finish_reason == "stop" for o in outs)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--model-dir", default=MODEL_DIR, help="written once (gpu_serve.py), then reused")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument(
        "--max-lengths", type=int, nargs="*", default=[16, 0], help="the strings' maxLength; 0: none"
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_model(args.tokenizer, args.model_dir)
    result = {}
    with LLM(args.model_dir, max_num_seqs=max(args.batches)) as llm:
        decode_step_times(llm, 2, list_schema(16), 8)  # warm: graphs, the grammar threads, the tokenizer
        for batch in args.batches:
            free = statistics.fmean(decode_step_times(llm, batch, None, args.steps))
            result[f"b{batch}"] = {"free_ms": free * 1e3}
            for max_length in args.max_lengths:
                masked = statistics.fmean(decode_step_times(llm, batch, list_schema(max_length), args.steps))
                result[f"b{batch}"][f"maxLength{max_length}"] = {"ms": masked * 1e3, "ratio": masked / free}
            print(batch, result[f"b{batch}"], flush=True)
        result["check"] = check_outputs(llm)
        print(result["check"], flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
