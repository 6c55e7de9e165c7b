"""Command line: `ringserve generate ...`."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (config.json + safetensors) or a .gguf file; "
        "default: the built-in SmolLM2-135M-Instruct",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (a GPU if there is one)")
    p.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16, or auto (the checkpoint's own)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    p.add_argument(
        "--allreduce",
        default="auto",
        choices=["auto", "torch", "one_shot", "two_shot"],
        help="tensor-parallel allreduce: auto picks by message size from `ringserve bench allreduce`",
    )
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="EP ranks per host; an EP group spanning hosts uses the two-shot all-to-all "
        "(default under torchrun: its LOCAL_WORLD_SIZE)",
    )
    p.add_argument(
        "--cp-algo",
        default="auto",
        choices=["auto", "pass_kv", "pass_q"],
        help="context-parallel ring: auto chooses per step from new vs cached tokens",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait before a dead or hung rank stops the run",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (prompt + output) in tokens; default: the model's context",
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV-cache blocks; default: from the memory budget"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens computed per step; longer prompts are prefilled in chunks",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: decode steps launch their kernels from Python (slower; for debugging)",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: info logs, -vv: debug logs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="LLM inference engine for long contexts")
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
        help="prompt text; several prompts run as one batch (default: 'What is the capital of France?')",
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="new tokens at most per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; higher is more random")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens up to this mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument(
        "--no-chat",
        action="store_true",
        help="raw completion: do not wrap the prompt in the model's chat template",
    )
    _add_model_args(gen)

    _add_serve_parser(sub)

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
    ar.add_argument("--iters", type=int, default=20, help="timed repetitions per size")
    ar.add_argument("--no-save", action="store_true", help="print only; keep the stored thresholds")
    cal = bench_sub.add_parser(
        "cp-calibrate",
        help="measure attention FLOP/s and ring bandwidth for the pass-KV / pass-Q choice",
        description="Measures this device's attention rate and the bandwidth of one ring hop between "
        "two local ranks, and stores them for `--cp-algo auto`. Across hosts, the hop between "
        "hosts is the slower link: measure there too.",
    )
    cal.add_argument("--device", default="auto", help="cpu, cuda or auto")
    cal.add_argument("--no-save", action="store_true", help="print only")
    return parser


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /version, /metrics. SIGTERM or Ctrl-C ends in-flight requests and exits 0.",
    )
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: MODEL as given)"
    )
    serve.add_argument(
        "--max-waiting", type=int, default=1024, help="requests waiting for their first token; beyond: 503"
    )
    _add_model_args(serve)


def _serve(args) -> int:
    from ringserve import LLM
    from ringserve.errors import RingserveError
    from ringserve.server import run_server

    model = args.model_pos or args.model
    try:
        llm = LLM(
            model=model,
            device=args.device,
            dtype=args.dtype,
            tp=args.tp,
            cp=args.cp,
            ep=args.ep,
            show_progress=sys.stderr.isatty(),
            max_model_len=args.max_model_len,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
            allreduce=args.allreduce,
            timeout_s=args.timeout,
            cp_algo=args.cp_algo,
            ranks_per_host=args.ranks_per_host,
        )
    except (RingserveError, ValueError, NotImplementedError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or model or "SmolLM2-135M-Instruct"
    log_level = {0: "info", 1: "info"}.get(args.verbose, "debug")
    return run_server(llm.engine, name, args.host, args.port, args.api_key, args.max_waiting, log_level)


def _generate(args) -> int:
    from ringserve import LLM, SamplingParams
    from ringserve.errors import RingserveError

    prompts = args.prompt or ["What is the capital of France?"]
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            tp=args.tp,
            cp=args.cp,
            ep=args.ep,
            show_progress=sys.stderr.isatty(),
            max_model_len=args.max_model_len,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
            allreduce=args.allreduce,
            timeout_s=args.timeout,
            cp_algo=args.cp_algo,
            ranks_per_host=args.ranks_per_host,
        )
    except (RingserveError, ValueError, NotImplementedError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with llm:
        chat = (
            not args.no_chat
            and llm.tokenizer is not None
            and bool(getattr(llm.tokenizer, "chat_template", None))
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
        end = time.perf_counter()
        if len(prompts) == 1:
            sys.stdout.write("\n")
        else:
            for i, (prompt, out) in enumerate(
                zip(prompts, sorted(outputs.values(), key=lambda o: int(o.request_id)))
            ):
                print(f"[{i}] {prompt}\n{out.text}\n")
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
        new_tokens = sum(len(o.token_ids) for o in outputs.values())
        ttft = (first_token - start) * 1000 if first_token else float("nan")
        decode_time = end - (first_token or start)
        rate = (new_tokens - len(outputs)) / decode_time if decode_time > 0 else float("nan")
        print(
            f"prompt tokens: {prompt_tokens}, generated tokens: {new_tokens}, "
            f"time to first token: {ttft:.1f} ms, decode: {rate:.1f} tokens/s, total: {end - start:.2f} s"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        import torch

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if args.bench == "cp-calibrate":
            from ringserve.parallel import cp_calibrate

            cp_calibrate.run(device, save=not args.no_save)
            return 0
        from ringserve.parallel import allreduce_bench

        allreduce_bench.run(
            args.world_size,
            device,
            args.sizes or allreduce_bench.DEFAULT_SIZES[:6],
            args.iters,
            save=not args.no_save,
        )
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
