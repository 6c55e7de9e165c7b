"""MXFP4 expert weights (as the published gpt-oss checkpoints store them) load by dequantising:
against transformers' own dequantisation, on a tensor set and through a whole model."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringserve import LLM, SamplingParams
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.mxfp4 import FP4_VALUES, dequantize_mxfp4
from ringserve.model.tiny_models import hf_greedy, hf_model


def quantize_mxfp4(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] (C a multiple of 32) -> (blocks [..., C/32, 16] uint8, scales [..., C/32] uint8):
    each group of 32 scaled by a power of two so its largest value fits E2M1's 6, then each
    value rounded to the nearest E2M1 code (two per byte, the even element in the low nibble)."""
    groups = dense.float().reshape(*dense.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantisation_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)  # [E, R, G, 16]
    scales = torch.randint(110, 140, (3, 5, 4), dtype=torch.uint8, generator=g)
    # In chunks first: a result left in freed memory by an earlier call cannot fill its rows.
    chunked = dequantize_mxfp4(blocks, scales, rows_per_chunk=7).transpose(1, 2)  # 60 groups, 9 chunks
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, G * 32, R]
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == (3, 128, 5)
    assert torch.equal(ours, theirs) and torch.equal(chunked, theirs)
    # The nibble order and the scale bias: byte 0x79 holds codes 9 (-0.5) then 7 (6.0); scale
    # 128 is 2**1, scale 124 is 2**-3.
    blocks = torch.tensor([[0x79] + [0] * 15, [0x02] + [0] * 15], dtype=torch.uint8)
    two = dequantize_mxfp4(blocks, torch.tensor([128, 124], dtype=torch.uint8))
    assert two[:2].tolist() == [-1.0, 12.0] and two[32:34].tolist() == [0.125, 0.0]


@pytest.fixture(scope="module")
def mxfp4_folders(tiny_model_dir, tmp_path_factory):
    """The tiny gpt-oss with its experts in MXFP4 (config and tensors as published), and a
    plain folder of the same model whose experts hold transformers' dequantisation of them."""
    source = tiny_model_dir("gpt_oss")
    quantized, dense = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("dequantized")
    tensors = load_file(f"{source}/model.safetensors")
    packed, plain = {}, dict(tensors)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # on disk: [E, out, in]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).float()
        else:
            packed[name] = tensor
    config = json.loads(open(f"{source}/config.json").read())
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    (dense / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(dense)


def test_mxfp4_checkpoint_matches_transformers_on_its_dequantisation(mxfp4_folders):
    quantized, dense = mxfp4_folders
    tokens = list(range(3, 30))
    with torch.no_grad():
        ref = hf_model(dense)(torch.tensor([tokens])).logits[0]
    ours = engine_logits(LLMEngine(quantized, device="cpu", dtype="float32"), tokens, prefill=20)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, ep=2)])
def test_mxfp4_split_over_ranks(layout, mxfp4_folders):
    """tp: each rank dequantises its share of I (gate_up_proj's output rows on disk, and
    down_proj's packed input columns); ep: its whole experts."""
    quantized, dense = mxfp4_folders
    prompt = [5, 17, 42, 99, 3, 250, 7]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(quantized, device="cpu", dtype="float32", timeout_s=60, **layout) as llm:
        tokens = llm.generate([prompt], greedy)[0].token_ids
    assert tokens == hf_greedy(hf_model(dense), prompt, 12)


def test_quantization_other_than_mxfp4_is_refused(tmp_path, tiny_model_dir):
    import shutil

    from ringserve import ModelLoadError

    folder = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir("gpt_oss"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method='gptq'"):
        LLM(str(folder), device="cpu")
