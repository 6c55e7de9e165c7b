"""Online quantisation of a loaded model's weights (--quantization fp8, vLLM's flag on a bf16
checkpoint): each projection's weight becomes float8 e4m3 with a float32 scale per output
row (row-wise, as Meta serves), its matmuls then kernels/skinny_matmul.fp8_matmul's
arithmetic (activations quantised per token as they come).

Quantised: the attention and dense MLP projections (q/k/v, o, gate/up, down; a MoE model's
shared experts too). Kept in the model's dtype: embeddings, the LM head (as vLLM keeps it),
norms, routers, and MoE experts (their grouped matmul takes no FP8 weights yet).

Tensor parallelism splits a row-parallel projection (o_proj, down_proj) along its input:
each rank holds part of every row, so the row's scale is the max over the ranks' parts
(an all-reduce at start-up) and every rank quantises with the scale the whole row has on
one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringserve.kernels.skinny_matmul import quantize_rows
from ringserve.model.decoder import Linear, Transformer

_ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split over TP ranks (tp_shard_plan.py)


@torch.no_grad()
def quantize_linears(model: Transformer, tp_group=None) -> int:
    """Quantise model's projections in place (the module docstring says which); returns how
    many. tp_group: the tensor-parallel group whose ranks share row-parallel rows."""
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module is model.lm_head or module.weight_scale is not None:
            continue
        weight = module.weight
        amax = weight.abs().amax(1).float()
        if tp and name.endswith(_ROW_PARALLEL):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        quantized, scale = quantize_rows(weight, amax[:, None])  # as activations are, per row
        module.weight = nn.Parameter(quantized, requires_grad=False)
        module.weight_scale = scale[:, 0].contiguous()
        count += 1
    return count
