"""Serving figures on one GPU (issues 11 and 26): `ringserve serve` on a Llama-3-8B-shaped
model with random bf16 weights, driven by `ringserve bench serve` at concurrency 1, 16 and
64 (about 1K tokens in, lengths varying by --range-ratio, 128 out, --ignore-eos), then
Poisson arrivals at each --rates rate with goodput at TTFT 350 ms / TPOT 25 ms, and the
prefix-repetition dataset (--prefix-len shared tokens, --suffix-len new ones); each run's
JSON (and plots) in OUT.

  PYTHONPATH=. python bench/gpu_serve.py --tokenizer TOKENIZER_FOLDER --out $OUT

The model folder is written once (safetensors, ~16 GB) with the given folder's tokenizer:
its vocabulary sets the model's (the Llama-3 tokenizer is not on the GPU machine), so the
LM head is vocab x 4096 instead of 128256 x 4096; everything else is Llama-3-8B's shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch


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


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--prompts-per-slot", type=int, default=4, help="num-prompts = this x concurrency (>= 16)"
    )
    parser.add_argument("--range-ratio", type=float, default=0.15, help="input lengths 1024 x (1 +- r)")
    parser.add_argument("--rates", default="", help="request rates to sweep, e.g. 8,12,16,20 (none: skip)")
    parser.add_argument("--rate-prompts", type=int, default=200, help="requests per swept rate")
    parser.add_argument("--prefix-len", type=int, default=0, help="prefix-repetition run (0: skip)")
    parser.add_argument("--suffix-len", type=int, default=200)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="llama8b-")
    start = time.monotonic()
    make_model(args.tokenizer, folder)
    print(f"model folder written in {time.monotonic() - start:.0f} s", flush=True)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringserve.cli",
            "serve",
            folder,
            "--port",
            str(args.port),
            "--max-num-seqs",
            "64",
        ],
        start_new_session=True,
    )
    try:
        start = time.monotonic()
        wait_healthy(args.port, server)
        print(f"server healthy after {time.monotonic() - start:.0f} s", flush=True)
        summary = {}

        def bench(name: str, *flags: str) -> dict:
            cmd = [
                sys.executable, "-m", "ringserve.cli", "bench", "serve", "--port", str(args.port),
                "--tokenizer", args.tokenizer, "--endpoint", "chat", "--ignore-eos",
                "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,90,99", "--goodput", "ttft:350", "tpot:25", "--save-result",
                "--result-dir", args.out, "--result-filename", name + ".json", "--disable-tqdm", *flags,
            ]  # fmt: skip
            subprocess.run(cmd, check=True)
            with open(os.path.join(args.out, name + ".json")) as f:
                result = json.load(f)
            summary[name] = {
                k: v
                for k, v in result.items()
                if k.startswith(
                    ("median_", "p50_", "p99_", "request_goodput", "max_rate", "output_throughput")
                )
            }
            return result

        random_text = ("--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "128")
        random_text += ("--random-range-ratio", str(args.range_ratio))
        for c in args.concurrency:
            plot = ("--plot", os.path.join(args.out, f"serve_c{c}.png")) if c == args.concurrency[-1] else ()
            n = max(16, args.prompts_per_slot * c)
            bench(f"serve_c{c}", *random_text, "--max-concurrency", str(c), "--num-prompts", str(n), *plot)
        if args.rates:
            bench(
                "serve_rates", *random_text, "--num-prompts", str(args.rate_prompts),
                "--request-rate-sweep", args.rates, "--plot", os.path.join(args.out, "serve_rates.png"),
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
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            print(f"server exited with {server.wait(timeout=60)} after SIGTERM", flush=True)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            print("server did not exit within 60 s of SIGTERM: killed", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
