"""Online quantisation of a loaded model's weights (--quantization fp8, vLLM's flag on a bf16
checkpoint): each projection's weight becomes float8 e4m3 with a float32 scale per output
row (row-wise, as Meta serves), its matmuls then kernels/skinny_matmul.fp8_matmul's
arithmetic (activations quantised per token as they come).

Quantised: the attention and dense MLP projections (q/k/v, o, gate/up, down; a MoE model's
shared experts too) and MoE experts (per expert and output row; their grouped matmul is
fp8_grouped_mm). Kept in the model's dtype: embeddings, the LM head (as vLLM keeps it),
norms and routers.

Tensor parallelism splits a row-parallel projection (o_proj, down_proj, and the experts'
down_proj when their intermediate size is split) along its input: each rank holds part of
every row, so the row's scale is the max over the ranks' parts (an all-reduce at start-up)
and every rank quantises with the scale the whole row has on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringserve.kernels.skinny_matmul import quantize_rows
from ringserve.model.decoder import Experts, Linear, Transformer
from ringserve.model.fused_moe import FusedExperts

_ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split over TP ranks (tp_shard_plan.py)


@torch.no_grad()
def quantize_weights(model: Transformer, tp_group=None) -> int:
    """Quantise model's projections and experts in place (the module docstring says which);
    returns how many weights. tp_group: the tensor-parallel group whose ranks share
    row-parallel rows."""
    tp = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module is not model.lm_head and module.weight_scale is None:
            quantized, scale = _quantize_rows(module.weight, tp if name.endswith(_ROW_PARALLEL) else None)
            module.weight = nn.Parameter(quantized, requires_grad=False)
            module.weight_scale = scale
            count += 1
        elif isinstance(module, (Experts, FusedExperts)) and module.down_proj_scale is None:
            count += _quantize_experts(module, tp if _experts_split(model) else None)
    return count


def _experts_split(model: Transformer) -> bool:
    """Whether TP ranks hold slices of every expert's intermediate size (no expert parallelism)."""
    return model.shard.moe_intermediate_size < model.config.moe_intermediate_size


def _quantize_experts(experts: nn.Module, down_group) -> int:
    """Experts' weights [E, out, in] (Experts) or [E, in, out] (FusedExperts, x @ W: stored
    column-major after, so that each output column's K values are contiguous) -> e4m3 with a
    scale per expert and output row, `<name>_scale` [E, out]. down_group: the group whose
    ranks share the down projection's rows (its input split over them), or None."""
    fused = isinstance(experts, FusedExperts)
    names = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    for name in names:
        weight = getattr(experts, name)
        rows = weight.transpose(1, 2) if fused else weight  # [E, out, in]
        quantized, scale = _quantize_rows(rows, down_group if name == "down_proj" else None)
        setattr(
            experts,
            name,
            nn.Parameter(quantized.transpose(1, 2) if fused else quantized, requires_grad=False),
        )
        setattr(experts, name + "_scale", scale)
    return len(names)


def _quantize_rows(weight: torch.Tensor, row_group) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (e4m3 [..., out, in] contiguous, float32 scale [..., out]),
    each row quantised as activations are (quantize_rows); row_group: the ranks holding the
    other parts of each row, whose largest |value| the scale takes too (None: rows whole)."""
    amax = weight.abs().amax(-1).float()
    if row_group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=row_group)
    quantized, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]), amax.reshape(-1, 1))
    return quantized.reshape(weight.shape), scale.reshape(amax.shape)
