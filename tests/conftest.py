"""Shared fixtures: tiny random Hugging Face checkpoints of every supported architecture."""

from __future__ import annotations

import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch


def pytest_configure(config):
    """Every test, and every process a test starts (ranks, servers, the CLI), keeps its
    measurements and GGUF conversions in one temporary cache of this session, never the
    user's ~/.cache/ringserve: set before any test runs, inherited by subprocesses. The
    built-in model is converted into it once per session (~15-20 s, by `builtin_dir`)."""
    from ringserve.cache_dir import CACHE_ENV

    config.ringserve_cache = tempfile.mkdtemp(prefix="ringserve-test-cache-")
    os.environ[CACHE_ENV] = config.ringserve_cache


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "ringserve_cache", ""), ignore_errors=True)


# Small enough to be quick on 2 cores, big enough to exercise GQA, q/k norms, rope scaling,
# MoE routing with dense layers, and tied embeddings.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

ARCHITECTURES = ["llama", "mistral", "qwen3", "mixtral", "qwen3_moe", "llama4", "gpt_oss"]


def llama3_rope() -> dict:
    """Llama 3's RoPE scaling, with an original context of 64 so that the tiny prompts reach
    past it."""
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def make_hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters=llama3_rope(),
        )
    if arch == "qwen3":
        # head_dim 32 with 4 heads: 128 wide attention on a 64 wide model
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    if arch == "mistral":
        # A window of 8 positions: prompts of a few dozen tokens span several windows.
        return tf.MistralConfig(**TINY, sliding_window=8, head_dim=16)
    if arch == "mixtral":
        return tf.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        )
    if arch == "llama4":
        # Layer 1 is NoPE (no_rope_layer_interval 2; Scout: 4) with temperature tuning that
        # varies over a few tokens (floor_scale 4) and MoE (top-2, so the input scaling is summed
        # over choices); layer 0 is dense, with RoPE over chunks of 16 tokens.
        return tf.Llama4TextConfig(
            **TINY | dict(intermediate_size=48),
            architectures=["Llama4ForCausalLM"],
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=16,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=llama3_rope(),
        )
    if arch == "gpt_oss":
        # Sliding (8 tokens) and full layers; a SwiGLU limit the activations reach; YaRN RoPE.
        return tf.GptOssConfig(
            **TINY | dict(intermediate_size=64),  # MXFP4 groups of 32 along it (tests/test_mxfp4.py)
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        )
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: str, seed: int = 0, **save_kwargs) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_hf_config(arch), dtype=torch.float32)
    # Larger weights than the default init make logits spread out, so greedy choices are
    # decided by clear margins and any error in the engine shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith(("bias", "sinks")):  # zero by default: make them count
                p.normal_(0, 0.5)
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> folder of a saved tiny random model (made once per test session)."""
    cache = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = save_tiny_model(arch, str(tmp_path_factory.mktemp(arch)))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def builtin_dir():
    from ringserve.gguf_import import builtin_model_path, converted_folder

    return converted_folder(builtin_model_path())


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))


# A live OpenAI-compatible server on the built-in model (tests/test_server.py, test_bench_serve.py)

KEY = "test-key"
NAME = "smol"
MAX_MODEL_LEN = 512
MAX_WAITING = 256  # 200 concurrent streams wait at once


@pytest.fixture(scope="module")
def live():
    """A uvicorn server in a thread of this process (so tests can look at its engine), one per
    test module; its API key is KEY and its model NAME."""
    import httpx2 as httpx
    import openai

    from ringserve.config import EngineConfig
    from ringserve.engine.engine import LLMEngine
    from ringserve.server import build_app

    from helpers import serve_in_thread

    engine = LLMEngine(
        None, device="cpu", dtype="float32", engine_config=EngineConfig(max_model_len=MAX_MODEL_LEN)
    )
    app = build_app(engine, NAME, api_key=KEY, max_waiting=MAX_WAITING)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(
            url=url,
            engine=engine,
            app=app,
            client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0),
            aclient=lambda: openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0),
            http=httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60),
            idle_free_blocks=engine.block_manager.num_blocks,
        )
    assert engine.executor is None  # the lifespan closed the engine


def scrape_metrics(live) -> dict:
    """GET /metrics parsed by prometheus_client's parser: sample name -> value (model NAME)."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == NAME:
                values[s.name] = values.get(s.name, 0) + s.value
    return values
