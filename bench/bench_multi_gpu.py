"""Issue 6's multi-GPU measurements, for a machine with several GPUs (one process per GPU).

  python bench/bench_multi_gpu.py [--sections allreduce tp cp ep] [--max-gpus N]
  python bench/bench_multi_gpu.py --smoke     # the same code on gloo CPU ranks, tiny shapes

Writes $OUT/multi_gpu.json and prints a table per section:
- allreduce: torch (NCCL) / one_shot / two_shot latency, 4 KB-64 MB, eager and replayed from
  a CUDA graph, per world size; stores the thresholds `auto` then uses.
- tp: Llama-3-8B-shaped model (random bf16, saved once to local disk): TTFT for 1K/8K prompts
  and decode time per token at batch 1, tp = 1, 2, 4, 8.
- cp: the same model, TTFT from 32K up to 1M tokens at cp = 1, 2, 4, 8 (parallel efficiency
  against cp = 1), and decode time per token under CP against TP.
- ep: dispatch + combine latency of a Mixtral-sized layer's tokens at decode sizes, flat and
  two-shot (two virtual hosts), ep = 2 .. N.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, write_json  # noqa: E402

from ringserve import LLM, SamplingParams  # noqa: E402
from ringserve.model.decoder import Experts  # noqa: E402
from ringserve.parallel.allreduce import AllReduce, save_thresholds  # noqa: E402
from ringserve.parallel.allreduce_bench import ALGORITHMS, thresholds_from  # noqa: E402
from ringserve.parallel.ep import ExpertParallel  # noqa: E402
from ringserve.parallel.local_world import collective_latency_us, run_local_world  # noqa: E402


def _allreduce_rank(rank, world, sizes, device_type, iters):
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    ops = {a: AllReduce(dist.group.WORLD, a, device) for a in ALGORITHMS}
    out = {}
    for nbytes in sizes:
        x = torch.randn(
            max(1, nbytes // torch.empty((), dtype=dtype).element_size()), device=device, dtype=dtype
        )
        for name, op in ops.items():
            modes = {"eager": lambda op=op, x=x: op(x)}
            if device_type == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    op(x)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    op(x)
                modes["graph"] = graph.replay
            for mode, fn in modes.items():
                out[(nbytes, name, mode)] = collective_latency_us(fn, iters, device_type)
    return out


def bench_allreduce(gpus, device_type, smoke):
    sizes = [4 << 10, 64 << 10] if smoke else [4 << 10 << i for i in range(15)]  # 4 KB .. 64 MB
    rows = []
    for world in [w for w in (2, 4, 8) if w <= gpus]:
        lat = run_local_world(
            _allreduce_rank,
            world,
            sizes,
            device_type,
            3 if smoke else 50,
            device_type=device_type,
            timeout_s=600,
        )[0]
        modes = ("eager", "graph") if device_type == "cuda" else ("eager",)
        for mode in modes:
            print(f"\nallreduce, {world} ranks, {mode} (us)")
            print(f"{'bytes':>10s} " + " ".join(f"{a:>9s}" for a in ALGORITHMS) + "  best/torch")
            for n in sizes:
                vals = [lat[(n, a, mode)] for a in ALGORITHMS]
                print(f"{n:10d} " + " ".join(f"{v:9.1f}" for v in vals) + f"  {vals[0] / min(vals):9.2f}")
                rows.append({"world": world, "mode": mode, "bytes": n, **dict(zip(ALGORITHMS, vals))})
        thresholds = thresholds_from({(n, a): lat[(n, a, "eager")] for n in sizes for a in ALGORITHMS}, sizes)
        print(f"auto thresholds at {world} ranks: {thresholds}")
        if not smoke:
            save_thresholds(device_type, world, thresholds)
    return rows


def _model_folder(smoke):
    """A Llama-3-8B-shaped checkpoint with random bf16 weights on local disk (tiny for smoke)."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(tempfile.gettempdir(), "ringserve-bench-model" + ("-smoke" if smoke else ""))
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    if smoke:
        from ringserve.model.tiny_models import save_tiny_model

        return save_tiny_model("llama", folder)
    from common import llama3_8b_config

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama3_8b_config(), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def _ttft_ms(llm, length, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (length,), generator=g).tolist()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return (time.perf_counter() - start) * 1000


def _decode_ms(llm, steps):
    prompt = list(range(1, 200))
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    total = (time.perf_counter() - start) * 1000
    return (total - _ttft_ms(llm, 199, 1)) / steps


def bench_tp_cp(gpus, device_type, smoke, axis):
    folder = _model_folder(smoke)
    lengths = (
        [64, 128] if smoke else ([1024, 8192] if axis == "tp" else [32768, 131072, 262144, 524288, 1048576])
    )
    rows = []
    for n in [w for w in (1, 2, 4, 8) if w <= gpus]:
        kwargs = {
            axis: n,
            "max_model_len": max(lengths) + 256,
            "enable_prefix_caching": False,
            "max_num_batched_tokens": max(lengths) + 256,
            "block_size": 16 if smoke else 256,
        }
        with LLM(folder, device=device_type, dtype="float32" if smoke else "bfloat16", **kwargs) as llm:
            for length in lengths:
                _ttft_ms(llm, length, 0)  # warm-up
                ms = min(_ttft_ms(llm, length, s) for s in (2, 3))
                rows.append({"axis": axis, "n": n, "tokens": length, "ttft_ms": ms})
                print(f"{axis}={n} TTFT {length:8d}: {ms:10.1f} ms", flush=True)
            ms = _decode_ms(llm, 8 if smoke else 64)
            rows.append({"axis": axis, "n": n, "decode_ms_per_token": ms})
            print(f"{axis}={n} decode: {ms:.2f} ms/token", flush=True)
    base = {r["tokens"]: r["ttft_ms"] for r in rows if r.get("n") == 1 and "tokens" in r}
    for r in rows:
        if "tokens" in r and r["tokens"] in base:
            r["parallel_efficiency"] = base[r["tokens"]] / (r["ttft_ms"] * r["n"])
    return rows


def _ep_rank(rank, world, tokens_list, device_type, hidden, iters):
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    num_experts = 8 if world <= 8 else world
    experts = Experts(num_experts // world, hidden, 64).to(device=device, dtype=dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    out = {}
    for two_shot in (False, True):
        if two_shot and world < 4:
            continue
        ep = ExpertParallel(
            dist.group.WORLD, num_experts, ranks_per_host=world // 2 if two_shot else None, two_shot=two_shot
        )
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype)
            ids = torch.stack([torch.randperm(num_experts, device=device)[:2] for _ in range(tokens)])
            w = torch.full((tokens, 2), 0.5, device=device, dtype=dtype)
            out[("two_shot" if two_shot else "flat", tokens)] = collective_latency_us(
                lambda x=x, ids=ids, w=w, ep=ep: ep(experts, x, ids, w), iters, device_type
            )
    return out


def bench_ep(gpus, device_type, smoke):
    rows = []
    hidden = 64 if smoke else 4096
    tokens_list = [1, 8] if smoke else [1, 4, 16, 64, 128]
    for world in [w for w in (2, 4, 8) if w <= gpus]:
        lat = run_local_world(
            _ep_rank,
            world,
            tokens_list,
            device_type,
            hidden,
            3 if smoke else 30,
            device_type=device_type,
            timeout_s=600,
        )[0]
        for (kind, tokens), us in sorted(lat.items()):
            rows.append(
                {"ep": world, "all_to_all": kind, "tokens_per_rank": tokens, "dispatch_combine_us": us}
            )
            print(f"ep={world} {kind:8s} {tokens:4d} tokens/rank: {us:9.1f} us", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", default=["allreduce", "tp", "cp", "ep"])
    parser.add_argument("--max-gpus", type=int, default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="gloo CPU ranks and tiny shapes (checks the script)"
    )
    args = parser.parse_args()
    device_type = "cpu" if args.smoke else "cuda"
    gpus = args.max_gpus or (2 if args.smoke else torch.cuda.device_count())
    results = {"machine": machine_info() if not args.smoke else {}, "gpus": gpus}
    if "allreduce" in args.sections:
        results["allreduce"] = bench_allreduce(gpus, device_type, args.smoke)
    for axis in ("tp", "cp"):
        if axis in args.sections:
            results[axis] = bench_tp_cp(gpus, device_type, args.smoke, axis)
    if "ep" in args.sections:
        results["ep"] = bench_ep(gpus, device_type, args.smoke)
    write_json("multi_gpu.json", results)


if __name__ == "__main__":
    main()
