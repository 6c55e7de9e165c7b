"""The engine's set-up before its first request: where the model is, on which device, which
ranks run it (refusing a layout that cannot work before any process starts), its tokenizer
and the tokens that end a generation."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

import torch

from ringserve.config import ModelConfig, ParallelConfig
from ringserve.engine.executor import (
    LocalExecutor,
    MultiprocessExecutor,
    WorkerSpec,
    run_torchrun_rank,
    torchrun_env,
)
from ringserve.errors import ModelLoadError
from ringserve.model.gguf_import import builtin_model_path, converted_folder
from ringserve.parallel.mesh import Mesh
from ringserve.parallel.tp import validate_tp

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None, show_progress: bool = False) -> str:
    """A Hugging Face folder for `model`: a folder as is, a .gguf file converted (with a
    progress bar when show_progress), None the built-in."""
    if model is None:
        return converted_folder(builtin_model_path(), show_progress)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return converted_folder(model, show_progress)
    if os.path.isdir(model):
        return model
    raise ModelLoadError(
        f"model not found: {model!r} is neither a folder with config.json and safetensors "
        "nor a .gguf file (models are loaded from local paths, not downloaded)"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU")
    return device


def check_parallel_layout(config: ModelConfig, parallel: ParallelConfig, device: torch.device) -> None:
    """Refuse what cannot work before any process starts or any weight is read."""
    if parallel.tp > 1:
        validate_tp(config, parallel.tp)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and torchrun_env() is None and parallel.world_size > gpus:
        raise ValueError(
            f"dp x cp x tp = {parallel.dp} x {parallel.cp} x {parallel.tp} = {parallel.world_size} "
            f"ranks need as many GPUs on this host (without torchrun); this machine has {gpus}"
        )
    if parallel.ep > 1 and (not config.is_moe or config.num_experts % parallel.ep):
        raise ValueError(
            f"ep={parallel.ep} needs a mixture-of-experts model whose experts divide evenly; "
            f"{config.architecture} has {config.num_experts} experts"
        )
    Mesh.of(parallel)  # raises for hosts (ranks_per_host) the layout cannot fill evenly


def start_executor(
    spec: WorkerSpec,
    device: torch.device,
    show_progress: bool,
    weights: Mapping[str, torch.Tensor] | None,
) -> LocalExecutor | MultiprocessExecutor:
    """The ranks that run the model: this process alone, or rank 0 of a dp x cp x tp world (its
    own processes, or torchrun's). A non-zero torchrun rank serves rank 0 here, then exits."""
    parallel = spec.parallel
    if parallel.world_size > 1 or torchrun_env() is not None:
        if weights is not None:
            raise ValueError("in-memory weights are only supported on one rank")
        env = torchrun_env()
        if env is not None and env[0] != 0:
            run_torchrun_rank(spec)  # serves rank 0's steps, then ends this process
        return MultiprocessExecutor(spec, show_progress)
    return LocalExecutor(spec, device, show_progress, weights)


def load_tokenizer(folder: str):
    if not any(
        os.path.isfile(os.path.join(folder, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        logger.warning("%s has no tokenizer: prompts must be token ids", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# generation_config.json's keys that set a request's defaults (vLLM's list), and their names here
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(source: str, model_folder: str) -> dict:
    """The sampling defaults a model's creator recommends, from generation_config.json (source:
    auto, the model's folder; vllm, none; or a folder): SamplingParams field -> value. A
    request's own value wins; max_tokens caps even a request's own, as in vLLM."""
    folder = None if source == "vllm" else model_folder if source == "auto" else source
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    found = {ours: config[key] for key, ours in GENERATION_DEFAULTS.items() if config.get(key) is not None}
    if found:
        logger.info("default sampling parameters from %s: %s (a request's own values win)", path, found)
    return found


def eos_token_ids(folder: str, config: ModelConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids = set(config.eos_token_ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
