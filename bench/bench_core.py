"""Issue 2's GPU figures: a Llama-3-8B-shaped model with random bf16 weights, ringserve
against Hugging Face transformers in the same run, and both against the roofline.

  python bench/bench_core.py            # writes $OUT/bench_core.json and prints a table

Prefill: time to first token for one prompt of 1K, 8K, 32K tokens (prompt in, first token
out, the KV cache written). Decode: time per token at batch 1 and 16 after 1K-token prompts.
Roofline: prefill FLOPs over the measured bf16 matmul rate; decode bytes (weights read
once per step, plus the KV cache read) over the measured copy bandwidth.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_time_ms, llama3_8b_config, machine_info, measure_ceilings, write_json  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402
from ringserve.engine.engine import LLMEngine  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402

PREFILL = [1024, 8192, 32768]
DECODE_BATCHES = [1, 16]
DECODE_PROMPT = 1024
DECODE_STEPS = 32


def prompt_batch(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100000, (batch, length), generator=g)


def roofline(cfg, ceilings):
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, nkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, h // cfg.num_attention_heads
    per_layer = h * (nh * dh) * 2 + h * (nkv * dh) * 2 + 3 * h * inter
    body = layers * per_layer
    head = h * cfg.vocab_size

    def prefill_ms(t):
        flops = 2 * body * t + 2 * head + 2 * 2 * (t * t / 2) * nh * dh * layers
        return flops / ceilings["bf16_matmul_flops"] * 1000

    def decode_ms(batch, context):
        weight_bytes = 2 * (body + head)  # bf16; embedding rows are negligible
        kv_bytes = batch * context * 2 * layers * nkv * dh * 2
        return (weight_bytes + kv_bytes) / ceilings["copy_bytes_per_s"] * 1000

    return prefill_ms, decode_ms


@torch.inference_mode()
def bench_hf(model):
    from transformers import DynamicCache

    results = {"prefill_ms": {}, "decode_ms": {}}
    for t in PREFILL:
        ids = prompt_batch(1, t, seed=t).cuda()

        def run(ids=ids):
            cache = DynamicCache(config=model.config)
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].argmax(-1)

        results["prefill_ms"][t] = cuda_time_ms(run, warmup=1, reps=3)
        print(f"  transformers prefill {t:6d}: {results['prefill_ms'][t]:8.1f} ms", flush=True)
    for batch in DECODE_BATCHES:
        ms = _hf_decode_ms(model, prompt_batch(batch, DECODE_PROMPT, seed=batch).cuda())
        results["decode_ms"][batch] = ms
        print(f"  transformers decode batch {batch:3d}: {ms:8.2f} ms/token", flush=True)
    return results


def _hf_decode_ms(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)

    def step():
        nonlocal token
        out = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(3):
        step()
    return cuda_time_ms(lambda: [step() for _ in range(DECODE_STEPS)], warmup=0, reps=1) / DECODE_STEPS


@torch.inference_mode()
def bench_ringserve(folder, weights):
    results = {"prefill_ms": {}, "decode_ms": {}}
    config = EngineConfig(
        max_model_len=max(PREFILL) + 64,
        max_num_batched_tokens=max(PREFILL) + 64,
        kv_cache_memory=24 << 30,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(folder, device="cuda", dtype="bfloat16", engine_config=config, weights=weights)
    greedy_one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run_to_end():
        while engine.has_unfinished():
            engine.step()

    seeds = iter(range(1000))  # a fresh prompt each time, so nothing is cached
    for t in PREFILL:

        def prefill(t=t):
            engine.add_request(prompt_batch(1, t, seed=t + next(seeds))[0].tolist(), greedy_one)
            run_to_end()

        results["prefill_ms"][t] = cuda_time_ms(prefill, warmup=1, reps=3)
        print(f"  ringserve    prefill {t:6d}: {results['prefill_ms'][t]:8.1f} ms", flush=True)
    for batch in DECODE_BATCHES:
        params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0, ignore_eos=True)
        for row in prompt_batch(batch, DECODE_PROMPT, seed=batch):
            engine.add_request(row.tolist(), params)
        for _ in range(4):  # the prefill step and three decode steps
            engine.step()
        ms = (
            cuda_time_ms(lambda: [engine.step() for _ in range(DECODE_STEPS)], warmup=0, reps=1)
            / DECODE_STEPS
        )
        run_to_end()
        results["decode_ms"][batch] = ms
        print(f"  ringserve    decode batch {batch:3d}: {ms:8.2f} ms/token", flush=True)
    engine.close()
    return results


def main():
    info = machine_info()
    ceilings = measure_ceilings()
    print(
        f"{info}\ncopy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    from transformers import AutoModelForCausalLM

    cfg = llama3_8b_config()
    folder = tempfile.mkdtemp()
    cfg.save_pretrained(folder)  # config only: the weights come from the transformers model
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in hf.parameters())
    print(f"Llama-3-8B-shaped model: {params / 1e9:.2f} B parameters", flush=True)
    hf_results = bench_hf(hf)
    ours = bench_ringserve(folder, hf.state_dict())
    del hf
    gc.collect()
    prefill_roof, decode_roof = roofline(cfg, ceilings)
    rows = []
    print(
        f"\n{'what':28s} {'ringserve':>10s} {'transformers':>12s} {'roofline':>9s} {'ours/roof':>9s} {'hf/ours':>8s}"
    )
    for t in PREFILL:
        o, h, r = ours["prefill_ms"][t], hf_results["prefill_ms"][t], prefill_roof(t)
        rows.append({"what": f"prefill TTFT {t}", "ringserve_ms": o, "transformers_ms": h, "roofline_ms": r})
        print(f"{'prefill TTFT ' + str(t):28s} {o:10.1f} {h:12.1f} {r:9.1f} {r / o:9.2f} {h / o:8.2f}")
    for b in DECODE_BATCHES:
        o, h, r = (
            ours["decode_ms"][b],
            hf_results["decode_ms"][b],
            decode_roof(b, DECODE_PROMPT + DECODE_STEPS),
        )
        rows.append(
            {"what": f"decode ms/token batch {b}", "ringserve_ms": o, "transformers_ms": h, "roofline_ms": r}
        )
        print(
            f"{'decode ms/token batch ' + str(b):28s} {o:10.2f} {h:12.2f} {r:9.2f} {r / o:9.2f} {h / o:8.2f}"
        )
    write_json("bench_core.json", {"machine": info, "ceilings": ceilings, "params": params, "rows": rows})


if __name__ == "__main__":
    main()
