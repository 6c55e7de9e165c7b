"""Shared fixtures: tiny random Hugging Face checkpoints of every supported architecture."""

from __future__ import annotations

import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch

from ringserve.model.tiny_models import save_tiny_model


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
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    return converted_folder(builtin_model_path())


@pytest.fixture(scope="session")
def smol_vocab_model(tmp_path_factory, builtin_dir):
    """A tiny random Llama whose vocabulary is SmolLM2's (49,152 real tokens), with
    SmolLM2's tokenizer files: for what needs real text, quickly."""
    import shutil

    import transformers as tf

    from ringserve.model.tiny_models import TINY, save_random_model

    folder = str(tmp_path_factory.mktemp("smol_vocab_llama"))
    config = tf.LlamaConfig(**{**TINY, "vocab_size": 49152}, tie_word_embeddings=True)
    save_random_model(config, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{builtin_dir}/{name}", folder)
    return folder


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
