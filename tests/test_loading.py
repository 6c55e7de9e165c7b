"""Checkpoint loading: sharded files, dtypes, and errors that name what is wrong."""

import json
import os
import shutil

import pytest
import torch

from ringserve import LLM, ModelLoadError
from ringserve.engine.engine import LLMEngine

from conftest import hf_model, save_tiny_model
from helpers import engine_logits


def test_sharded_checkpoint_with_index(tmp_path):
    folder = save_tiny_model("qwen3_moe", str(tmp_path / "m"), max_shard_size="60KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 2
    tokens = list(range(3, 30))
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    ours = engine_logits(LLMEngine(folder, device="cpu", dtype="float32"), tokens, prefill=len(tokens))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_close_to_float32(tiny_model_dir):
    folder = tiny_model_dir("llama")
    tokens = list(range(1, 25))
    full = engine_logits(LLMEngine(folder, device="cpu", dtype="float32"), tokens, prefill=20)
    engine = LLMEngine(folder, device="cpu", dtype="bfloat16")
    assert engine.executor.worker.model.lm_head.weight.dtype == torch.bfloat16
    half = engine_logits(engine, tokens, prefill=20)
    assert (half - full).norm() / full.norm() < 3e-2


def test_missing_folder():
    with pytest.raises(ModelLoadError, match="no/such/folder"):
        LLM("/no/such/folder", device="cpu")


def test_unknown_architecture(tmp_path, tiny_model_dir):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(folder), device="cpu")


def test_truncated_weight_file(tmp_path, tiny_model_dir):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(folder), device="cpu")


def test_missing_index_shard(tmp_path):
    folder = save_tiny_model("llama", str(tmp_path / "m"), max_shard_size="60KB")
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(ModelLoadError, match=shard):
        LLM(folder, device="cpu")


def test_shape_mismatch_names_the_tensor(tmp_path, tiny_model_dir):
    folder = tmp_path / "wrong"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100  # the checkpoint's MLP is 96 wide
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape"):
        LLM(str(folder), device="cpu")


def test_missing_tensor_is_named(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(tiny_model_dir("mixtral"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.up_proj\[expert 2\]"):
        LLM(str(folder), device="cpu")


def test_gguf_path_that_does_not_exist():
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        LLM("/tmp/missing.gguf", device="cpu")


def test_unknown_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(tiny_model_dir("llama"), device="cpu", dtype="float8")
