"""A checkpoint's `quantization_config` (config.json): which pre-quantised formats load, and
the fields their dequantisation needs; anything else is refused by the field that says it.

Loaded (model/fp8.py: per-tensor and per-channel weights served in FP8 as stored, block
scales dequantised into the model's dtype as they load):

- compressed-tensors (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK schemes):
  `quant_method: "compressed-tensors"`, `format: "float-quantized"` (or "naive-quantized"),
  config groups whose weights are `{num_bits: 8, type: "float", symmetric: true}` with
  strategy "tensor", "channel" or "block" (`block_structure`); activations, static or
  dynamic, are taken and not quantised (an `input_scale` is not read).
- transformers' FineGrainedFP8Config: `quant_method: "fp8"`, `weight_block_size` [rows,
  cols] (or null: one scale per tensor), `*.weight_scale_inv` multiplied per block.
- mxfp4: gpt-oss's experts (checked by its family, config/moe_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.errors import ModelLoadError

FP8_METHODS = ("compressed-tensors", "fp8")
KNOWN_METHODS = (*FP8_METHODS, "mxfp4")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class WeightQuantization:
    """How a checkpoint's weights are quantised, as far as loading them needs to know."""

    method: str  # a KNOWN_METHODS entry
    # FP8 block scales: the [rows, cols] of weight each scale covers (None: no block scales).
    block: tuple[int, int] | None = None


def parse_quantization(raw, arch: str) -> WeightQuantization | None:
    """config.json's `quantization_config` (a dict, or None) -> what loading it needs; a
    method, format or scheme ringserve cannot load is a ModelLoadError naming its field."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{arch}: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in KNOWN_METHODS:
        raise ModelLoadError(
            f"{arch}: quantization_config.quant_method={method!r} is not supported "
            f"(ringserve loads {', '.join(repr(m) for m in KNOWN_METHODS)})"
        )
    if method == "mxfp4":
        return WeightQuantization("mxfp4")  # gpt-oss only: its family checks the rest
    if method == "fp8":
        return WeightQuantization("fp8", _transformers_fp8_block(raw, arch))
    return WeightQuantization("compressed-tensors", _compressed_tensors_block(raw, arch))


def _refuse(arch: str, field: str, value, why: str):
    raise ModelLoadError(f"{arch}: quantization_config.{field}={value!r} is not supported ({why})")


def _block(value, arch: str, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        _refuse(arch, field, value, "a block is two positive integers, [rows, cols]")
    return (value[0], value[1])


def _transformers_fp8_block(raw: dict, arch: str) -> tuple[int, int] | None:
    """transformers' FineGrainedFP8Config (quant_method "fp8"): e4m3 weights with
    `weight_scale_inv` per block (or per tensor when weight_block_size is null)."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        _refuse(arch, "fmt", fmt, "ringserve loads float8 e4m3 weights")
    activations = raw.get("activation_scheme", "dynamic")
    if str(activations).lower() not in ("dynamic", "static"):
        _refuse(arch, "activation_scheme", activations, "transformers knows dynamic and static")
    experts = raw.get("expert_dtype", "fp8")
    if experts != "fp8":
        _refuse(arch, "expert_dtype", experts, "ringserve loads fp8 experts only")
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt not in (None, "float", "ue8m0"):
        _refuse(arch, "scale_fmt", scale_fmt, "scales are float or ue8m0")
    return _block(raw.get("weight_block_size", (128, 128)), arch, "weight_block_size")


def _compressed_tensors_block(raw: dict, arch: str) -> tuple[int, int] | None:
    """compressed-tensors: every config group must hold FP8 (e4m3) weights, symmetric and
    static, per tensor, channel or block; the one block structure they use, if any."""
    fmt = raw.get("format")
    if fmt not in _CT_FORMATS:
        _refuse(arch, "format", fmt, f"ringserve loads {' and '.join(_CT_FORMATS)} FP8 weights")
    if raw.get("sparsity_config"):
        _refuse(arch, "sparsity_config", raw["sparsity_config"], "ringserve loads dense weights")
    if raw.get("transform_config"):
        _refuse(arch, "transform_config", raw["transform_config"], "ringserve applies no transforms")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        _refuse(arch, "config_groups", groups or None, "no quantisation scheme is given")
    blocks = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        group_format = group.get("format")
        if group_format is not None and group_format not in _CT_FORMATS:
            _refuse(arch, f"{where}.format", group_format, f"ringserve loads {' and '.join(_CT_FORMATS)}")
        weights = group.get("weights")
        if not weights:
            _refuse(
                arch,
                f"{where}.weights",
                weights,
                "a scheme that quantises activations only; ringserve loads quantised weights",
            )
        for key, wanted in (("type", "float"), ("num_bits", 8)):
            if weights.get(key) != wanted:
                _refuse(arch, f"{where}.weights.{key}", weights.get(key), f"ringserve loads {key} {wanted!r}")
        strategy = weights.get("strategy")
        if strategy not in _CT_WEIGHT_STRATEGIES:
            _refuse(
                arch,
                f"{where}.weights.strategy",
                strategy,
                f"ringserve loads FP8 weights per {', '.join(_CT_WEIGHT_STRATEGIES)}",
            )
        if weights.get("symmetric", True) is not True:
            _refuse(
                arch, f"{where}.weights.symmetric", weights.get("symmetric"), "FP8 weights have no zero point"
            )
        if weights.get("dynamic", False):
            _refuse(
                arch, f"{where}.weights.dynamic", weights.get("dynamic"), "a checkpoint's weights have scales"
            )
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), arch, f"{where}.weights.block_structure"))
        inputs = group.get("input_activations")
        if inputs and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
            # W8A8 int or FP4 activations: not FP8 checkpoints, and their weights say so too
            _refuse(arch, f"{where}.input_activations", inputs, "ringserve loads FP8 schemes only")
        if group.get("output_activations"):
            _refuse(
                arch, f"{where}.output_activations", group["output_activations"], "not an FP8 weight scheme"
            )
    if len(blocks) > 1:
        _refuse(arch, "config_groups", sorted(blocks), "one block structure per checkpoint")
    return blocks.pop() if blocks else None
