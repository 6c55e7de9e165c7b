"""Command line: `ringserve generate | chat | serve | bench ...`."""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time

from ringserve.cli.common import (
    add_model_positional,
    add_sampling_args,
    finish_reason,
    options_and_sampling,
    start_llm,
    take_model_positional,
)
from ringserve.measurements import DEFAULT_REPEATS
from ringserve.options import OptionError, add_cli_args, cli_error, from_cli_args

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    from ringserve import __version__

    parser = argparse.ArgumentParser(prog="ringserve", description="LLM inference engine for long contexts")
    parser.add_argument("--version", action="version", version=f"ringserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="complete prompts and stream the text to stdout",
        description="Complete one or more prompts. With one prompt the text streams as it is "
        "generated; a summary line (tokens, time to first token, tokens/s) ends the run.",
    )
    gen.add_argument(
        "prompt",
        nargs="*",
        help="prompt text; several prompts run as one batch; none (or -): read the prompt from stdin "
        f"when it is piped, else {DEFAULT_PROMPT!r}",
    )
    add_sampling_args(gen, max_tokens=128)
    gen.add_argument(
        "--no-chat",
        action="store_true",
        help="raw completion: do not wrap the prompt in the model's chat template",
    )
    add_cli_args(gen)

    _add_serve_parser(sub)
    from ringserve.cli.chat import add_chat_parser

    add_chat_parser(sub)

    bench = sub.add_parser("bench", help="measure this machine (results feed the engine's choices)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ar = bench_sub.add_parser(
        "allreduce",
        help="time the allreduce backends per message size and store auto's thresholds",
        description="Starts N local ranks, times torch / one_shot / two_shot allreduce for each "
        "message size, prints the table and stores the thresholds `--allreduce auto` uses.",
    )
    ar.add_argument("--world-size", type=int, default=2, help="ranks (GPUs, or CPU processes)")
    ar.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ar.add_argument("--sizes", type=int, nargs="+", default=None, help="message sizes in bytes")
    ar.add_argument("--iters", type=int, default=20, help="timed calls per size and repeat (their median)")
    ar.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="sweeps over all sizes; the table and the thresholds use the median over them",
    )
    ar.add_argument("--no-save", action="store_true", help="print only; keep the stored thresholds")
    cal = bench_sub.add_parser(
        "cp-calibrate",
        help="measure attention FLOP/s and ring bandwidth for the pass-KV / pass-Q choice",
        description="Measures this device's attention rate and the bandwidth of one ring hop between "
        "two local ranks, and stores them for `--cp-algo auto`. Across hosts, the hop between "
        "hosts is the slower link: measure there too.",
    )
    cal.add_argument("--device", default="auto", help="cpu, cuda or auto")
    cal.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS, help="timings of each rate; their median is stored"
    )
    cal.add_argument("--no-save", action="store_true", help="print only")
    _add_bench_serve_parser(bench_sub)
    return parser


def _add_bench_serve_parser(bench_sub) -> None:
    from ringserve.benchmarks.serve import add_cli_args as add_bench_serve_args

    bs = bench_sub.add_parser(
        "serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="benchmark a running OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Sends a dataset of prompts (random, ShareGPT, prefix-repetition) to a running "
        "server at a request rate and concurrency, streaming each answer, and prints throughput and "
        "latency percentiles as `vllm bench serve` does. --sweep-input-lens measures TTFT per context "
        "length one request at a time; --compare-results sets such sweeps side by side per cp degree. "
        "A failed request (an error answer, a broken stream) is counted and its message reported; "
        "the exit status is 1 when none succeeded, 2 for a bad flag or an unreachable server.",
    )
    add_bench_serve_args(bs)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /version, /metrics. SIGTERM or Ctrl-C finishes the requests in flight (see "
        "--shutdown-timeout) and exits 0.",
    )
    add_model_positional(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log each HTTP request as one JSON line (method, path, status, duration, client); default off",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name(s) in the API: a request may name any, /v1/models lists them all, "
        "responses carry the first (default: MODEL as given)",
    )
    serve.add_argument(
        "--max-waiting", type=int, default=1024, help="requests waiting for their first token; beyond: 503"
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long to let the requests in flight finish (new ones get 503) "
        "before cutting them with an error; default: as long as they take (a second signal cuts "
        "them at once); 0: cut them at once, as vLLM's --shutdown-timeout 0 (its default)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): the model\'s calls are read '
        "from its text by --tool-call-parser",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model family writes tool calls: llama3_json (Llama 3.x), hermes (Qwen2.5, "
        "Qwen3), mistral, openai (gpt-oss's harmony); ringserve/server/tool_parsers.py",
    )
    add_cli_args(serve)


def _serve(args) -> int:
    from ringserve.server import run_server

    for flag, value in (("--max-waiting", args.max_waiting), ("--port", args.port)):
        low, high = (1, None) if flag == "--max-waiting" else (0, 65535)
        if value < low or (high is not None and value > high):
            allowed = f"{low} or more" if high is None else f"in {low}..{high}"
            print(f"error: argument {flag}: must be {allowed}, got {value}", file=sys.stderr)
            return 2
    timeout = args.shutdown_timeout
    if timeout is not None and not 0 <= timeout < float("inf"):
        print(
            f"error: argument --shutdown-timeout: must be 0 or more seconds, got {timeout}", file=sys.stderr
        )
        return 2
    problem = take_model_positional(args)
    if args.tool_call_parser is not None or args.enable_auto_tool_choice:
        # imported here: the server's modules are not loaded for the other commands
        from ringserve.server.tool_parsers import PARSERS

        if args.tool_call_parser not in PARSERS:  # as vLLM, auto tool choice needs a parser
            problem = f"argument --tool-call-parser: choose one of {', '.join(PARSERS)}"
            if args.tool_call_parser is None:
                problem = f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(PARSERS)})"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        options = from_cli_args(args)
    except OptionError as e:
        print(f"error: {cli_error(e)}", file=sys.stderr)
        return 2
    names = args.served_model_name or [options.model or "SmolLM2-135M-Instruct"]
    log_level = "debug" if getattr(args, "verbose", 0) > 1 else "info"
    if args.access_log:  # its own handler: the JSON lines show whatever the log level
        access = logging.getLogger("ringserve.access")
        access.setLevel(logging.INFO)
        access.addHandler(logging.StreamHandler(sys.stderr))
        access.propagate = False

    # The server binds the port, then its engine thread builds the engine (the thread that
    # steps it must be the one that ran its first torch ops: ringserve/server/async_engine.py).
    def build_engine():
        from ringserve.engine.engine import LLMEngine  # on the engine thread, after the bind

        return LLMEngine.from_options(options)

    return run_server(
        build_engine,
        names,
        args.host,
        args.port,
        args.api_key,
        args.max_waiting,
        log_level,
        shutdown_timeout_s=timeout,
        access_log=args.access_log,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )


def _generate(args) -> int:
    from ringserve.errors import RingserveError

    parsed = options_and_sampling(args)  # before stdin is read: a bad flag answers at once
    if parsed is None:
        return 2
    options, params = parsed
    try:
        prompts = _prompts(args.prompt)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = start_llm(options)
    if llm is None:
        return 2
    with llm:
        chat = (
            not args.no_chat
            and llm.tokenizer is not None
            and bool(
                llm.engine.input_processor.chat_template or getattr(llm.tokenizer, "chat_template", None)
            )
        )
        start = time.perf_counter()
        first_token = None
        outputs = {}
        try:
            for out in llm.generate_stream(prompts, params, chat=chat):
                if first_token is None:
                    first_token = time.perf_counter()
                if len(prompts) == 1:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
                if out.finished:
                    outputs[out.request_id] = out
        except RingserveError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if first_token is not None and len(prompts) == 1:
                sys.stdout.write("\n")  # end the streamed text's line before main says why
            raise
        end = time.perf_counter()
        if len(prompts) == 1:
            sys.stdout.write("\n")
        else:
            for i, (prompt, out) in enumerate(
                zip(prompts, sorted(outputs.values(), key=lambda o: int(o.request_id)))
            ):
                print(f"[{i}] {prompt}\n{out.text}\n(finish: {finish_reason(out, params)})\n")
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
        new_tokens = sum(len(o.token_ids) for o in outputs.values())
        ttft = (first_token - start) * 1000 if first_token else float("nan")
        decode_time = end - (first_token or start)
        rate = (new_tokens - len(outputs)) / decode_time if decode_time > 0 else float("nan")
        reasons = collections.Counter(finish_reason(o, params) for o in outputs.values())
        finish = ", ".join(r if len(outputs) == 1 else f"{n} {r}" for r, n in sorted(reasons.items()))
        print(
            f"prompt tokens: {prompt_tokens}, generated tokens: {new_tokens}, "
            f"time to first token: {ttft:.1f} ms, decode: {rate:.1f} tokens/s, total: {end - start:.2f} s, "
            f"finish: {finish}"
        )
    return 0


def _prompts(given: list[str]) -> list[str]:
    """The prompt arguments; none or "-": stdin when it is piped (not a terminal)."""
    if given and given != ["-"]:
        return given
    if given == ["-"] or (sys.stdin is not None and not sys.stdin.isatty()):
        try:
            text = sys.stdin.read().strip()
        except OSError:  # stdin closed or unreadable (e.g. under a test runner)
            text = ""
        if text:
            return [text]
        if given == ["-"]:
            raise ValueError("no prompt on stdin")
    return [DEFAULT_PROMPT]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except KeyboardInterrupt:  # the engine has stopped every rank on its way out
        print("interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def _run(args) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench" and args.bench == "serve":
        from ringserve.benchmarks.serve import main as bench_serve

        return bench_serve(args)
    if args.command == "chat":
        from ringserve.cli.chat import run_chat

        return run_chat(args)
    if args.command == "bench":
        return _measure(args)
    return 1


def _measure(args) -> int:
    """`ringserve bench allreduce` / `cp-calibrate`; 1 when the result contradicts its own
    table and was not saved."""
    import torch

    from ringserve.errors import MeasurementRejected

    if args.repeats < 1:
        print(f"error: argument --repeats: must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if args.bench == "cp-calibrate":
            from ringserve.parallel.cp import calibrate as cp_calibrate

            cp_calibrate.run(device, save=not args.no_save, repeats=args.repeats)
        else:
            from ringserve.parallel import allreduce_bench

            allreduce_bench.run(
                args.world_size,
                device,
                args.sizes or allreduce_bench.DEFAULT_SIZES[:6],
                args.iters,
                save=not args.no_save,
                repeats=args.repeats,
            )
    except MeasurementRejected as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
