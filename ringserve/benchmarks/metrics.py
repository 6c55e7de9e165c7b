"""The benchmark's summary of its requests, with `vllm bench serve`'s names and table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ringserve.benchmarks.client import RequestResult

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} in seconds."""
    slos = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in TITLES or name == "itl":
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        slos[name] = float(value) / 1000
    return slos


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Seconds per output token after the first; None with one token or fewer."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def summarize(
    results: list[RequestResult],
    duration: float,
    metrics: list[str],
    percentiles: list[float],
    goodput: dict[str, float] | None = None,
) -> dict:
    """Counts, throughputs and, for each chosen metric, mean / median / std / percentiles in ms
    (None where no request gave a value), plus the per-request lists."""
    ok = [r for r in results if r.success]
    tpots = [tpot(r.latency, r.ttft, r.output_tokens) for r in ok]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in tpots if t is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if goodput:
        per_request = {"ttft": values["ttft"], "tpot": tpots, "e2el": values["e2el"]}
        good = sum(
            all(per_request[m][i] is None or per_request[m][i] <= slo for m, slo in goodput.items())
            for i in range(len(ok))
        )
        out["request_goodput"] = good / duration
        out["request_goodput_share"] = good / len(results) if results else 0.0  # failures are not good
    for name in metrics:
        ms = np.asarray(values[name]) * 1000
        empty = ms.size == 0
        out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
        out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = None if empty else float(ms.std())
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    out.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        e2els=[r.latency for r in results],
        generated_texts=[r.generated_text for r in results],
        errors=[r.error for r in results],
    )
    return out


def format_table(summary: dict, metrics: list[str], percentiles: list[float], title: str) -> str:
    """The result block `vllm bench serve` prints."""

    def row(label, value, fmt="{:.2f}"):
        shown = "-" if value is None else (fmt.format(value) if isinstance(value, float) else value)
        return f"{label:<40} {shown:<10}"

    lines = [
        f"{' ' + title + ' ':=^50}",
        row("Successful requests:", summary["completed"]),
        row("Failed requests:", summary["failed"]),
        row("Benchmark duration (s):", summary["duration"]),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Request throughput (req/s):", summary["request_throughput"]),
    ]
    if "request_goodput" in summary:
        lines.append(row("Request goodput (req/s):", summary["request_goodput"]))
        lines.append(row("Requests meeting every SLO (%):", 100 * summary["request_goodput_share"]))
    lines += [
        row("Output token throughput (tok/s):", summary["output_throughput"]),
        row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    if summary.get("spec_decode_num_drafts"):
        rate = summary["spec_decode_acceptance_rate"]
        lines += [
            f"{'Speculative Decoding':-^50}",
            row("Acceptance rate (%):", None if rate is None else 100 * rate),
            row("Acceptance length:", summary["spec_decode_acceptance_length"]),
            row("Drafts:", int(summary["spec_decode_num_drafts"])),
            row("Draft tokens:", int(summary["spec_decode_num_draft_tokens"])),
            row("Accepted tokens:", int(summary["spec_decode_num_accepted_tokens"])),
        ]
    for name in metrics:
        upper = name.upper()
        lines.append(f"{TITLES[name]:-^50}")
        lines.append(row(f"Mean {upper} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {upper} (ms):", summary[f"median_{name}_ms"]))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(row(f"P{p:g} {upper} (ms):", summary[f"{key}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
