"""Serving figures on one GPU (issue 11, item 9): `ringserve serve` on a Llama-3-8B-shaped
model with random bf16 weights, driven by `ringserve bench serve` at concurrency 1, 16 and
64 (1K tokens in, 128 out, --ignore-eos); each run's JSON (and the last one's plot) in OUT.

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
        for c in args.concurrency:
            name = f"serve_c{c}.json"
            cmd = [
                sys.executable, "-m", "ringserve.cli", "bench", "serve",
                "--port", str(args.port), "--dataset-name", "random",
                "--random-input-len", "1024", "--random-output-len", "128", "--ignore-eos",
                "--max-concurrency", str(c), "--num-prompts", str(max(16, args.prompts_per_slot * c)),
                "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", args.out,
                "--result-filename", name, "--disable-tqdm",
            ]  # fmt: skip
            if c == args.concurrency[-1]:
                cmd += ["--plot", os.path.join(args.out, f"serve_c{c}.png")]
            subprocess.run(cmd, check=True)
            with open(os.path.join(args.out, name)) as f:
                result = json.load(f)
            summary[c] = {
                k: v for k, v in result.items() if k.startswith(("median_", "p50_", "p90_", "p99_", "mean_"))
            }
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
