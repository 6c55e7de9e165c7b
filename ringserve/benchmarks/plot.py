"""PNG plots of a benchmark result: latency distributions, TTFT against input length in a
sweep, and TTFT / parallel efficiency per cp degree in a comparison. matplotlib is optional
(`pip install 'ringserve[bench]'`) and imported only here."""

from __future__ import annotations

import numpy as np

from ringserve.benchmarks import BenchError
from ringserve.benchmarks.metrics import tpot


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure  # a Figure of its own: no pyplot global state
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'ringserve[bench]'") from None
    return Figure(figsize=(width, height), layout="constrained")


def _length_axis(ax, lengths: list[int]) -> None:
    """A log2 axis of input lengths, ticked at the swept lengths, in plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.minorticks_off()
    ax.set_xlabel("input tokens")


def latencies_ms(result: dict) -> dict[str, np.ndarray]:
    """Per successful request: TTFT, TPOT and E2EL; ITL per token gap; in milliseconds."""
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    tpots = [tpot(result["e2els"][i], result["ttfts"][i], result["output_lens"][i]) for i in ok]
    return {
        "TTFT": np.array([result["ttfts"][i] for i in ok]) * 1000,
        "TPOT": np.array([t for t in tpots if t is not None]) * 1000,
        "ITL": np.array([x for i in ok for x in result["itls"][i]]) * 1000,
        "E2EL": np.array([result["e2els"][i] for i in ok]) * 1000,
    }


def plot_result(result: dict, path: str) -> None:
    """A histogram with its CDF per latency; in a sweep, median TTFT (min..max) per input
    length; in a rate sweep, goodput and the p99 latencies per request rate."""
    sweep = result.get("sweep")
    rate_sweep = result.get("rate_sweep")
    fig = _figure(11, 11 if sweep or rate_sweep else 7.5)
    grid = fig.add_gridspec(3 if sweep or rate_sweep else 2, 2)
    for k, (name, values) in enumerate(latencies_ms(result).items()):
        ax = fig.add_subplot(grid[k // 2, k % 2])
        ax.set_title(f"{name} ({values.size} values)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        if values.size == 0:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(5, values.size // 2)), color="tab:blue", alpha=0.7)
        cdf = ax.twinx()
        ordered = np.sort(values)
        cdf.step(ordered, np.arange(1, ordered.size + 1) / ordered.size, where="post", color="tab:red")
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("CDF", color="tab:red")
        for p in (50, 99):
            ax.axvline(np.percentile(values, p), color="gray", linestyle=":", linewidth=1)
    if sweep:
        ax = fig.add_subplot(grid[2, :])
        lengths, median, low, high = [], [], [], []
        for point in sweep:
            ttfts = [t * 1000 for t, e in zip(point["ttfts"], point["errors"]) if not e]
            if ttfts:
                lengths.append(point["input_len"])
                median.append(np.median(ttfts))
                low.append(median[-1] - min(ttfts))
                high.append(max(ttfts) - median[-1])
        ax.errorbar(lengths, median, yerr=[low, high], marker="o", capsize=4)
        _length_axis(ax, lengths)
        ax.set_ylabel("TTFT (ms), median and min..max")
        ax.set_title("TTFT against input length, one request at a time")
        ax.grid(True, alpha=0.3)
    if rate_sweep:
        _plot_rate_sweep(fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1]), rate_sweep)
    fig.suptitle(
        f"{result.get('model_id')} · {result.get('endpoint_type')} · {result['completed']} requests, "
        f"rate {result.get('request_rate')}, concurrency {result.get('max_concurrency') or 'unlimited'}"
    )
    fig.savefig(path, dpi=110)


def _plot_rate_sweep(goodput_ax, latency_ax, points: list[dict]) -> None:
    rates = [p["request_rate"] for p in points]
    goodput_ax.plot(rates, rates, color="gray", linestyle=":", label="offered")
    goodput_ax.plot(rates, [p["request_throughput"] for p in points], marker="o", label="completed")
    goodput_ax.plot(rates, [p["request_goodput"] for p in points], marker="o", label="goodput")
    goodput_ax.set(xlabel="request rate (req/s)", ylabel="req/s", title="goodput by request rate")
    p99 = {"TTFT": [], "TPOT": []}
    for point in points:
        for name, values in latencies_ms(point).items():
            if name in p99:
                p99[name].append(np.percentile(values, 99) if values.size else np.nan)
    latency_ax.plot(rates, p99["TTFT"], marker="o", label="TTFT p99")
    latency_ax.set(xlabel="request rate (req/s)", ylabel="TTFT p99 (ms)", yscale="log")
    tpot_ax = latency_ax.twinx()
    tpot_ax.plot(rates, p99["TPOT"], marker="s", color="tab:red", label="TPOT p99")
    tpot_ax.set_ylabel("TPOT p99 (ms)", color="tab:red")
    latency_ax.set_title("99th percentiles by request rate")
    for ax in (goodput_ax, latency_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")


def plot_comparison(runs: list[dict], path: str) -> None:
    """TTFT and parallel efficiency against input length, one line per run (cp degree)."""
    fig = _figure(12, 5)
    ttft_ax, eff_ax = fig.subplots(1, 2)
    for run in runs:
        lengths = sorted(run["ttft_ms"])
        ttft_ax.plot(lengths, [run["ttft_ms"][n] for n in lengths], marker="o", label=run["label"])
        points = [(n, run["efficiency"][n]) for n in lengths if run["efficiency"].get(n) is not None]
        if points:
            eff_ax.plot(*zip(*points), marker="o", label=run["label"])
    from matplotlib.ticker import ScalarFormatter

    ttft_ax.set(yscale="log", ylabel="median TTFT (ms)", title="TTFT")
    ttft_ax.yaxis.set_major_formatter(ScalarFormatter())
    ttft_ax.yaxis.set_minor_formatter(ScalarFormatter())  # a narrow range has no major tick
    eff_ax.set(ylabel="TTFT(cp=1) / (cp x TTFT(cp))", title="parallel efficiency", ylim=(0, 1.1))
    lengths = sorted({n for run in runs for n in run["ttft_ms"]})
    for ax in (ttft_ax, eff_ax):
        _length_axis(ax, lengths)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
