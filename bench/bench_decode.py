"""The decode issue's figures on one H200, in one run: a Llama-3-8B-shaped model with random
bf16 weights, ringserve (CUDA graphs, and eager) against Hugging Face transformers (eager with
a DynamicCache, and StaticCache + torch.compile(mode="reduce-overhead")), all against the floor.

  python bench/bench_decode.py                      # $OUT/bench_decode.json + .png, table last
  python bench/bench_decode.py --smoke              # CPU, tiny model, a few steps: the logic only
  python bench/bench_decode.py --plot-from bench_decode.json --png bench_decode.png
  python bench/bench_decode.py --short-only         # batch 1/16/64 and the batch-1 peer only

Decode: ms per step (one token for each sequence) at batch 1, 16 and 64 after 1K-token
prompts, and at batch 1 after 32K and 128K-token prompts (128K = 131072 - 128, so that the
prompt and its decode steps stay within the model's 131072 positions); warm-up steps first,
then the timed steps between two device synchronisations. Prefill: ringserve's time to first
token for one prompt of 1K, 8K, 32K, 128K tokens (one engine step each, prefix caching off,
after one untimed prompt of the same length). Floor: (weights read once + every sequence's
KV cache read at the mean context of the timed steps) / the measured copy rate (bytes read +
written per second, as bench_core.py's roofline). Both engines share one set of weights.

The run keeps to --budget-s of wall time (default 450 s): the parts run most important first
(ringserve with graphs, the compiled transformers peer at batch 1, the eager peers), and a
later part is skipped, and listed as skipped, when its estimated time no longer fits. The
JSON is rewritten after every part, so a run stopped early still leaves its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this tree's ringserve, whatever is installed
from common import gpu_state, llama3_8b_config, machine_info, measure_ceilings  # noqa: E402

from ringserve.config import EngineConfig  # noqa: E402

T0 = time.monotonic()


def engine_kwargs(**kw) -> dict:
    """EngineConfig keyword arguments; enforce_eager is dropped, with a warning, while
    EngineConfig has no such field (it is being added alongside the CUDA-graph work)."""
    if "enforce_eager" in kw and not has_enforce_eager():
        if not _warned:
            print(
                "WARNING: EngineConfig has no enforce_eager field yet: every ringserve engine here "
                "runs ringserve's default path (eager before CUDA graphs exist)",
                flush=True,
            )
            _warned.append(True)
        kw.pop("enforce_eager")
    return kw


_warned: list[bool] = []


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**engine_kwargs(**kw))


def has_enforce_eager() -> bool:
    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass
class Shapes:
    batches: list[int]  # decode batch sizes after a short prompt
    short: int  # the short prompt
    long: list[int]  # batch-1 decode contexts beyond the short prompt
    prefill: list[int]  # ringserve TTFT prompt lengths
    steps: int  # timed decode steps
    warm: int  # untimed decode steps first (torch.compile's cudagraph trees record on the 2nd-3rd)


FULL = Shapes([1, 16, 64], 1024, [32768, 131072 - 128], [1024, 8192, 32768, 131072 - 128], 48, 4)
SMOKE = Shapes([1, 3, 5], 32, [96, 200], [32, 64, 96, 200], 4, 3)

# Targets of the decode issue (full run only; the smoke figures mean nothing).
DECODE_TARGET_MS = {"b1_short": 4.5, "b16_short": 5.5, "b64_short": 7.5, "b1_longest": 10.0}
SPEEDUP_TARGET = 1.45  # batch 1 after 1K: ringserve at least this much faster than compiled HF
PREFILL_TARGET_MS = {"short": 25.0}

SERIES = [
    ("floor_ms", "floor (bytes / copy rate)"),
    ("hf_eager_ms", "HF eager (DynamicCache)"),
    ("hf_compiled_ms", "HF StaticCache + compile"),
    ("ringserve_graphs_ms", "ringserve (CUDA graphs)"),
    ("ringserve_eager_ms", "ringserve (enforce_eager)"),
]


def label(n: int) -> str:
    return f"{round(n / 1024)}K" if n >= 1024 else str(n)


def key(batch: int, context: int) -> str:
    return f"b{batch}_c{context}"


class Run:
    """The results so far, the time budget, and the JSON rewritten after every part."""

    def __init__(self, args, shapes: Shapes, device: torch.device):
        self.args, self.shapes, self.device = args, shapes, device
        self.data: dict = {
            "smoke": args.smoke,
            "shapes": dataclasses.asdict(shapes),
            "enforce_eager_field": has_enforce_eager(),
            "decode": {},
            "prefill": {},
            "compile_s": {},
            "startup_s": {},
            "skipped": [],
            "errors": {},
            "timeline_s": {},
        }

    def elapsed(self) -> float:
        return time.monotonic() - T0

    def fits(self, what: str, estimate_s: float) -> bool:
        left = self.args.budget_s - self.elapsed()
        if left >= estimate_s:
            return True
        msg = f"{what}: skipped, ~{estimate_s:.0f} s estimated, {left:.0f} s of the budget left"
        print(f"  {msg}", flush=True)
        self.data["skipped"].append(msg)
        return False

    def decode(self, batch: int, context: int, series: str, ms: float) -> None:
        row = self.data["decode"].setdefault(key(batch, context), {"batch": batch, "context": context})
        row[series] = ms
        state = None if self.args.smoke else gpu_state()
        if state is not None:  # SM and memory clocks, temperature, power right after the timing
            row.setdefault("gpu_state", {})[series] = state

    def part(self, name: str, fn, *a, **kw):
        """Run one part; an exception is reported and recorded, and the run goes on."""
        print(f"[{self.elapsed():6.1f} s] {name}", flush=True)
        try:
            return fn(*a, **kw)
        except Exception as e:  # a failing peer is a figure missing, not the end of the run
            traceback.print_exc()
            self.data["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"  {name} FAILED: {type(e).__name__}: {e}", flush=True)
            return None
        finally:
            self.data["timeline_s"][name] = round(self.elapsed(), 1)
            self.save()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def save(self) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "bench_decode.json"), "w") as f:
            json.dump(self.data, f, indent=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1000


def prompt_batch(batch: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(1000, vocab // 4), min(100000, vocab), (batch, length), generator=g)


def smoke_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


def cpu_ceilings() -> dict:
    """The smoke run's stand-in for the GPU's ceilings (only so the floor code runs)."""
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    copy_bw = 10 * 2 * src.nbytes / (time.perf_counter() - start)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops": 10 * 2 * 256**3 / (time.perf_counter() - start)}


def model_sizes(hf) -> dict:
    """Bytes a decode step reads: every weight but the embedding table (rows only) and the
    LM head once; KV bytes per token; parameter counts for the prefill roofline."""
    cfg = hf.config
    embed = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings().weight
    size = embed.element_size()
    body = sum(p.numel() for n, p in hf.named_parameters() if p is not embed and p is not head)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "params": sum(p.numel() for p in hf.parameters()),
        "body_params": body,
        "head_params": head.numel(),
        "weight_bytes_read": (body + head.numel()) * size,
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * size,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "head_dim": head_dim,
    }


def decode_floor_ms(sizes: dict, ceilings: dict, batch: int, context: float) -> float:
    read = sizes["weight_bytes_read"] + batch * context * sizes["kv_bytes_per_token"]
    return read / ceilings["copy_bytes_per_s"] * 1000


def prefill_roofline_ms(sizes: dict, ceilings: dict, t: int) -> float:
    attention = 2 * 2 * (t * t / 2) * sizes["heads"] * sizes["head_dim"] * sizes["layers"]
    flops = 2 * sizes["body_params"] * t + 2 * sizes["head_params"] + attention
    return flops / ceilings["bf16_matmul_flops"] * 1000


def decode_context(shapes: Shapes, prompt: int) -> float:
    """The mean context of the timed steps (what the floor's KV read is counted at)."""
    return prompt + shapes.warm + shapes.steps / 2


# ringserve -----------------------------------------------------------------------------


def kv_cache_bytes(sizes: dict, shapes: Shapes) -> int:
    """Room for the longest prompt and the largest batch of short prompts at once, +5%."""
    extra = shapes.warm + shapes.steps + 8
    tokens = (
        max(shapes.long + shapes.prefill, default=shapes.short)
        + extra
        + max(shapes.batches) * (shapes.short + extra)
    )
    return int(tokens * sizes["kv_bytes_per_token"] * 1.05)


def bench_ringserve(run: Run, folder, weights, sizes, dtype, eager: bool) -> None:
    from ringserve.engine.engine import LLMEngine
    from ringserve.sampling_params import SamplingParams

    shapes, device = run.shapes, run.device
    series = "ringserve_eager_ms" if eager else "ringserve_graphs_ms"
    longest = max(shapes.long + shapes.prefill, default=shapes.short)
    extra = shapes.warm + shapes.steps + 8
    config = engine_config(
        max_model_len=longest + extra,
        max_num_batched_tokens=max(longest, max(shapes.batches) * shapes.short) + extra,
        kv_cache_memory=kv_cache_bytes(sizes, shapes),
        enable_prefix_caching=False,
        enforce_eager=eager,
    )
    start = time.monotonic()
    engine = LLMEngine(folder, device=device, dtype=dtype, engine_config=config, weights=weights)
    run.data["startup_s"][series] = round(time.monotonic() - start, 1)
    print(
        f"  engine ready in {run.data['startup_s'][series]:.1f} s (CUDA-graph capture included)", flush=True
    )
    vocab = sizes["vocab"]
    seeds = iter(range(10_000, 20_000))  # a fresh prompt each time

    def prefill_once(length: int) -> float:
        engine.add_request(
            prompt_batch(1, length, next(seeds), vocab)[0].tolist(),
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )

        def to_end():
            while engine.has_unfinished():
                engine.step()

        return timed_ms(to_end, device)

    def decode_at(batch: int, prompt: int, ttft: bool = False) -> float:
        params = SamplingParams(max_tokens=shapes.warm + shapes.steps + 4, temperature=0, ignore_eos=True)
        ids = [
            engine.add_request(row.tolist(), params)
            for row in prompt_batch(batch, prompt, next(seeds), vocab)
        ]
        outputs = []

        def first_tokens():
            # One step computes the prompts; with async scheduling their tokens are read by
            # the next call (which launches the first decode step behind them).
            for _ in range(2):
                outputs.extend(o for o in engine.step() if o.request_id in ids)
                if len(outputs) == batch:
                    return
            raise AssertionError(f"the prompts took more than one step ({len(outputs)} of {batch} out)")

        first_ms = timed_ms(first_tokens, device)
        if ttft:
            run.data["prefill"].setdefault(str(prompt), {"tokens": prompt})[series] = first_ms
            print(f"  {series} prefill TTFT {label(prompt):>5s}: {first_ms:9.1f} ms", flush=True)
        for _ in range(shapes.warm):
            engine.step()

        def steps():
            for _ in range(shapes.steps):
                assert len(engine.step()) == batch

        ms = timed_ms(steps, device) / shapes.steps
        for rid in ids:
            engine.abort(rid)
        run.decode(batch, prompt, series, ms)
        print(
            f"  {series} decode batch {batch:3d} context {label(prompt):>5s}: {ms:8.3f} ms/step", flush=True
        )
        return ms

    try:
        if not eager:  # TTFT does not depend on graphs: measured once, on the default engine
            for length in shapes.prefill:
                if length in shapes.long:
                    continue  # measured as the first step of that length's decode below
                prefill_once(length)  # warm-up (cuDNN builds a plan per shape)
                ms = statistics.median(prefill_once(length) for _ in range(3))
                run.data["prefill"].setdefault(str(length), {"tokens": length})[series] = ms
                print(f"  {series} prefill TTFT {label(length):>5s}: {ms:9.1f} ms", flush=True)
        for batch in shapes.batches:
            decode_at(batch, shapes.short)
        for context in shapes.long:
            ttft = not eager and context in shapes.prefill
            # A long prompt in eager mode costs its prefill again: only while the budget allows.
            prefill_est = run.data["prefill"].get(str(context), {}).get("ringserve_graphs_ms", 0) / 1000
            if eager and not run.fits(f"{series} at {label(context)}", 2 * prefill_est + 5):
                continue
            if ttft:
                prefill_once(context)  # warm-up of the same shape, untimed
            decode_at(1, context, ttft=ttft)
    finally:
        engine.close()


# transformers ---------------------------------------------------------------------------


def hf_decode(run: Run, hf, batch: int, prompt: int, compiled=None) -> float:
    """ms per decode step of transformers: prefill uncompiled, then one token per step; with
    `compiled`, a StaticCache of exactly the needed length and the compiled forward."""
    from transformers import DynamicCache, StaticCache

    shapes, device = run.shapes, run.device
    series = "hf_compiled_ms" if compiled is not None else "hf_eager_ms"
    ids = prompt_batch(batch, prompt, seed=batch * 7 + prompt, vocab=hf.config.vocab_size).to(device)
    total = prompt + shapes.warm + shapes.steps + 2
    if compiled is not None:
        cache = StaticCache(config=hf.config, max_cache_len=total)
    else:
        cache = DynamicCache(config=hf.config)
    # transformers before 5.2x took cache_position; later ones derive positions from the cache.
    takes_cache_position = "cache_position" in inspect.signature(type(hf.model).forward).parameters
    with torch.no_grad():
        out = hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    position = torch.full((batch, 1), prompt, dtype=torch.long, device=device)
    forward = compiled if compiled is not None else hf

    def step():
        nonlocal token, position
        kw = {"position_ids": position}
        if takes_cache_position:
            kw["cache_position"] = position[0]
        if compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = forward(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position = position + 1

    first_s = timed_ms(step, device) / 1000  # the compile, for the compiled peer
    if compiled is not None:
        run.data["compile_s"][key(batch, prompt)] = round(first_s, 1)
        print(f"  compile + first step, batch {batch} context {label(prompt)}: {first_s:.1f} s", flush=True)
    for _ in range(shapes.warm - 1):
        step()

    def steps():
        for _ in range(shapes.steps):
            step()

    ms = timed_ms(steps, device) / shapes.steps
    run.decode(batch, prompt, series, ms)
    print(f"  {series} decode batch {batch:3d} context {label(prompt):>5s}: {ms:8.3f} ms/step", flush=True)
    return ms


def compile_forward(run: Run, hf):
    """The standard recipe: the forward compiled whole, CUDA graphs through reduce-overhead.
    The smoke run traces with the eager backend (Dynamo's fullgraph capture, no Inductor)."""
    if run.args.smoke:
        return torch.compile(hf.forward, backend="eager", fullgraph=True, dynamic=False)
    return torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)


def bench_hf_compiled(run: Run, hf, compiled, configs) -> None:
    for batch, prompt in configs:
        if any(name.startswith("HF compiled") for name in run.data["errors"]):
            run.data["skipped"].append(
                f"HF compiled batch {batch} {label(prompt)}: an earlier compile failed"
            )
            continue
        done = run.data["compile_s"]
        # The first compile of an 8B model took 35-41 s on the H200 (compile_s in the JSONs of
        # 38fe7f2 and 261c342); a recompile (new shapes) about as long; then the timed steps.
        estimate = (max(done.values()) if done else 60) + 15
        if not run.args.smoke and not run.fits(f"HF compiled batch {batch} {label(prompt)}", estimate):
            continue
        run.part(f"HF compiled batch {batch} {label(prompt)}", hf_decode, run, hf, batch, prompt, compiled)


def bench_hf_eager(run: Run, hf) -> None:
    shapes = run.shapes
    for batch in shapes.batches:
        run.part(f"HF eager batch {batch} {label(shapes.short)}", hf_decode, run, hf, batch, shapes.short)
    context = shapes.long[0]  # 32K; eager at 128K does not fit the time (nor a DynamicCache's copies)
    if run.args.smoke or run.fits(f"HF eager batch 1 {label(context)}", 30):
        run.part(f"HF eager batch 1 {label(context)}", hf_decode, run, hf, 1, context)
    run.data["skipped"].append(f"HF at {label(shapes.long[-1])}: not run (time and memory)")


# report ---------------------------------------------------------------------------------


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def finish_rows(data: dict) -> None:
    """Floors, targets and verdicts into the rows (also for a JSON from an older run)."""
    shapes = Shapes(**data["shapes"])
    sizes, ceilings = data["model"], data["ceilings"]
    targets = {
        key(1, shapes.short): DECODE_TARGET_MS["b1_short"],
        key(16, shapes.short): DECODE_TARGET_MS["b16_short"],
        key(64, shapes.short): DECODE_TARGET_MS["b64_short"],
    }
    if shapes.long:
        targets[key(1, shapes.long[-1])] = DECODE_TARGET_MS["b1_longest"]
    for k, row in data["decode"].items():
        row["floor_ms"] = decode_floor_ms(
            sizes, ceilings, row["batch"], decode_context(shapes, row["context"])
        )
        row["target_ms"] = targets.get(k)
        ours = row.get("ringserve_graphs_ms")
        if ours is not None and row["target_ms"] is not None:
            row["target_met"] = ours <= row["target_ms"]
        if ours is not None and row.get("hf_compiled_ms") is not None:
            row["speedup_vs_hf_compiled"] = row["hf_compiled_ms"] / ours
    b1 = data["decode"].get(key(1, shapes.short), {})
    if "speedup_vs_hf_compiled" in b1:
        b1["speedup_target"] = SPEEDUP_TARGET
        b1["speedup_met"] = b1["speedup_vs_hf_compiled"] >= SPEEDUP_TARGET
    for length, row in data["prefill"].items():
        row["roofline_ms"] = prefill_roofline_ms(sizes, ceilings, int(length))
        if int(length) == shapes.short:
            row["target_ms"] = PREFILL_TARGET_MS["short"]
            if "ringserve_graphs_ms" in row:
                row["target_met"] = row["ringserve_graphs_ms"] <= row["target_ms"]


def table(data: dict) -> str:
    lines = []
    head = f"{'decode ms/step':22s}" + "".join(f"{n:>11s}" for n in ("floor", "HF eager", "HF compil"))
    head += "".join(f"{n:>11s}" for n in ("rs graphs", "rs eager", "floor/rs", "HFc/rs", "target", "met"))
    lines.append(head)
    rows = sorted(data["decode"].values(), key=lambda r: (r["context"], r["batch"]))
    for r in rows:
        ours = r.get("ringserve_graphs_ms")
        met = r.get("target_met")
        if "speedup_met" in r:
            met = met and r["speedup_met"]
        target = fmt(r.get("target_ms"), 1)
        if "speedup_target" in r:
            target += f", {r['speedup_target']}x"
        cells = [
            r.get("floor_ms"),
            r.get("hf_eager_ms"),
            r.get("hf_compiled_ms"),
            ours,
            r.get("ringserve_eager_ms"),
        ]
        lines.append(
            f"{'batch ' + str(r['batch']) + ' @ ' + label(r['context']):22s}"
            + "".join(f"{fmt(c):>11s}" for c in cells)
            + f"{fmt(r['floor_ms'] / ours if ours else None):>11s}"
            + f"{fmt(r.get('speedup_vs_hf_compiled')):>11s}"
            + f"{target:>11s}{'-' if met is None else ('yes' if met else 'NO'):>11s}"
        )
    lines.append(
        f"{'prefill TTFT ms':22s}{'roofline':>11s}{'rs graphs':>11s}{'of roof':>11s}{'target':>11s}{'met':>11s}"
    )
    for length, r in sorted(data["prefill"].items(), key=lambda kv: int(kv[0])):
        ours, met = r.get("ringserve_graphs_ms"), r.get("target_met")
        lines.append(
            f"{label(int(length)) + ' tokens':22s}{fmt(r['roofline_ms'], 1):>11s}{fmt(ours, 1):>11s}"
            f"{fmt(r['roofline_ms'] / ours if ours else None):>11s}{fmt(r.get('target_ms'), 1):>11s}"
            f"{'-' if met is None else ('yes' if met else 'NO'):>11s}"
        )
    return "\n".join(lines)


def plot(data: dict, png: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (the JSON has it all: --plot-from FILE --png OUT)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = Shapes(**data["shapes"])
    rows = data["decode"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    views = [
        (
            axes[0],
            [(b, shapes.short) for b in shapes.batches],
            0,
            f"batch (prompts of {label(shapes.short)})",
        ),
        (axes[1], [(1, c) for c in [shapes.short, *shapes.long]], 1, "context, tokens (batch 1)"),
    ]
    for ax, points, axis, xlabel in views:
        for series, name in SERIES:
            xs = [p[axis] for p in points if rows.get(key(*p), {}).get(series) is not None]
            ys = [rows[key(*p)][series] for p in points if rows.get(key(*p), {}).get(series) is not None]
            if xs:
                style = "k--" if series == "floor_ms" else "-o"
                ax.plot(xs, ys, style, label=name)
        targets = [
            (p[axis], rows[key(*p)]["target_ms"]) for p in points if rows.get(key(*p), {}).get("target_ms")
        ]
        if targets:
            ax.plot(*zip(*targets), "rx", markersize=10, mew=2, label="target")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(
            [p[axis] for p in points], [str(p[axis]) if axis == 0 else label(p[axis]) for p in points]
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per decode step (one token per sequence)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = data.get("machine", {})
    title = (
        f"Llama-3-8B-shaped decode, {m.get('gpu', '?')}, commit {m.get('commit', '?')}, {m.get('date', '')}"
    )
    fig.suptitle(title + (" (SMOKE: CPU, tiny model)" if data.get("smoke") else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")
    return True


# main -----------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps: the logic only")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall time to keep to (s)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and PNG")
    parser.add_argument("--plot-from", metavar="JSON", help="only plot (and tabulate) a run's JSON")
    parser.add_argument("--png", help="the plot's file (default: beside the JSON)")
    parser.add_argument(
        "--short-only",
        action="store_true",
        help="only decode after the short prompt (batch 1, 16, 64), ringserve with graphs against the "
        "compiled peer at batch 1: the batch targets in about 2 minutes, no prefill or long context first",
    )
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            data = json.load(f)
        finish_rows(data)
        print(table(data))
        plot(data, args.png or os.path.splitext(args.plot_from)[0] + ".png")
        return

    from transformers import AutoModelForCausalLM

    if args.smoke:
        torch.set_num_threads(1)  # a shared 2-core host: no thread oversubscription
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE if args.smoke else FULL
    if args.short_only:
        shapes = dataclasses.replace(shapes, long=[], prefill=[])
    run = Run(args, shapes, device)
    try:
        run.data["machine"] = machine_info()
    except Exception:  # no GPU (smoke)
        commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
        run.data["machine"] = {"gpu": "CPU", "torch": torch.__version__, "commit": commit}
        run.data["machine"]["date"] = time.strftime("%Y-%m-%d")
    run.data["ceilings"] = cpu_ceilings() if args.smoke else measure_ceilings()
    c = run.data["ceilings"]
    print(
        f"{run.data['machine']}\ncopy {c['copy_bytes_per_s'] / 1e12:.3f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_flops'] / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    if not has_enforce_eager():
        print("WARNING: EngineConfig has no enforce_eager field: 'ringserve graphs' is the default path")
    cfg = smoke_config() if args.smoke else llama3_8b_config()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    folder = tempfile.mkdtemp()
    cfg.save_pretrained(folder)  # config only: the weights come from the transformers model
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sizes = model_sizes(hf)
    sizes["vocab"] = cfg.vocab_size
    run.data["model"] = sizes
    print(f"[{run.elapsed():6.1f} s] model: {sizes['params'] / 1e9:.3f} B parameters", flush=True)

    # Most important first: ringserve with graphs, then the compiled peer at batch 1.
    run.part("ringserve graphs", bench_ringserve, run, folder, hf.state_dict(), sizes, dtype, False)
    compiled = compile_forward(run, hf)
    bench_hf_compiled(run, hf, compiled, [(1, shapes.short)])
    if args.short_only:
        finish_rows(run.data)
        run.save()
        print(table(run.data))
        return
    bench_hf_eager(run, hf)
    if has_enforce_eager() or args.smoke:
        if args.smoke or run.fits("ringserve eager", 40):
            run.part("ringserve eager", bench_ringserve, run, folder, hf.state_dict(), sizes, dtype, True)
    else:
        run.data["skipped"].append("ringserve eager: EngineConfig has no enforce_eager field yet")
    rest = [(b, shapes.short) for b in shapes.batches if b != 1] + [(1, shapes.long[0])]
    bench_hf_compiled(run, hf, compiled, rest)

    finish_rows(run.data)
    run.data["wall_s"] = round(run.elapsed(), 1)
    run.save()
    plot(run.data, os.path.join(args.out, "bench_decode.png"))
    for msg in run.data["skipped"]:
        print(f"skipped: {msg}")
    for name, err in run.data["errors"].items():
        print(f"ERROR in {name}: {err}")
    print(f"\nwall time {run.data['wall_s']:.0f} s; JSON {os.path.join(args.out, 'bench_decode.json')}")
    if args.smoke:
        print("SMOKE RUN (CPU, tiny model): the figures and the targets mean nothing")
    print(table(run.data))


if __name__ == "__main__":
    main()
