"""`ringserve bench serve`: drive an OpenAI-compatible server with a dataset of prompts at a
request rate and concurrency, and report throughput and latency percentiles as `vllm bench
serve` does; or sweep fixed input lengths one request at a time (TTFT against context length,
for context-parallel scaling), or compare such sweeps across cp degrees."""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ringserve.benchmarks import BenchError, datasets
from ringserve.benchmarks.arrivals import send_times
from ringserve.benchmarks.metrics import format_table, parse_goodput, summarize, tpot

if TYPE_CHECKING:  # the HTTP client is imported when requests are sent, not for `ringserve --help`
    from ringserve.benchmarks.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rate_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("server")
    where.add_argument("--base-url", default=None, help="server root, e.g. http://HOST:8000")
    where.add_argument("--host", default="127.0.0.1", help="server host, without --base-url")
    where.add_argument("--port", type=int, default=8000, help="server port, without --base-url")
    where.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    where.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    where.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions (random prompts as token ids) or /v1/chat/completions (text)",
    )
    where.add_argument(
        "--tokenizer",
        default=None,
        help="folder with the model's tokenizer (default: the model folder /v1/models names, when it "
        "is on this machine); without one, random prompts are common words, about one token each",
    )
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        type=lambda name: name.replace("_", "-"),  # vLLM spells it prefix_repetition
        choices=("random", "sharegpt", "prefix-repetition", "copy"),
        default="random",
    )
    data.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON file, or the copy dataset's text file (local)"
    )
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    data.add_argument("--random-prefix-len", type=int, default=0, help="a random prefix shared by all")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="max_tokens for every prompt")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument(
        "--copy-passage-len",
        type=int,
        default=256,
        help="copy dataset: tokens a passage holds (varied by --random-range-ratio); the answer copies it",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not measured")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--sweep-input-lens",
        type=_int_list,
        default=None,
        help="long-context mode: for each length (e.g. 1024,4096,16384), --sweep-num-prompts requests "
        "of exactly that many tokens, one at a time; records TTFT per length",
    )
    load.add_argument("--sweep-num-prompts", type=int, default=3, help="requests per swept length")
    load.add_argument(
        "--request-rate-sweep",
        type=_rate_list,
        default=None,
        metavar="RATES",
        help="capacity mode: the dataset at each of these request rates in turn (e.g. 4,8,12,16, "
        "Poisson unless --burstiness); needs --goodput, and reports goodput per rate and the "
        "highest rate at which the SLOs hold for --slo-share of requests",
    )
    load.add_argument(
        "--slo-share",
        type=float,
        default=0.99,
        help="share of requests that must meet every --goodput SLO for a swept rate to hold "
        "(0.99: the SLOs hold at the 99th percentile)",
    )
    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    report.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    report.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50")
    report.add_argument("--save-result", action="store_true", help="write the result as JSON")
    report.add_argument("--result-dir", default=None, help="folder for --save-result (default: .)")
    report.add_argument("--result-filename", default=None, help="file name for --save-result")
    report.add_argument("--plot", default=None, metavar="FILE.png", help="latency distributions (and sweep)")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    report.add_argument(
        "--compare-results",
        nargs="+",
        default=None,
        metavar="RESULT.json",
        help="no requests: print (and --plot) TTFT and parallel efficiency per cp degree "
        "from saved --sweep-input-lens results",
    )


# The server -----------------------------------------------------------------------------


@dataclass
class ServerInfo:
    base_url: str
    headers: dict
    model: str
    model_root: str | None  # where the server loaded the model from
    version: dict  # GET /version: the server's version and parallel layout


def _base_url(args) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url  # as OpenAI clients take it, too


def connect(args) -> ServerInfo:
    import httpx2 as httpx

    base = _base_url(args)
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            r = http.get("/v1/models")
            if r.status_code != 200:
                raise BenchError(f"GET {base}/v1/models: HTTP {r.status_code}: {r.text[:300]}")
            cards = r.json().get("data") or []
            v = http.get("/version")  # ringserve's has the parallel layout; others may lack it
            version = v.json() if v.status_code == 200 else {}
            version = version if isinstance(version, dict) else {}
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {base}: {e}") from None
    if not cards and not args.model:  # a --model is sent as given (transformers serve lists none)
        raise BenchError(f"{base}/v1/models lists no model: name one with --model")
    model = args.model or cards[0]["id"]
    card = next((c for c in cards if c["id"] == model), {})
    return ServerInfo(base, headers, model, card.get("root"), version)


# Requests ---------------------------------------------------------------------------------


def make_requests(args, tokenizer, rng: np.random.Generator) -> list[datasets.SampleRequest]:
    maker = datasets.PromptMaker(tokenizer, rng, as_text=args.endpoint == "chat")
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise BenchError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return datasets.sharegpt_requests(
            args.dataset_path, tokenizer, args.num_prompts, rng, args.sharegpt_output_len
        )
    if args.dataset_name == "copy":
        if not args.dataset_path:
            raise BenchError("--dataset-name copy needs --dataset-path FILE.txt (any long local text)")
        return datasets.copy_requests(
            args.dataset_path,
            tokenizer,
            args.num_prompts,
            args.copy_passage_len,
            rng,
            args.random_range_ratio,
        )
    if args.dataset_name == "prefix-repetition":
        return datasets.prefix_repetition_requests(
            maker,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
        )
    return datasets.random_requests(
        maker,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
    )


async def run_requests(
    server: ServerInfo,
    endpoint: str,
    samples: list[datasets.SampleRequest],
    *,
    ignore_eos: bool = False,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    rng: np.random.Generator | None = None,
    progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every sample on its arrival schedule, at most max_concurrency at once; the results
    in the samples' order and the wall time from the first send to the last answer."""
    import httpx2 as httpx
    from tqdm import tqdm

    from ringserve.benchmarks.client import request_body, send

    at = send_times(len(samples), request_rate, burstiness, rng or np.random.default_rng(0))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    timeout = httpx.Timeout(6 * 3600, connect=60)  # long generations are not failures
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    bar = tqdm(total=len(samples), disable=not progress, unit="req")
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.headers, timeout=timeout, limits=limits
    ) as client:
        start = time.perf_counter()

        async def one(sample, send_at):
            delay = start + send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(endpoint, server.model, sample, ignore_eos)
            if limit is None:
                result = await send(client, url, endpoint, body, sample)
            else:
                async with limit:
                    result = await send(client, url, endpoint, body, sample)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(s, t) for s, t in zip(samples, at)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


# The run ----------------------------------------------------------------------------------


def _check(args) -> None:
    positive = ["num_prompts", "random_input_len", "random_output_len", "sweep_num_prompts"]
    positive += ["prefix_repetition_suffix_len", "prefix_repetition_output_len"]
    for name in positive:
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("random_prefix_len", "prefix_repetition_prefix_len", "num_warmups"):
        if getattr(args, name) < 0:
            raise BenchError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.sweep_input_lens is not None and (not args.sweep_input_lens or min(args.sweep_input_lens) < 1):
        raise BenchError("--sweep-input-lens takes positive lengths, e.g. 1024,4096")
    if args.request_rate_sweep is not None:
        rates = args.request_rate_sweep
        if not rates or not all(0 < r < math.inf for r in rates):
            raise BenchError("--request-rate-sweep takes positive finite rates in requests/s, e.g. 4,8,16")
        if not args.goodput:
            raise BenchError("--request-rate-sweep needs the SLOs it checks: --goodput ttft:MS tpot:MS")
        if args.sweep_input_lens:
            raise BenchError("--request-rate-sweep and --sweep-input-lens are two modes: choose one")
    if not 0 < args.slo_share <= 1:
        raise BenchError(f"--slo-share must be in (0, 1], got {args.slo_share}")


def _percentile_options(args) -> tuple[list[str], list[float]]:
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise BenchError(f"--percentile-metrics: unknown {', '.join(unknown)} (of {','.join(METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"--metric-percentiles takes numbers, got {args.metric_percentiles!r}") from None
    if not percentiles or any(not 0 <= p <= 100 for p in percentiles):
        raise BenchError(f"--metric-percentiles must be in 0..100, got {args.metric_percentiles!r}")
    return metrics, percentiles


def _errors_report(results: list[RequestResult]) -> str:
    counts = collections.Counter(r.error for r in results if not r.success)
    lines = [f"Failed requests by error ({sum(counts.values())}):"]
    lines += [f"  {n} x {message}" for message, n in counts.most_common(5)]
    if len(counts) > 5:
        lines.append(f"  ... and {len(counts) - 5} other errors (all in the saved result's errors)")
    return "\n".join(lines)


def _result_path(args, server: ServerInfo, now: datetime.datetime) -> str:
    if args.result_filename:
        name = args.result_filename
    else:
        rates = args.request_rate_sweep or [args.request_rate]
        rate = "-".join("inf" if math.isinf(r) else f"{r:g}" for r in rates)
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        sweep = "-sweep" if args.sweep_input_lens else ""
        model = os.path.basename(server.model.rstrip("/")) or "model"
        name = f"{args.endpoint}-{rate}qps{concurrency}{sweep}-{model}-{now:%Y%m%d-%H%M%S}.json"
    return os.path.join(args.result_dir or ".", name)


def run(args) -> int:
    _check(args)
    metrics, percentiles = _percentile_options(args)
    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as e:
        raise BenchError(str(e)) from None
    server = connect(args)
    tokenizer = datasets.load_tokenizer(args.tokenizer or server.model_root)
    if args.tokenizer and tokenizer is None:
        raise BenchError(f"--tokenizer {args.tokenizer}: no tokenizer in that folder")
    if tokenizer is None and args.dataset_name == "copy":
        print("no tokenizer on this machine: passage lengths are counted in words", file=sys.stderr)
    elif tokenizer is None and args.dataset_name != "sharegpt":
        print("no tokenizer on this machine: prompts are common words, lengths approximate", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    arrivals_rng = np.random.default_rng([args.seed, 1])  # the schedule does not shift with the data
    progress = not args.disable_tqdm
    now = datetime.datetime.now()

    sweep = rate_sweep = before = after = None
    if args.sweep_input_lens:
        sweep, results, duration = _sweep(args, server, tokenizer, rng, metrics, percentiles, progress)
    elif args.request_rate_sweep:
        rate_sweep, results, duration = _rate_sweep(
            args, server, tokenizer, metrics, percentiles, goodput, progress
        )
    else:
        samples = make_requests(args, tokenizer, rng)
        _warm_up(args, server, samples[0])
        before = spec_decode_counts(server)
        results, duration = _run_at(args, server, samples, args.request_rate, arrivals_rng, progress)
        after = spec_decode_counts(server)
    summary = summarize(results, duration, metrics, percentiles, goodput)
    if not (sweep or rate_sweep) and before is not None and after is not None:
        summary.update(spec_decode_summary(before, after))
    print(format_table(summary, metrics, percentiles, "Serving Benchmark Result"))
    if summary["failed"]:
        print(_errors_report(results))
    if sweep:
        print(_sweep_table(sweep))
    if rate_sweep:
        print(_rate_sweep_table(rate_sweep, args.goodput, args.slo_share))

    result = {
        "date": f"{now:%Y%m%d-%H%M%S}",
        "endpoint_type": args.endpoint,
        "base_url": server.base_url,
        "model_id": server.model,
        "tokenizer_id": args.tokenizer or (server.model_root if tokenizer is not None else None),
        "dataset_name": "random" if sweep else args.dataset_name,
        "num_prompts": len(results),
        "request_rate": (
            args.request_rate_sweep
            if rate_sweep
            else "inf"
            if sweep or math.isinf(args.request_rate)
            else args.request_rate
        ),
        "burstiness": args.burstiness,
        "max_concurrency": 1 if sweep else args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "percentile_metrics": metrics,
        "metric_percentiles": percentiles,
        "server": server.version,
        **summary,
    }
    if sweep:
        result["sweep"] = sweep
    if rate_sweep:
        result["rate_sweep"] = rate_sweep
        result["slo_share"] = args.slo_share
        result["max_rate_meeting_slos"] = max_rate_meeting_slos(rate_sweep, args.slo_share)
    if args.save_result:
        path = _result_path(args, server, now)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"result saved to {path}")
    if args.plot:
        from ringserve.benchmarks.plot import plot_result

        plot_result(result, args.plot)
        print(f"plot saved to {args.plot}")
    return 0 if summary["completed"] else 1


SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counts(server: ServerInfo) -> dict[str, float] | None:
    """The server's speculative-decoding counters (vLLM's vllm:spec_decode_* on /metrics,
    summed over its replicas); None where it has none (no speculation, or no /metrics)."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=30)
        if r.status_code != 200:
            return None
        counts = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                name = sample.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
                if sample.name.startswith("vllm:spec_decode_") and name in SPEC_DECODE_COUNTERS:
                    counts[name] = counts.get(name, 0.0) + sample.value
    except (httpx.HTTPError, ValueError):
        return None
    return counts or None


def spec_decode_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the run's drafts did, from the counters around it: as `vllm bench serve` reports,
    the share of draft tokens kept and the mean acceptance length (tokens per verified run)."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_DECODE_COUNTERS}
    drafts, tokens, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / tokens if tokens else None,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def _warm_up(args, server: ServerInfo, sample: datasets.SampleRequest) -> None:
    """--num-warmups: the first request sent that many times, one at a time, not measured (as
    vLLM; the server's own metrics do count them)."""
    if args.num_warmups:
        warm = [sample] * args.num_warmups
        asyncio.run(run_requests(server, args.endpoint, warm, ignore_eos=args.ignore_eos, max_concurrency=1))


def _sweep(args, server, tokenizer, rng, metrics, percentiles, progress):
    """--sweep-input-lens: per length, requests of exactly that many tokens, one at a time."""
    maker = datasets.PromptMaker(tokenizer, rng, as_text=args.endpoint == "chat")
    metrics = [m for m in METRICS if m in metrics or m == "ttft"]  # TTFT is what a sweep is for
    sweep, results, duration = [], [], 0.0
    for length in args.sweep_input_lens:
        samples = datasets.random_requests(maker, args.sweep_num_prompts, length, args.random_output_len)
        if not sweep:
            _warm_up(args, server, samples[0])
        got, took = asyncio.run(
            run_requests(
                server,
                args.endpoint,
                samples,
                ignore_eos=args.ignore_eos,
                max_concurrency=1,
                progress=progress,
            )
        )
        summary = summarize(got, took, metrics, percentiles)
        del summary["generated_texts"]
        sweep.append({"input_len": length, **summary})
        results += got
        duration += took
    return sweep, results, duration


def _run_at(args, server, samples, rate: float, arrivals_rng, progress: bool):
    """The samples sent at `rate` with the run's load flags: (results, duration)."""
    return asyncio.run(
        run_requests(
            server,
            args.endpoint,
            samples,
            ignore_eos=args.ignore_eos,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            rng=arrivals_rng,
            progress=progress,
        )
    )


def _rate_sweep(args, server, tokenizer, metrics, percentiles, goodput, progress):
    """--request-rate-sweep: at each rate, fresh requests of the dataset (their own seed, so
    no rate meets prompts a lower one left in the server's prefix cache) with their own
    Poisson arrivals, one rate after the other; a summary per rate."""
    points, results, duration = [], [], 0.0
    for rate in args.request_rate_sweep:
        seed = [args.seed, round(rate * 1000)]
        samples = make_requests(args, tokenizer, np.random.default_rng(seed))
        if not points:
            _warm_up(args, server, samples[0])
        got, took = _run_at(args, server, samples, rate, np.random.default_rng([*seed, 1]), progress)
        summary = summarize(got, took, metrics, percentiles, goodput)
        del summary["generated_texts"]
        points.append({"request_rate": rate, **summary})
        print(
            f"rate {rate:g} req/s: goodput {summary['request_goodput']:.2f} req/s, "
            f"{100 * summary['request_goodput_share']:.1f}% of requests meet every SLO",
            flush=True,
        )
        results += got
        duration += took
    return points, results, duration


def max_rate_meeting_slos(points: list[dict], share: float) -> float | None:
    """The highest swept rate whose requests met every SLO in at least `share` of cases,
    every lower swept rate meeting them too (None: not even the lowest)."""
    best = None
    for point in sorted(points, key=lambda p: p["request_rate"]):
        if point["request_goodput_share"] < share:
            break
        best = point["request_rate"]
    return best


def _rate_sweep_table(points: list[dict], slos: list[str], share: float) -> str:
    lines = [f"{' Goodput by request rate (SLOs: ' + ' '.join(slos) + ') ':=^78}"]
    lines.append(
        f"{'rate':>6} {'req/s':>7} {'goodput':>8} {'met %':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'held':>5}"
    )

    def ms(values):
        values = [v * 1000 for v in values if v is not None]
        return (np.percentile(values, 50), np.percentile(values, 99)) if values else (math.nan, math.nan)

    for p in points:
        ok = [i for i, e in enumerate(p["errors"]) if not e]
        ttft = ms([p["ttfts"][i] for i in ok])
        tpot_ms = ms([tpot(p["e2els"][i], p["ttfts"][i], p["output_lens"][i]) for i in ok])
        held = "yes" if p["request_goodput_share"] >= share else "no"
        lines.append(
            f"{p['request_rate']:>6g} {p['request_throughput']:>7.2f} {p['request_goodput']:>8.2f} "
            f"{100 * p['request_goodput_share']:>6.1f} {ttft[0]:>9.1f} {ttft[1]:>9.1f} "
            f"{tpot_ms[0]:>9.2f} {tpot_ms[1]:>9.2f} {held:>5}"
        )
    best = max_rate_meeting_slos(points, share)
    lines.append(
        f"highest rate at which {100 * share:g}% of requests meet every SLO: "
        + ("none of the rates swept" if best is None else f"{best:g} req/s")
    )
    return "\n".join(lines)


def _sweep_table(sweep: list[dict]) -> str:
    lines = [f"{' TTFT by input length (concurrency 1) ':=^50}"]
    lines.append(f"{'input tokens':>12} {'median ms':>10} {'min ms':>10} {'max ms':>10} {'failed':>6}")
    for point in sweep:
        ttfts = [t * 1000 for t, e in zip(point["ttfts"], point["errors"]) if not e] or [math.nan]
        lines.append(
            f"{point['input_len']:>12} {np.median(ttfts):>10.1f} {min(ttfts):>10.1f} {max(ttfts):>10.1f} "
            f"{point['failed']:>6}"
        )
    return "\n".join(lines)


def main(args) -> int:
    try:
        if args.compare_results:
            from ringserve.benchmarks.compare import compare

            return compare(args.compare_results, args.plot)
        return run(args)
    except (BenchError, ValueError, OSError) as e:  # what a user's flags or files can cause
        print(f"error: {e}", file=sys.stderr)
        return 2
