"""Pre-quantised FP8 checkpoints: compressed-tensors (written by compressed-tensors itself:
FP8_DYNAMIC per channel, FP8 per tensor with static input scales, FP8_BLOCK) and
transformers' "fp8" block format (written byte for byte: no writer for it outside a GPU).
Row-wise ones (per channel, per tensor) are served in FP8 as stored, block-scaled ones
dequantised into the model's dtype. Each is checked against its library's own
dequantisation, and transformers run on those dequantised weights saved as a plain
checkpoint (with each projection's input quantised per token where the engine serves FP8)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringserve import LLM, ModelLoadError, SamplingParams
from ringserve.config import ModelConfig
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.kernels.kv_quant import FP8_DTYPE
from ringserve.model.fp8 import dequantize_fp8
from ringserve.model.tiny_models import TINY, hf_greedy, hf_model, save_random_model
from ringserve.model.weights import load_model

from helpers import quantize_inputs_per_token

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# Blocks that divide neither the 64 wide hidden size nor the 88 wide MLP (nor its 44 rows a
# rank holds at tp=2): partial blocks at the edges, blocks cut by the shard boundary.
BLOCK = [16, 24]
FORMATS = ["ct_channel", "ct_tensor", "ct_block", "fp8_block"]
ROW_WISE = ("ct_channel", "ct_tensor")  # served in FP8 as stored
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _llama_config():
    import transformers as tf

    # Untied, as published FP8 checkpoints are: lm_head stays unquantised (ignored).
    return tf.LlamaConfig(**{**TINY, "intermediate_size": 88}, tie_word_embeddings=False)


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight")


def _compressed_tensors(base: str, folder, scheme: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' own writer: its scheme applied to the transformers model, scales
    from each weight's absolute maximum (what llm-compressor's minmax observer computes),
    compressed by its ModelCompressor. Returns its own dequantisation of each weight."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model = hf_model(base)
    quant_scheme = preset_name_to_scheme(scheme, ["Linear"])
    if scheme == "FP8_BLOCK":
        quant_scheme.weights.block_structure = BLOCK
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=["lm_head"])
    )
    args = quant_scheme.weights
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight.abs()
            if args.strategy == "tensor":
                amax = w.amax().reshape(1)
            elif args.strategy == "channel":
                amax = w.amax(1, keepdim=True)
            else:
                amax = _block_amax(w, BLOCK)
            module.weight_scale.copy_(amax / FP8_MAX)
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)  # a static activation scale: present, not read
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{base}/config.json", folder / "config.json")
    ModelCompressor.from_pretrained_model(model).update_config(str(folder))
    return {
        name: dequantize(tensors[name], tensors[name + "_scale"], args=args, dtype=torch.float32).contiguous()
        for name in tensors
        if name + "_scale" in tensors
    }


def _block_amax(w: torch.Tensor, block) -> torch.Tensor:
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[: w.shape[0], : w.shape[1]] = w.abs()
    return padded.reshape(rows, block[0], cols, block[1]).amax((1, 3))


def _transformers_fp8(base: str, folder) -> dict[str, torch.Tensor]:
    """transformers' FineGrainedFP8Config layout, byte for byte: e4m3 `weight` and float32
    `weight_scale_inv` [ceil(out/16), ceil(in/24)] (amax / 448 per block), lm_head left out.
    Returns transformers' own dequantisation of each weight."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors = load_file(f"{base}/model.safetensors")
    packed, reference = {}, {}
    for name, w in tensors.items():
        if not _is_linear(name):
            packed[name] = w
            continue
        scale_inv = _block_amax(w, BLOCK) / FP8_MAX
        expanded = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        q = (w / expanded[: w.shape[0], : w.shape[1]]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        packed[name], packed[name + "_scale_inv"] = q, scale_inv
        reference[name] = _dequantize_fp8_weight(q, scale_inv, BLOCK, torch.float32)
    config = json.loads(open(f"{base}/config.json").read())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
        "modules_to_not_convert": ["lm_head"],
    }
    save_file(packed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    """format -> (quantised folder, plain folder of its library's dequantisation)."""
    base = save_random_model(_llama_config(), str(tmp_path_factory.mktemp("fp8_base")))
    made = {}

    def get(fmt: str):
        if fmt not in made:
            quantized, dense = tmp_path_factory.mktemp(fmt), tmp_path_factory.mktemp(fmt + "_dense")
            if fmt == "fp8_block":
                reference = _transformers_fp8(base, quantized)
            else:
                scheme = {"ct_channel": "FP8_DYNAMIC", "ct_tensor": "FP8", "ct_block": "FP8_BLOCK"}[fmt]
                reference = _compressed_tensors(base, quantized, scheme)
            plain = load_file(f"{base}/model.safetensors")
            assert set(reference) == {n for n in plain if _is_linear(n)}
            plain.update(reference)
            save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(f"{base}/config.json", dense / "config.json")
            made[fmt] = str(quantized), str(dense)
        return made[fmt]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_weights_equal_the_dequantised_reference(fmt, fp8_folders):
    quantized, dense = fp8_folders(fmt)
    config = ModelConfig.from_pretrained(quantized)
    assert config.quantization.method == ("fp8" if fmt == "fp8_block" else "compressed-tensors")
    ours = load_model(config, quantized, torch.device("cpu"), torch.float32).state_dict()
    reference = load_model(ModelConfig.from_pretrained(dense), dense, torch.device("cpu"), torch.float32)
    served_fp8 = 0
    for name, tensor in reference.state_dict().items():
        if ours[name].dtype == FP8_DTYPE:  # as stored: e4m3 bytes and a scale per row
            served_fp8 += 1
            got = ours[name].float() * ours[name.replace(".weight", ".weight_scale")][:, None]
            assert torch.equal(got, tensor), name
        else:
            assert torch.equal(ours[name], tensor), name
    # q/k/v, o, gate/up and down of each of the two layers; never the LM head
    assert served_fp8 == (8 if fmt in ROW_WISE else 0)
    assert ours["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_matches_transformers_on_its_dequantisation(fmt, fp8_folders):
    quantized, dense = fp8_folders(fmt)
    tokens = list(range(3, 30))
    reference = hf_model(dense)
    if fmt in ROW_WISE:  # FP8 matmuls: each projection's input quantised per token
        reference = quantize_inputs_per_token(reference)
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0]
        unquantized_inputs = hf_model(dense)(torch.tensor([tokens])).logits[0]
    ours = engine_logits(LLMEngine(quantized, device="cpu", dtype="float32"), tokens, prefill=20)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    if fmt in ROW_WISE:
        assert (unquantized_inputs - ref).abs().max() > 100 * (ours - ref).abs().max()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(quantized, device="cpu", dtype="float32") as llm:
        assert llm.generate([PROMPT], greedy)[0].token_ids == hf_greedy(reference, PROMPT, 12)


def test_block_fp8_checkpoint_tp2_equals_tp1(fp8_folders):
    """Each rank dequantises its rows (q/k/v, gate/up) or columns (o_proj, down_proj) with
    the scales of their positions in the whole tensor: 44 MLP rows a rank, blocks of 16."""
    quantized, dense = fp8_folders("fp8_block")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        with LLM(quantized, device="cpu", dtype="float32", tp=tp, timeout_s=60) as llm:
            runs.append(list(llm.generate([PROMPT], greedy)[0].token_ids))
    assert runs[0] == runs[1] == hf_greedy(hf_model(dense), PROMPT, 12)


@pytest.mark.parametrize("fmt", ROW_WISE)
def test_row_wise_fp8_checkpoint_under_tp_holds_its_slices_as_stored(fmt, fp8_folders):
    """A TP rank holds the stored bytes of its rows (q/k/v, gate/up) with their scales, and
    of its columns (o, down) with their whole rows' scales. Each rank quantises its slice of a
    row-parallel input per token (as vLLM does), so TP's logits carry an activation error of
    their own, about as large as one rank's, not more."""
    quantized, dense = fp8_folders(fmt)
    tokens = list(range(3, 30))
    logits, held = {}, {}
    for tp in (1, 2):
        with LLM(quantized, device="cpu", dtype="float32", tp=tp, block_size=4, timeout_s=60) as llm:
            logits[tp] = engine_logits(llm.engine, tokens, prefill=20)
            layer = llm.engine.executor.worker.model.model.layers[1]
            held[tp] = {
                name: (module.weight.view(torch.uint8).clone(), module.weight_scale.clone())
                for name, module in (("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj))
            }
    (gate_up, gate_up_scale), (down, down_scale) = held[1]["gate_up"], held[1]["down"]
    rank0_rows = torch.cat([torch.arange(44), 88 + torch.arange(44)])  # rank 0's gate, then up rows
    assert torch.equal(held[2]["gate_up"][0], gate_up[rank0_rows])
    assert torch.equal(held[2]["gate_up"][1], gate_up_scale[rank0_rows])
    assert torch.equal(held[2]["down"][0], down[:, :44])
    assert torch.equal(held[2]["down"][1], down_scale)
    with torch.no_grad():
        unquantized_inputs = hf_model(dense)(torch.tensor([tokens])).logits[0]
    one_rank_error = (logits[1] - unquantized_inputs).abs().max()
    assert 0 < (logits[2] - unquantized_inputs).abs().max() < 1.5 * one_rank_error


def test_merged_projection_with_a_part_left_unquantised_runs_dequantised(tmp_path, fp8_folders):
    """A checkpoint that keeps one part of a merged projection unquantised (an `ignore`
    entry): that layer's q/k/v is held in the model's dtype (its FP8 parts dequantised), the
    others as stored."""
    quantized, dense = fp8_folders("ct_channel")
    folder = tmp_path / "partial"
    shutil.copytree(quantized, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    plain = load_file(f"{dense}/model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = plain[name]
    del tensors[name + "_scale"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(
        ModelConfig.from_pretrained(str(folder)), str(folder), torch.device("cpu"), torch.float32
    )
    reference = load_model(ModelConfig.from_pretrained(dense), dense, torch.device("cpu"), torch.float32)
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight_scale is None
    assert torch.equal(
        layers[0].self_attn.qkv_proj.weight, reference.model.layers[0].self_attn.qkv_proj.weight
    )
    assert layers[0].self_attn.o_proj.weight.dtype == layers[1].self_attn.qkv_proj.weight.dtype == FP8_DTYPE


def test_block_dequantisation_of_a_slice_equals_the_slice_of_the_whole():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(88, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(6, 3, generator=g)  # blocks of [16, 24]: the last ones partial
    whole = dequantize_fp8(weight, scale, (16, 24))
    expected = weight.float() * scale.repeat_interleave(16, 0)[:88].repeat_interleave(24, 1)[:, :64]
    assert torch.equal(whole, expected)
    for index in [
        (slice(44, 88),),
        (slice(None), slice(20, 50)),
        ([slice(0, 10), slice(50, 60)], slice(3, 40)),
    ]:
        rows = index[0] if isinstance(index[0], slice) else index[0]
        part = torch.cat([weight[r] for r in rows]) if isinstance(rows, list) else weight[rows]
        if len(index) > 1:
            part = part[:, index[1]]
        expect = torch.cat([whole[r] for r in rows]) if isinstance(rows, list) else whole[rows]
        if len(index) > 1:
            expect = expect[:, index[1]]
        assert torch.equal(dequantize_fp8(part, scale, (16, 24), (88, 64), index), expect)


def _with_quantization(tmp_path, source: str, quantization: dict) -> str:
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _ct(weights, inputs=None, **top):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": group},
        **top,
    }


FP8_W = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    "awq": ({"quant_method": "awq"}, "quant_method='awq'"),
    "int8": (_ct({**FP8_W, "type": "int"}, format="int-quantized"), "format='int-quantized'"),
    "int8_weights": (_ct({**FP8_W, "type": "int"}), r"config_groups\.g\.weights\.type='int'"),
    "activations_only": (_ct(None, {**FP8_W, "strategy": "token", "dynamic": True}), r"weights=None"),
    "group": (_ct({**FP8_W, "strategy": "group", "group_size": 32}), r"weights\.strategy='group'"),
    "fp4_weights": (_ct({**FP8_W, "num_bits": 4}), r"weights\.num_bits=4"),
    "fp8_e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    "fp8_bad_block": ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_quantization_is_refused_by_its_field(case, tmp_path, tiny_model_dir):
    quantization, message = REFUSED[case]
    folder = _with_quantization(tmp_path, tiny_model_dir("llama"), quantization)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_pretrained(folder)


def test_fp8_weight_without_its_scale_is_refused(tmp_path, fp8_folders):
    quantized, _ = fp8_folders("fp8_block")
    folder = tmp_path / "noscale"
    shutil.copytree(quantized, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight .*without a weight_scale"):
        load_model(ModelConfig.from_pretrained(str(folder)), str(folder), torch.device("cpu"), torch.float32)


def _row_wise_moe_checkpoint(base: str, quantized, dense, fp8_folders) -> dict[str, torch.Tensor]:
    """base's projections (attention, the dense layer's MLP, every expert's gate, up and down)
    in compressed-tensors' FP8_DYNAMIC layout, written from its spec: e4m3 weight and float32
    weight_scale [out, 1] = row amax / 448; the router and lm_head left out, as published
    MoE checkpoints leave them. dense: the same checkpoint dequantised. Returns the packed
    tensors."""
    tensors = load_file(f"{base}/model.safetensors")
    packed, plain = {}, dict(tensors)
    for name, w in tensors.items():
        if _is_linear(name) and not name.endswith("mlp.gate.weight"):
            scale = w.abs().amax(1, keepdim=True) / FP8_MAX
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            packed[name], packed[name + "_scale"] = q, scale
            plain[name] = q.float() * scale
        else:
            packed[name] = w
    config = json.loads(open(f"{base}/config.json").read())
    ct_config = json.loads(open(f"{fp8_folders('ct_channel')[0]}/config.json").read())
    config["quantization_config"] = {
        **ct_config["quantization_config"],
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    for folder, weights, cfg in (
        (quantized, packed, config),
        (dense, plain, json.loads(open(f"{base}/config.json").read())),
    ):
        folder.mkdir()
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg))
    return packed


def test_moe_fp8_checkpoint_serves_its_experts_as_stored(tmp_path, tiny_model_dir, fp8_folders):
    """Every expert's gate, up and down held as the checkpoint's e4m3 bytes with their row
    scales (not dequantised), giving the logits transformers gives on the dequantised
    weights with each matmul's input quantised per token. Under expert parallelism each rank
    holds its experts as stored (and generates the one rank's tokens); under tensor
    parallelism its slices of every expert."""
    from unittest import mock

    from helpers import fake_quantized_moe_hf, prompts_of_lengths

    quantized, dense = tmp_path / "fp8", tmp_path / "dense"
    packed = _row_wise_moe_checkpoint(tiny_model_dir("qwen3_moe"), quantized, dense, fp8_folders)
    tokens = prompts_of_lengths([40], seed=4)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [tokens[:n] for n in (5, 11, 17, 23)]
    outputs = {}
    for layout in ({}, dict(ep=2), dict(tp=2)):  # ep=2: 2 replicas, 3 experts a rank; tp=2: I split
        with LLM(str(quantized), device="cpu", dtype="float32", block_size=4, timeout_s=60, **layout) as llm:
            if not layout:
                logits = engine_logits(llm.engine, tokens, prefill=19, chunks=[6])
            if "tp" not in layout:  # tp: each rank quantises its slice of o's and down's inputs
                outputs[str(layout)] = [
                    list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)
                ]
            experts = llm.engine.executor.worker.model.model.layers[1].mlp.experts  # rank 0's
            held_experts = 6 // layout.get("ep", 1)
            for name in ("gate_proj", "up_proj", "down_proj"):
                held, scales = getattr(experts, name), getattr(experts, name + "_scale")
                assert held.dtype == FP8_DTYPE and held.shape[0] == held_experts
                # tp=2: rank 0's first 24 rows of gate and up, or columns of down (whole rows' scales)
                rows = slice(None) if "tp" not in layout or name == "down_proj" else slice(0, 24)
                cols = slice(0, 24) if "tp" in layout and name == "down_proj" else slice(None)
                for e in range(held_experts):
                    stored = f"model.layers.1.mlp.experts.{e}.{name}.weight"
                    assert torch.equal(
                        held[e].view(torch.uint8), packed[stored][rows, cols].view(torch.uint8)
                    )
                    assert torch.equal(scales[e], packed[stored + "_scale"][rows, 0])
    assert outputs[str(dict(ep=2))] == outputs["{}"]  # the same arithmetic, tokens spread over ranks
    model, quantized_inputs = fake_quantized_moe_hf(str(dense))
    with torch.no_grad(), mock.patch("torch.nn.functional.linear", quantized_inputs):
        want = model(torch.tensor([tokens])).logits[0]
        assert outputs["{}"][0] == hf_greedy(model, prompts[0], 8)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
