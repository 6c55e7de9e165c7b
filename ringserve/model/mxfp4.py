"""MXFP4 expert weights (the published gpt-oss checkpoints), dequantised when they load.

A quantised projection `X` is stored as two tensors: `X_blocks` [E, R, G, 16] uint8, two
4-bit E2M1 codes per byte (low nibble first) for 32 values per group along the input
dimension, and `X_scales` [E, R, G] uint8, each group's power-of-two exponent biased by 127.
Dequantised, that is [E, R, G * 32] (output rows R, like nn.Linear), which transposes to the
[E, in, out] layout the model keeps (gate_up_proj [E, H, 2I], down_proj [E, I, H]).
"""

from __future__ import annotations

import torch

# The 16 E2M1 values, by code: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16, rows_per_chunk: int = 1 << 20
) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] values in `dtype`.

    Every value is an E2M1 number times a power of two, so bfloat16 holds it exactly. Done
    rows_per_chunk groups at a time: the code indices of a whole layer's experts (gpt-oss-120b:
    2 x 1.06 G of them) would not fit in memory at once.
    """
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    flat_blocks = blocks.reshape(-1, blocks.shape[-1])  # [rows, 16]: one group of 32 values each
    flat_exponents = scales.reshape(-1, 1)
    out = torch.empty(flat_blocks.shape[0], 2 * flat_blocks.shape[1], dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        chunk = flat_blocks[start : start + rows_per_chunk]
        part = out[start : start + rows_per_chunk]
        part[:, 0::2] = table[(chunk & 0x0F).long()]  # the low nibble is the even value
        part[:, 1::2] = table[(chunk >> 4).long()]
        exponents = flat_exponents[start : start + rows_per_chunk].to(torch.int32) - 127
        torch.ldexp(part, exponents, out=part)
    return out.reshape(*scales.shape[:-1], -1)


def pair_quantized(tensors):
    """(name, origin, read) triples of a checkpoint -> the same, with each `X_blocks` and
    `X_scales` pair merged into one `X` whose read(index) gives the dequantised [E, in, out]
    tensor (the slices index that shape; the blocks are read only for the rows asked)."""
    waiting = {}
    for name, origin, read in tensors:
        for suffix, other in ((BLOCK_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCK_SUFFIX)):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                if base + other not in waiting:
                    waiting[name] = read
                    break
                partner = waiting.pop(base + other)
                blocks, scales = (read, partner) if suffix == BLOCK_SUFFIX else (partner, read)
                yield base, origin, _dequantizing_read(blocks, scales)
                break
        else:
            yield name, origin, read
    if waiting:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(waiting))}")


def _dequantizing_read(read_blocks, read_scales):
    def read(index):
        wanted = {}

        def blocks_index(shape):  # the dequantised, transposed shape from blocks [E, R, G, 16]
            experts, rows, groups, _ = shape
            wanted["index"] = index((experts, groups * 32, rows))
            return _on_disk(wanted["index"], 4)

        blocks = read_blocks(blocks_index)
        scales = read_scales(lambda shape: _on_disk(wanted["index"], 3))
        dense = dequantize_mxfp4(blocks, scales).transpose(1, 2)  # [e, in, out rows read]
        index_ = wanted["index"]
        if index_ is not None and len(index_) > 1:
            dense = dense[:, index_[1]]  # input columns: packed on disk, so sliced here
        return dense

    return read


def _on_disk(index, dims: int):
    """A slice of the dequantised [E, in, out] -> the one of blocks/scales [E, out, G(, 16)]:
    experts and output rows are sliced on disk, input columns after dequantising."""
    if index is None:
        return None
    experts = index[0]
    rows = index[2] if len(index) > 2 else slice(None)
    return (experts, rows) + (slice(None),) * (dims - 2)
