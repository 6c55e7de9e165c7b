"""Issue 14's Llama 4 figures: what chunked attention saves in a long prefill, on one GPU.

  python bench/bench_llama4_chunked.py                 # one H200: writes $OUT/bench_llama4_chunked.json
  python bench/bench_llama4_chunked.py --tiny --device cpu   # a smoke test with tiny shapes

1. Prefill through the engine: Llama 4 text at Scout's attention shapes (40 query / 8 KV heads
   of 128, hidden 5120, chunks of 8192 in three of every four layers, the fourth NoPE with full
   attention; MoE layers of 16 experts + a shared expert), random bf16 weights, a few layers
   (--layers). Time to first token of one prompt of 128K and 512K tokens, against the same
   weights with chunking switched off (every layer full attention).
2. The one-GPU ring model (as bench/bench_ring.py): a 1M-token prompt zigzag-placed over 8
   ranks by the engine's block manager; each rank's attention at each ring step timed in turn
   on this GPU, for a full-attention layer (every step, with the KV transfer at the NVLink
   rate hiding under it or not) and for a chunked layer (only the steps where some query
   sees some key: with chunks inside a rank's zigzag runs, just its own keys, no transfer).
   Predicted TTFT on 8 GPUs = Scout's 12 full layers + 36 chunked layers + the linear
   layers' FLOPs (per token: attention projections, shared expert, top-1 expert) over 8 at
   the measured matmul rate.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, measure_ceilings, write_json  # noqa: E402

from ringserve.attention.dense import attention_rows  # noqa: E402
from ringserve.config import AttentionWindow, EngineConfig  # noqa: E402
from ringserve.engine.block_manager import BlockManager  # noqa: E402
from ringserve.engine.engine import LLMEngine  # noqa: E402
from ringserve.engine.sequence import Sequence  # noqa: E402
from ringserve.parallel.cp.plan import RingStep  # noqa: E402
from ringserve.sampling_params import SamplingParams  # noqa: E402

NVLINK_BYTES_PER_S = 450e9  # H200 NVLink, one direction (as bench_ring.py)
SCOUT_LAYERS, SCOUT_NOPE_EVERY = 48, 4

SCOUT = dict(
    hidden_size=5120,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=8192,  # each expert's and the shared expert's
    intermediate_size_mlp=16384,
    num_local_experts=16,
    num_experts_per_tok=1,
    vocab_size=202048,
    attention_chunk_size=8192,
    rope_parameters={  # Scout's
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=64,
    intermediate_size_mlp=128,
    num_local_experts=4,
    num_experts_per_tok=1,
    vocab_size=512,
    attention_chunk_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def llama4_config(shape: dict, layers: int, chunked: bool, max_len: int):
    from transformers import Llama4TextConfig

    cfg = dict(shape)
    if not chunked:
        cfg["attention_chunk_size"] = None  # the chunked layers' window: none
    return Llama4TextConfig(
        **cfg,
        num_hidden_layers=layers,
        no_rope_layer_interval=SCOUT_NOPE_EVERY,
        interleave_moe_layer_step=1,
        max_position_embeddings=max_len,
        architectures=["Llama4ForCausalLM"],
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_s(fn, device, reps: int) -> float:
    """Best wall time of fn() in seconds (after one warm-up run)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def prefill_once(engine: LLMEngine, tokens: int) -> None:
    """One fresh random prompt (nothing cached) through to its first token."""
    prompt = torch.randint(0, engine.model_config.vocab_size, (tokens,)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


@torch.inference_mode()
def prefill_times(args, device, shape) -> list[dict]:
    """TTFT of one prompt per length, chunked attention on and off, on the same weights."""
    from transformers import AutoModelForCausalLM

    max_len = max(args.tokens) + 16
    folders = {}
    for chunked in (True, False):
        folders[chunked] = tempfile.mkdtemp()
        llama4_config(shape, args.layers, chunked, max_len).save_pretrained(folders[chunked])
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(
            llama4_config(shape, args.layers, True, max_len), dtype=args.dtype
        )
    weights = hf.state_dict()
    params = sum(p.numel() for p in hf.parameters())
    shapes = "tiny" if args.tiny else "Scout's attention"
    print(f"Llama 4 text, {shapes} shapes, {args.layers} layers: {params / 1e9:.2f} B parameters")
    rows = []
    for chunked in (True, False):
        config = EngineConfig(
            max_model_len=max_len,
            max_num_batched_tokens=args.step_tokens or max_len,
            kv_cache_memory=args.kv_cache_gib << 30,
            enable_prefix_caching=False,
        )
        engine = LLMEngine(
            folders[chunked], device=str(device), dtype=args.dtype, engine_config=config, weights=weights
        )
        for tokens in args.tokens:
            seconds = time_s(
                lambda engine=engine, tokens=tokens: prefill_once(engine, tokens), device, args.reps
            )
            rows.append({"tokens": tokens, "chunked": chunked, "ttft_s": seconds})
            print(
                f"  prefill {tokens:8d} tokens, chunked attention {'on ' if chunked else 'off'}: {seconds:8.3f} s",
                flush=True,
            )
        engine.close()
        engine = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del hf, weights
    gc.collect()
    return rows


def ring_step_for(tokens: int, n: int, block: int, window: AttentionWindow) -> RingStep:
    """A whole prompt's step over n ranks, placed by the engine's block manager and CP layout
    (told the window's lookback, as the engine is for a model with local attention)."""
    manager = BlockManager(-(-tokens // block) * n, block, False, n, lookback=window.lookback())
    seq = Sequence("0", [0] * tokens, SamplingParams())
    seq.row = 0
    assert manager.allocate(seq, tokens)
    return RingStep(manager.layout.step([seq], [tokens]), [tokens], n)


def ring_model(args, device, shape, matmul_flops: float) -> dict:
    nh, nkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    n, tokens = args.ring_ranks, args.ring_tokens
    window = AttentionWindow(chunk=shape["attention_chunk_size"])
    step = ring_step_for(tokens, n, args.block, window)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(rows, heads):
        return torch.randn(rows, heads, d, device=device, dtype=args.dtype, generator=g)

    qs = [rand(step.num_queries(r), nh) for r in range(n)]
    ks = [rand(step.num_keys(r), nkv) for r in range(n)]
    vs = [rand(step.num_keys(r), nkv) for r in range(n)]

    def timed(fn):
        return time_s(fn, device, args.reps) * 1000

    # Full attention (the NoPE layers): every ring step, KV transfers overlapped.
    full_ms = [
        [
            timed(
                lambda r=r, s=(r - j) % n: attention_rows(
                    qs[r], ks[s], vs[s], step.varlen(r, s, device), d**-0.5
                )
            )
            for r in range(n)
        ]
        for j in range(n)
    ]
    kv_bytes = max(step.num_keys(r) for r in range(n)) * 2 * nkv * d * torch.finfo(args.dtype).bits // 8
    transfer_ms = kv_bytes / NVLINK_BYTES_PER_S * 1000
    full_layer_ms = sum(max(max(row), transfer_ms if j + 1 < n else 0.0) for j, row in enumerate(full_ms))
    # Chunked layers: as the engine's ring runs them, only the (query rank, key rank) pairs
    # where some query sees some key; a ring distance with no such pair costs nothing.
    work = step.pairs_with_work(window)  # [query rank, key rank]
    chunked_ms = [[0.0] * n for _ in range(n)]
    for j in range(n):
        for r in range(n):
            s = (r - j) % n
            if work[r, s]:
                batch = step.varlen(r, s, device, window)
                chunked_ms[j][r] = timed(
                    lambda r=r, s=s, b=batch: attention_rows(qs[r], ks[s], vs[s], b, d**-0.5)
                )
    visible_steps = int(work.sum())
    chunked_layer_ms = sum(
        max(max(row), transfer_ms if j > 0 and any(row) else 0.0) for j, row in enumerate(chunked_ms)
    )
    # Linear layers per token per layer: q, k, v, o projections, the shared expert, top-k experts.
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    per_layer = h * (nh * d) * 2 + h * (nkv * d) * 2 + 3 * h * inter * (1 + shape["num_experts_per_tok"])
    linear_ms = 2 * per_layer * SCOUT_LAYERS * tokens / n / matmul_flops * 1000
    full_layers = SCOUT_LAYERS // SCOUT_NOPE_EVERY
    chunked_layers = SCOUT_LAYERS - full_layers
    predicted = full_layers * full_layer_ms + chunked_layers * chunked_layer_ms + linear_ms
    unchunked = SCOUT_LAYERS * full_layer_ms + linear_ms
    return {
        "tokens": tokens,
        "cp": n,
        "full_layer_attention_ms": full_layer_ms,
        "chunked_layer_attention_ms": chunked_layer_ms,
        "chunked_visible_steps": visible_steps,
        "transfer_ms_per_step": transfer_ms,
        "linear_ms": linear_ms,
        "predicted_ttft_s": predicted / 1000,
        "predicted_ttft_without_chunking_s": unchunked / 1000,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers in the prefill model")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="prefill lengths")
    parser.add_argument(
        "--step-tokens", type=int, default=None, help="chunked prefill step (default: one step)"
    )
    parser.add_argument("--kv-cache-gib", type=int, default=16)
    parser.add_argument("--ring-tokens", type=int, default=None)
    parser.add_argument("--ring-ranks", type=int, default=8)
    parser.add_argument("--block", type=int, default=256, help="KV block size of the ring layout")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    shape = TINY if args.tiny else SCOUT
    args.tokens = args.tokens or ([256, 1024] if args.tiny else [131072, 524288])
    args.ring_tokens = args.ring_tokens or (2048 if args.tiny else 1 << 20)
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.tiny:
        args.block = min(args.block, 16)
    device = torch.device(args.device)
    if device.type == "cuda":
        info, ceilings = machine_info(), measure_ceilings()
        matmul = ceilings["bf16_matmul_flops"]
    else:
        info, ceilings, matmul = {"device": "cpu"}, {}, 1e11
    print(info, flush=True)
    prefill = prefill_times(args, device, shape)
    for tokens in args.tokens:
        on, off = (
            next(r["ttft_s"] for r in prefill if r["tokens"] == tokens and r["chunked"] == c)
            for c in (True, False)
        )
        print(f"{tokens:8d} tokens: chunked {on:.3f} s, full {off:.3f} s, speedup {off / on:.2f}x")
    ring = ring_model(args, device, shape, matmul)
    print(
        f"ring model, {ring['tokens']} tokens over {ring['cp']} GPUs: full layer {ring['full_layer_attention_ms']:.1f} ms, "
        f"chunked layer {ring['chunked_layer_attention_ms']:.1f} ms ({ring['chunked_visible_steps']} of "
        f"{ring['cp'] ** 2} steps run), linear {ring['linear_ms'] / 1000:.2f} s; predicted TTFT "
        f"{ring['predicted_ttft_s']:.2f} s (without chunking {ring['predicted_ttft_without_chunking_s']:.2f} s)"
    )
    write_json(
        "bench_llama4_chunked.json",
        {
            "machine": info,
            "ceilings": ceilings,
            "args": {k: str(v) for k, v in vars(args).items()},
            "prefill": prefill,
            "ring_model": ring,
        },
    )


if __name__ == "__main__":
    main()
