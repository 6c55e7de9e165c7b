"""Shared pieces of the GPU benchmarks: the machine's two ceilings, timing, model shapes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch


def cuda_time_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of fn() in ms, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def wall_ms(fn) -> float:
    """Wall time of one call of fn() in ms, the device synchronised around it (first calls:
    plans, compiles)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def event_time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median device time of fn() in ms, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate, measured."""
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = event_time_ms(lambda: dst.copy_(src))
    copy_bw = 2 * src.nbytes / (ms / 1000)
    src = dst = None  # free before the matmul
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = event_time_ms(lambda: a @ b)
    matmul = 2 * m**3 / (ms / 1000)
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops": matmul}


def gpu_state() -> str | None:
    """The GPU's clocks, temperature and power now (nvidia-smi), or None without it: beside a
    figure, to tell a slow run from a throttled one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def machine_info() -> dict:
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    # The device's copy of the tree may carry a stale .git: the commit given to the run wins.
    info["commit"] = os.environ.get("RINGSERVE_COMMIT", "")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            pass
    info["date"] = time.strftime("%Y-%m-%d")
    return info


def llama3_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    )


def random_llama3_8b(device: str = "cuda") -> tuple[str, dict]:
    """A folder with Llama-3-8B's config.json, and random bf16 weights of its shape (seed 0)
    on the device, for LLMEngine(folder, weights=...)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    config = llama3_8b_config()
    folder = tempfile.mkdtemp()
    config.save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return folder, model.state_dict()


def write_json(name: str, data) -> None:
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, name), "w") as f:
        json.dump(data, f, indent=2)
