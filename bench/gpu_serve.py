"""Serving figures on one GPU (issues 11 and 26): a server on a Llama-3-8B-shaped model with
random bf16 weights, driven by `ringserve bench serve` through the chat endpoint: at
concurrency 1, 16 and 64 (about 1K tokens in, lengths varying by --range-ratio, 128 out,
--ignore-eos); bursts of N simultaneous prompts beside the same burst with one output token
(its last TTFT: the time to prefill N prompts, the bound a burst's p99 TTFT is held to);
Poisson arrivals at each --rates rate with goodput at TTFT 350 ms / TPOT 25 ms; and the
prefix-repetition dataset (--prefix-len shared tokens, --suffix-len new ones). Each run's
JSON (and plots) in OUT, names prefixed by --tag.

  PYTHONPATH=. python bench/gpu_serve.py --tokenizer TOKENIZER_FOLDER --out $OUT
  PYTHONPATH=. python bench/gpu_serve.py ... --server-args "--max-num-batched-tokens 16384" --tag pf_
  PYTHONPATH=. python bench/gpu_serve.py ... --peer   # transformers serve --continuous-batching

The model folder (--model-dir, safetensors, ~16 GB) is written once and kept, with the given
folder's tokenizer: its vocabulary sets the model's (the Llama-3 tokenizer is not on the GPU
machine), so the LM head is vocab x 4096 instead of 128256 x 4096; everything else is
Llama-3-8B's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import torch

# the 8B-shaped model every serving and structured-output bench uses, written once a machine
MODEL_DIR = "/tmp/llama8b-random"


def make_model(tokenizer_dir: str, folder: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), folder)


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 400) -> None:
    """Until GET /v1/models answers (both servers have it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become ready")


@contextlib.contextmanager
def running(cmd: list[str], port: int, log_path: str):
    """The server runs with its output in log_path (kept with the results, to diagnose)."""
    print("$", shlex.join(cmd), f"> {log_path}", flush=True)
    start = time.monotonic()
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, server)
        print(f"server ready after {time.monotonic() - start:.0f} s", flush=True)
        yield
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                print(f"server exited with {server.wait(timeout=60)} after SIGTERM", flush=True)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                print("server did not exit within 60 s of SIGTERM: killed", flush=True)
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--model-dir", default=MODEL_DIR, help="written once, then reused")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--tag", default="", help="prefix of the result files")
    parser.add_argument("--server-args", default="", help="extra flags for `ringserve serve`")
    parser.add_argument("--peer", action="store_true", help="serve with `transformers serve` instead")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--prompts-per-slot", type=int, default=4, help="num-prompts = this x concurrency")
    parser.add_argument("--min-prompts", type=int, default=16, help="num-prompts at least this")
    parser.add_argument("--range-ratio", type=float, default=0.15, help="input lengths 1024 x (1 +- r)")
    parser.add_argument("--bursts", default="", help="burst sizes, e.g. 16,64 (none: skip)")
    parser.add_argument("--rates", default="", help="request rates to sweep, e.g. 8,12,16,20 (none: skip)")
    parser.add_argument("--rate-prompts", type=int, default=200, help="requests per swept rate")
    parser.add_argument("--prefix-len", type=int, default=0, help="prefix-repetition run (0: skip)")
    parser.add_argument("--suffix-len", type=int, default=200)
    args = parser.parse_args()
    # A `timeout` around this script sends SIGTERM: leave through `finally`, which stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = args.model_dir
    if not os.path.exists(os.path.join(folder, "config.json")):
        start = time.monotonic()
        make_model(args.tokenizer, folder)
        print(f"model folder written in {time.monotonic() - start:.0f} s", flush=True)
    if args.peer:
        # Its GET /v1/models scans the Hugging Face cache, and fails (500) where there is none.
        os.makedirs(os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"), exist_ok=True)
        server = ["transformers", "serve", folder, "--continuous-batching", "--cb-use-cuda-graph"]
        server += ["--port", str(args.port)]
    else:
        server = [sys.executable, "-m", "ringserve.cli", "serve", folder, "--port", str(args.port)]
        server += ["--max-num-seqs", "64", *shlex.split(args.server_args)]
    summary = {}
    # transformers serve refuses vLLM's ignore_eos (HTTP 422); random weights all but never
    # pick EOS (1 in ~49K a token), so its outputs run to max_tokens as well
    ignore_eos = () if args.peer else ("--ignore-eos",)

    def bench(name: str, *flags: str) -> dict:
        name = args.tag + name
        cmd = [
            sys.executable, "-m", "ringserve.cli", "bench", "serve", "--port", str(args.port),
            "--model", folder, "--tokenizer", args.tokenizer, "--endpoint", "chat", *ignore_eos,
            "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99,100", "--goodput", "ttft:350", "tpot:25", "--save-result",
            "--result-dir", args.out, "--result-filename", name + ".json", "--disable-tqdm", *flags,
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        with open(os.path.join(args.out, name + ".json")) as f:
            result = json.load(f)
        summary[name] = {
            k: v
            for k, v in result.items()
            if k.startswith(
                ("median_", "p50_", "p99_", "p100_ttft", "request_goodput", "max_rate", "output_throughput")
            )
        }
        return result

    def random_text(output_len: int = 128) -> tuple[str, ...]:
        return (
            "--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", str(output_len),
            "--random-range-ratio", str(args.range_ratio),
        )  # fmt: skip

    with running(server, args.port, os.path.join(args.out, f"{args.tag}server.log")):
        for c in args.concurrency:
            plot = (
                ("--plot", os.path.join(args.out, f"{args.tag}serve_c{c}.png"))
                if c == args.concurrency[-1]
                else ()
            )
            n = max(args.min_prompts, args.prompts_per_slot * c)
            # Each run its own prompts (--seed): none finds another's in the prefix cache.
            load = ("--max-concurrency", str(c), "--num-prompts", str(n), "--seed", str(c))
            bench(f"serve_c{c}", *random_text(), *load, *plot)
        for n in [int(b) for b in args.bursts.split(",") if b]:
            burst = ("--max-concurrency", str(n), "--num-prompts", str(n))
            bound = bench(f"serve_burst{n}_prefill", *random_text(1), *burst, "--seed", str(1000 + n))
            full = bench(f"serve_burst{n}", *random_text(), *burst, "--seed", str(2000 + n))
            summary[args.tag + f"serve_burst{n}"]["p99_ttft_over_prefill_all"] = (
                full["p99_ttft_ms"] / bound["p100_ttft_ms"]
            )
        if args.rates:
            bench(
                "serve_rates", *random_text(), "--num-prompts", str(args.rate_prompts),
                "--request-rate-sweep", args.rates, "--plot", os.path.join(args.out, f"{args.tag}serve_rates.png"),
            )  # fmt: skip
        if args.prefix_len:
            bench(
                "serve_prefix", "--dataset-name", "prefix-repetition", "--num-prompts", "64",
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "32",
                "--max-concurrency", "1",
            )  # fmt: skip
    print(json.dumps(summary, indent=1))
    with open(os.path.join(args.out, f"{args.tag}serve_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
