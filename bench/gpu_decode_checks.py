"""Correctness of decode with CUDA graphs before any timing (run before bench_decode.py):

  python bench/gpu_decode_checks.py            # CUDA, float32; exits non-zero on a failure
  python bench/gpu_decode_checks.py --smoke    # CPU, fewer steps: the logic only

For each tiny architecture of ringserve/model/tiny_models.py, in float32:
- greedy tokens over 256 decode steps (ignore_eos) with CUDA graphs and async scheduling
  equal those with enforce_eager=True and synchronous steps, at batch 1, 3 and 17 with prompts of different lengths, and at batch 17
  with staggered max_tokens (the batch shrinks from 17 to 1 as sequences finish, so many graph
  sizes are replayed); prompt + 256 stays under the models' 512 positions;
- a graph replay (batch 3 padded to the bucket of 4) is bitwise equal (torch.equal) to the
  same padded forward run eagerly on the same static inputs;
- the logits of the first decode step (engine.step, batch 3, captured where they are
  sampled) with graphs are within 1e-4 of the unpadded eager step (padding changes the
  matmuls' shapes, so their rounding may differ).
tp=1 is the in-process executor: the multi-rank path is not run here (bench/gpu_tp_check.py
runs tp=1 under torchrun).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from bench_decode import engine_config, engine_kwargs, has_enforce_eager  # noqa: E402

import ringserve.engine.engine as engine_module  # noqa: E402
from ringserve import LLM, SamplingParams  # noqa: E402
from ringserve.engine.engine import LLMEngine  # noqa: E402
from ringserve.model.tiny_models import ARCHITECTURES, save_tiny_model  # noqa: E402

KV_CACHE_MEMORY = 256 << 20  # plenty for the tiny models; leaves the GPU to the rest

failures: list[str] = []


def report(ok: bool | None, what: str, detail: str = "") -> None:
    word = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    print(f"{word} {what}{': ' + detail if detail else ''}", flush=True)
    if ok is False:
        failures.append(what)


def cases(max_tokens: int) -> dict[str, list[tuple[list[int], int]]]:
    """name -> [(prompt, max_tokens)], prompts of different lengths, all within 512 positions."""
    g = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    return {
        "batch 1": [(prompt(37), max_tokens)],
        "batch 3": [(prompt(n), max_tokens) for n in (5, 120, 250)],
        "batch 17": [(prompt(3 + 14 * i), max_tokens) for i in range(17)],
        "batch 17, staggered max_tokens": [
            (prompt(10 + 13 * i), max_tokens - i * (max_tokens // 17)) for i in range(17)
        ],
    }


def greedy(folder: str, device: str, eager: bool, work) -> dict[str, list[list[int]]]:
    """Graphs run with async scheduling (the GPU default), eager without: both change at once."""
    kw = engine_kwargs(enforce_eager=eager, kv_cache_memory=KV_CACHE_MEMORY, async_scheduling=not eager)
    with LLM(folder, device=device, dtype="float32", tp=1, **kw) as llm:
        out = {}
        for name, reqs in work.items():
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
            results = llm.generate([p for p, _ in reqs], params)
            out[name] = [r.token_ids for r in results]
            for r, (_, m) in zip(results, reqs):
                assert len(r.token_ids) == m, f"{name}: {len(r.token_ids)} tokens, {m} asked for"
    return out


def first_decode_logits(folder: str, device: str, eager: bool, prompts) -> torch.Tensor | None:
    """The logits the engine samples from at the first decode step of a batch, as computed
    through engine.step (the graph path), captured at the sampler."""
    engine = LLMEngine(
        folder,
        device=device,
        dtype="float32",
        engine_config=engine_config(enforce_eager=eager, kv_cache_memory=KV_CACHE_MEMORY),
    )
    captured = []
    original = engine_module.sample_on_device

    def recording_sample(logits, seqs):
        captured.append(logits.detach().clone())
        return original(logits, seqs)

    engine_module.sample_on_device = recording_sample
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prompts
        engine.step()  # the first decode step
        while engine.has_unfinished():  # its tokens (read one call later with async scheduling)
            engine.step()
    finally:
        engine_module.sample_on_device = original
        engine.close()
    return captured[1] if len(captured) == 2 else None


def replay_and_padded_eager(folder: str, device: str, prompts):
    """The logits of a graph replay, and of the same padded bucket's forward run eagerly
    on the same static inputs: these must be bitwise equal."""
    engine = LLMEngine(
        folder, device=device, dtype="float32", engine_config=engine_config(kv_cache_memory=KV_CACHE_MEMORY)
    )
    try:
        graphs = engine.executor.worker.runner.graphs
        if graphs is None or not graphs.graphs:
            return None, None
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prompts
        engine.step()  # the first decode step: a replay of the bucket
        bucket, one_block = graphs.graph_key(len(prompts), max(map(len, prompts)) + 1)
        replayed = graphs.logits[:bucket].clone()
        with torch.inference_mode():
            eager = graphs._forward(bucket, one_block).clone()
        return replayed, eager
    finally:
        engine.close()


def compare_logits(what: str, graphs: torch.Tensor | None, eager: torch.Tensor | None) -> None:
    if graphs is None or eager is None:
        report(None, what, "the logits were not captured (the step path has changed)")
        return
    if graphs.shape != eager.shape:
        report(False, what, f"shapes differ: {tuple(graphs.shape)} and {tuple(eager.shape)}")
        return
    diff = (graphs - eager).abs().max().item()
    report(torch.equal(graphs, eager), what, f"max abs diff {diff:.1e}, shape {tuple(graphs.shape)}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, 16 decode steps: the logic only")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)  # a shared 2-core host: no thread oversubscription
    max_tokens = 16 if args.smoke else 256
    if not has_enforce_eager():
        msg = "EngineConfig has no enforce_eager field: graphs and eager are one path, nothing is compared"
        if args.smoke:
            print(f"WARNING: {msg} (smoke: the checks run all the same)")
        else:
            report(False, "enforce_eager", msg)
    print(
        "NOTE: tp=1 runs in this process (LocalExecutor): the multi-rank executor is not exercised "
        "here; bench/gpu_tp_check.py runs tp=1 under torchrun",
        flush=True,
    )
    work = cases(max_tokens)
    logit_prompts = [p for p, _ in work["batch 3"]]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            folder = save_tiny_model(arch, f"{tmp}/{arch}")
            graphs, eager = greedy(folder, device, False, work), greedy(folder, device, True, work)
            for name in work:
                same = [g == e for g, e in zip(graphs[name], eager[name])]
                first_diff = next(
                    (
                        f"sequence {i}: first difference at token "
                        f"{next(j for j, (a, b) in enumerate(zip(graphs[name][i], eager[name][i])) if a != b)}"
                        for i, ok in enumerate(same)
                        if not ok
                    ),
                    "",
                )
                steps = max(m for _, m in work[name])
                report(
                    all(same),
                    f"{arch:9s} {device} fp32 greedy graphs == eager, {name}, {steps} steps",
                    first_diff or f"{sum(len(t) for t in graphs[name])} tokens equal",
                )
            compare_logits(
                f"{arch:9s} graph replay == eager forward of the same padded bucket (batch 3 in 4)",
                *replay_and_padded_eager(folder, device, logit_prompts),
            )
            graph_logits = first_decode_logits(folder, device, False, logit_prompts)
            eager_logits = first_decode_logits(folder, device, True, logit_prompts)
            if graph_logits is not None and eager_logits is not None:
                # Padding changes the matmuls' shapes (M = 4, not 3): rounding may differ.
                diff = (graph_logits - eager_logits).abs().max().item()
                report(
                    diff < 1e-4,
                    f"{arch:9s} first decode step, graphs vs unpadded eager (engine.step, batch 3)",
                    f"max abs diff {diff:.1e}",
                )
    if failures:
        print(f"GPU DECODE CHECKS FAILED: {len(failures)}", flush=True)
        for f in failures:
            print(f"  {f}")
        sys.exit(1)
    print("GPU DECODE CHECKS PASSED" + (" (smoke: CPU)" if args.smoke else ""))


if __name__ == "__main__":
    main()
