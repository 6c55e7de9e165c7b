"""`ringserve bench serve --compare-results`: TTFT and parallel efficiency per cp degree, from
saved `--sweep-input-lens` results (the context-parallel scaling suite)."""

from __future__ import annotations

import json

import numpy as np

from ringserve.benchmarks import BenchError


def load_run(path: str) -> dict:
    """A saved sweep's label, layout and median TTFT (ms) per input length."""
    with open(path) as f:
        result = json.load(f)
    if "sweep" not in result:
        raise BenchError(f"{path}: not a --sweep-input-lens result (no sweep in it)")
    parallel = (result.get("server") or {}).get("parallel")
    if not parallel or "cp" not in parallel:
        raise BenchError(f"{path}: the server reported no parallel layout (GET /version gave no cp)")
    ttft_ms = {}
    for point in result["sweep"]:
        ok = [t for t, e in zip(point["ttfts"], point["errors"]) if not e]
        if ok:
            ttft_ms[point["input_len"]] = float(np.median(ok)) * 1000
    layout = " ".join(f"{k}={parallel[k]}" for k in ("dp", "tp", "cp", "ep") if k in parallel)
    return {"path": path, "label": layout, "cp": int(parallel["cp"]), "ttft_ms": ttft_ms}


def efficiency(runs: list[dict]) -> None:
    """Adds run["efficiency"][input_len] = TTFT(cp=1) / (cp * TTFT(cp)), against the first cp=1
    run (None without one, or where it lacks that length)."""
    base = next((r for r in runs if r["cp"] == 1), None)
    for run in runs:
        run["efficiency"] = {
            n: base["ttft_ms"][n] / (run["cp"] * t) if base and n in base["ttft_ms"] else None
            for n, t in run["ttft_ms"].items()
        }


def format_comparison(runs: list[dict]) -> str:
    lengths = sorted({n for r in runs for n in r["ttft_ms"]})
    width = max(18, *(len(r["label"]) + 2 for r in runs))
    lines = [
        "Median TTFT (ms) and parallel efficiency TTFT(cp=1) / (cp x TTFT(cp)) by input length",
        f"{'input tokens':>12}" + "".join(f"{r['label']:>{width}}" for r in runs),
    ]
    for n in lengths:
        cells = []
        for r in runs:
            t, e = r["ttft_ms"].get(n), r["efficiency"].get(n)
            cell = "-" if t is None else f"{t:.1f}" + ("" if e is None else f" ({e:.0%})")
            cells.append(f"{cell:>{width}}")
        lines.append(f"{n:>12}" + "".join(cells))
    if not any(r["cp"] == 1 for r in runs):
        lines.append("(no cp=1 result among them: efficiency needs one)")
    return "\n".join(lines)


def compare(paths: list[str], plot_path: str | None = None) -> int:
    runs = sorted((load_run(p) for p in paths), key=lambda r: r["cp"])
    efficiency(runs)
    print(format_comparison(runs))
    if plot_path:
        from ringserve.benchmarks.plot import plot_comparison

        plot_comparison(runs, plot_path)
        print(f"plot saved to {plot_path}")
    return 0
