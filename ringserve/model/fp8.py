"""FP8 weights of pre-quantised checkpoints (compressed-tensors, transformers' "fp8"): served
in FP8 as stored where their scales are row-wise, dequantised into the model's dtype as they
load where they are not.

A quantised projection `X.weight` [out, in] is stored in float8 e4m3 beside its scale:
`X.weight_scale` (compressed-tensors) or `X.weight_scale_inv` (transformers; despite the
name it is multiplied too), one of

- per tensor: one value (shape [] or [1]);
- per channel: [out, 1] (or [out]), one per output row;
- per block: [ceil(out / rows), ceil(in / cols)] for blocks of [rows, cols] (the config's
  block structure), the last row and column of blocks possibly partial.

Per tensor and per channel, a projection (and a stack of MoE experts whose every gate, up
and down projection is stored so) keeps the checkpoint's e4m3 bytes and takes a float32
scale per output row (a tensor's one scale repeated: exact), the layout of
--quantization fp8 (model/quantize.py): half the memory of bf16 and its FP8 kernels, as vLLM
serves these checkpoints. Activations are then quantised per token as they come (dynamic),
also where the checkpoint has a static `input_scale`: finer, and the same arithmetic as
FP8_DYNAMIC's. On a GPU without FP8 (compute capability below 8.9) such weights are
dequantised instead, as block-scaled ones always are (a row-wise layout cannot hold them).

Dequantised, the weight is fp8 * scale, its scale broadcast over what it covers; computed in
float32 (exact: e4m3's 4 significant bits times a bfloat16 or float32 scale), then rounded
once into the model's dtype by the copy. Tensor parallelism reads a slice of the weight; the
scale of each row and column read is picked by its position in the whole tensor, so a
block cut by a shard boundary is dequantised as in the whole tensor, and a row-parallel
rank's rows keep their whole row's scale.
Activation scales (`input_scale`, transformers' `activation_scale`) are not read.
"""

from __future__ import annotations

import torch

from ringserve.errors import ModelLoadError

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# Scales of static activation quantisation: unused when the weights run dequantised.
DROPPED_SUFFIXES = (".input_scale", ".activation_scale")
FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
    if hasattr(torch, name)
)


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    full_shape: tuple[int, int] | None = None,
    index=None,
) -> torch.Tensor:
    """weight: [r, c] float8, rows and columns `index` of the whole [out, in] = full_shape
    (None: the whole tensor); scale: the whole tensor's (see the module docstring) ->
    float32 [r, c]."""
    full_shape = tuple(full_shape or weight.shape)
    if weight.dim() != 2 or len(full_shape) != 2:
        raise ValueError(f"FP8 weights are 2-D [out, in]; got shape {tuple(full_shape)}")
    out, cols_in = full_shape
    index = tuple(index or ())
    rows = _positions(out, index[0] if len(index) > 0 else slice(None))
    cols = _positions(cols_in, index[1] if len(index) > 1 else slice(None))
    values = weight.to(torch.float32)
    scale = _scale_values(scale)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if block is not None and tuple(scale.shape) == (-(-out // block[0]), -(-cols_in // block[1])):
        return values * scale[rows // block[0]][:, cols // block[1]]
    if scale.numel() == out and (scale.dim() == 1 or tuple(scale.shape) == (out, 1)):
        return values * scale.reshape(-1)[rows].unsqueeze(1)
    expected = f"[], [{out}, 1]" + (
        f" or [{-(-out // block[0])}, {-(-cols_in // block[1])}] (blocks of {list(block)})" if block else ""
    )
    raise ValueError(
        f"FP8 scale of shape {tuple(scale.shape)} for a weight {list(full_shape)}; expected {expected}"
    )


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32; UE8M0 ones (transformers' scale_fmt "ue8m0") stored as bytes are
    powers of two biased by 127."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def _positions(size: int, entry) -> torch.Tensor:
    """The positions in 0 .. size - 1 that one dimension's index entry (a slice, or a list
    of slices read and concatenated) selects."""
    every = torch.arange(size)
    if isinstance(entry, list):
        return torch.cat([every[piece] for piece in entry])
    return every[entry]


def row_scales(scale: torch.Tensor, full_shape: tuple[int, int], rows) -> torch.Tensor:
    """A weight's per-tensor or per-channel scale (the module docstring) -> float32 [r], the
    scale of each of its rows `rows` (an index entry into 0 .. out - 1)."""
    out = full_shape[0]
    scale = _scale_values(scale)
    positions = _positions(out, rows)
    if scale.numel() == 1:
        return scale.reshape(1).expand(len(positions)).contiguous()
    if scale.numel() == out and (scale.dim() == 1 or tuple(scale.shape) == (out, 1)):
        return scale.reshape(-1)[positions]
    raise ValueError(
        f"FP8 scale of shape {tuple(scale.shape)} is not row-wise for a weight {list(full_shape)}: "
        f"expected [] or [{out}, 1]"
    )


def scaled_modules(names) -> set[str]:
    """Checkpoint tensor names -> the modules whose weight has an FP8 scale beside it."""
    return {name[: -len(suffix)] for name in names for suffix in SCALE_SUFFIXES if name.endswith(suffix)}


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def scales_first(names):
    """A file's tensor names with the FP8 weight scales first (in their order), so that each
    weight finds its scale already read and is read itself as it comes."""
    return sorted(names, key=lambda name: not name.endswith(SCALE_SUFFIXES))


def pair_fp8(tensors, block: tuple[int, int] | None):
    """(name, origin, read) triples of a checkpoint, each file's scales first
    (`scales_first`) -> the same, with each `X.weight_scale(_inv)` read at once and merged
    into its `X.weight`, whose read(index) gives the dequantised float32 rows and columns
    asked (only those are read of the weight); activation scales are dropped. A float8
    weight whose scale did not come first stays float8, for the loader to refuse."""
    scales = {}  # weight name -> its scale, read
    for name, origin, read in tensors:
        if name.endswith(DROPPED_SUFFIXES):
            continue
        scale_suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            scales[name[: -len(scale_suffix)] + ".weight"] = read(lambda shape: None)  # small
        elif name in scales:
            yield name, origin, _dequantizing_read(name, read, scales.pop(name), block)
        else:
            yield name, origin, read
    if scales:
        raise ModelLoadError(f"FP8 scales without their weights: {', '.join(sorted(scales))}")


def _dequantizing_read(name: str, read_weight, scale: torch.Tensor, block):
    """read(index) -> the dequantised float32 slice; read.stored(index) -> the slice as
    stored (float8) and its rows' scales (float32 [r]), for a weight served in FP8."""

    def stored(index):
        asked = {}

        def weight_index(shape):
            asked["shape"], asked["index"] = shape, index(shape)
            return asked["index"]

        weight = read_weight(weight_index)
        if not is_fp8(weight):
            raise ValueError(f"{name} has a scale but is stored as {weight.dtype}, not float8")
        return weight, asked["shape"], tuple(asked["index"] or ())

    def read(index):
        weight, shape, where = stored(index)
        return dequantize_fp8(weight, scale, block, shape, where)

    def read_stored(index):
        weight, shape, where = stored(index)
        return weight, row_scales(scale, shape, where[0] if where else slice(None))

    read.stored = read_stored
    return read
