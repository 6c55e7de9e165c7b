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
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    info = {"gpu": gpu, "torch": torch.__version__}
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


def llama32_1b_config():
    """Llama-3.2-1B's shape (a draft for Llama-3-8B: its vocabulary, tied embeddings)."""
    config = llama3_8b_config()
    config.update(
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            head_dim=64,
            tie_word_embeddings=True,
        )
    )
    return config


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


def random_model_folder(config, folder: str, device: str = "cuda") -> str:
    """A transformers model of `config` with random bf16 weights (seed 0), saved to `folder`
    (for what loads from a folder only, e.g. a draft model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(folder)
    del model
    return folder


def random_eagle3_head(config, folder: str, draft_vocab: int = 32000, device: str = "cuda") -> str:
    """An EAGLE-3 head for a target of transformers config `config`, random bf16 weights
    (seed 0) in the published layout (EAGLE3-LLaMA3.1-Instruct-8B's names), saved to `folder`."""
    from safetensors.torch import save_file

    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d, inter, vocab = h // heads, config.intermediate_size, config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    keep = torch.arange(draft_vocab, device=device) * (vocab // draft_vocab)
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": keep - torch.arange(draft_vocab, device=device),
    }
    os.makedirs(folder, exist_ok=True)
    save_file(
        {k: v.contiguous().cpu() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors")
    )
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": 2048,
        "rope_theta": 500000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    return folder


def write_json(name: str, data) -> None:
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, name), "w") as f:
        json.dump(data, f, indent=2)
