"""Checkpoint loading: sharded files, dtypes, and errors that name what is wrong."""

import json
import os
import shutil

import pytest
import torch

from ringserve import LLM, ModelLoadError
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.tiny_models import hf_model, save_tiny_model


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


def test_missing_fused_part_is_named(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing_k"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 2 tensor.*layers\.0\.self_attn\.k_proj\.weight") as e:
        LLM(str(folder), device="cpu")
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)


def test_fused_part_shape_mismatch_names_the_tensor(tmp_path, tiny_model_dir):
    folder = tmp_path / "wrong_kv"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 1  # the checkpoint has 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"self_attn\.k_proj\.weight in .* shape \(32, 64\).*\(16, 64\)"):
        LLM(str(folder), device="cpu")


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_fused_rows_hold_each_ranks_slices(rank, tiny_model_dir):
    """From the in-memory mapping: qkv_proj is this rank's q heads, then its k and v heads
    (at tp=4 each of the 2 KV heads is on two ranks), gate_up_proj its gate then up rows."""
    from ringserve.config import ModelConfig, TPShard
    from ringserve.model.tp_shard_plan import TensorParallelPlan
    from ringserve.model.weights import load_model

    folder = tiny_model_dir("qwen3")  # q_norm/k_norm; head_dim 32 with 4 heads
    hf = hf_model(folder).state_dict()
    config = ModelConfig.from_pretrained(folder)
    tp = 4 if rank == 3 else 2
    shard = TPShard.of(config, rank, tp)
    plan = TensorParallelPlan(config, shard) if tp > 1 else None
    model = load_model(config, None, torch.device("cpu"), torch.float32, plan, tensors=hf, shard=shard)
    d, inter = config.head_dim, shard.intermediate_size
    q_rows, kv_rows = shard.num_heads * d, shard.num_kv_heads * d
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        qkv = model.get_parameter(f"{p}.self_attn.qkv_proj.weight")
        q0, kv0 = rank * q_rows, shard.kv_head_start * d
        expected = torch.cat(
            [
                hf[f"{p}.self_attn.q_proj.weight"][q0 : q0 + q_rows],
                hf[f"{p}.self_attn.k_proj.weight"][kv0 : kv0 + kv_rows],
                hf[f"{p}.self_attn.v_proj.weight"][kv0 : kv0 + kv_rows],
            ]
        )
        assert torch.equal(qkv, expected)
        gate_up = model.get_parameter(f"{p}.mlp.gate_up_proj.weight")
        rows = slice(rank * inter, (rank + 1) * inter)
        expected = torch.cat([hf[f"{p}.mlp.gate_proj.weight"][rows], hf[f"{p}.mlp.up_proj.weight"][rows]])
        assert torch.equal(gate_up, expected)
