"""The MoE blocks of Llama 4 and gpt-oss, whose checkpoints store each layer's experts fused.

Both keep Hugging Face's layout, so tensors load by name: gate_up_proj [E, H, 2I] and
down_proj [E, I, H] (x @ W, not x @ W.T). Llama 4 puts the gate columns before the up
columns; gpt-oss alternates them (gate 2j, up 2j + 1) and adds biases. The experts run
through the same `ctx.run_experts` as the per-expert MoE (on this rank, or dispatched
under expert parallelism): `FusedExperts.grouped_forward` is what that calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig, TPShard
from ringserve.kernels.elementwise import grouped_mm_usable, silu_mul
from ringserve.kernels.skinny_matmul import fp8_grouped_mm, fp8_grouped_mm_usable, fp8_matmul


class FusedExperts(nn.Module):
    """This rank's experts of one layer: gate_up_proj [E, H, 2I], down_proj [E, I, H] (+ biases).

    adds_down_bias: whether this rank adds down_proj_bias. Under tensor parallelism each
    rank holds a slice of every expert's I and the partial outputs are summed over the
    ranks, so only TP rank 0 adds the bias (exactly once); whole experts always add it.

    Under --quantization fp8 (model/quantize.py) both weights are e4m3, laid out
    column-major (each output column's K values contiguous, as FP8 matmuls read them; the
    shapes stay HF's), with a float32 scale per output column in gate_up_proj_scale [E, 2I]
    and down_proj_scale [E, H].
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        interleaved: bool,
        bias: bool,
        swiglu: tuple[float, float] | None,
        adds_down_bias: bool,
    ):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.interleaved = interleaved
        self.swiglu = swiglu
        self.adds_down_bias = adds_down_bias
        self.register_buffer("gate_up_proj_scale", None)
        self.register_buffer("down_proj_scale", None)

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def on_device(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether grouped_forward runs without a host sync (kernels.grouped_mm_usable)."""
        _, intermediate, hidden = self.down_proj.shape
        fp8 = self.down_proj_scale is not None
        return grouped_mm_usable(device, dtype, hidden, intermediate) and (
            not fp8 or fp8_grouped_mm_usable(device)
        )

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] -> [N, I]: silu(gate) * up (Llama 4), or gpt-oss's clamped SwiGLU
        (up + 1) * g * sigmoid(alpha * g), g = gate clamped above at limit, up to +-limit."""
        if self.swiglu is None and not self.interleaved:
            return silu_mul(gate_up)
        if self.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu is None:
            return F.silu(gate) * up
        alpha, limit = self.swiglu
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def grouped_forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [N, H]: rows sorted by local expert, expert e's ending at ends[e] ([E] int32) -> [N, H]."""
        if self.on_device(x.device, x.dtype):
            return self.grouped_mm_forward(x, ends)
        return self.loop_forward(x, ends)

    def grouped_mm_forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped matmuls (bf16, or FP8 with x's rows quantised per token),
        reading the group ends on the device."""
        h = self.grouped_mm(x, "gate_up_proj", ends)  # [N, 2I]
        expert_of_row = None
        if self.gate_up_proj_bias is not None:
            rows = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
            expert_of_row = torch.searchsorted(ends, rows, right=True)  # [N]
            h = h + self.gate_up_proj_bias[expert_of_row]
        out = self.grouped_mm(self.activation(h), "down_proj", ends)
        if expert_of_row is not None and self.adds_down_bias:
            out = out + self.down_proj_bias[expert_of_row]
        return out

    def loop_forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Expert by expert (any device and dtype; on a GPU the ends are read on the host)."""
        out = torch.empty_like(x)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                h = self.project(x[start:end], "gate_up_proj", e)
                if self.gate_up_proj_bias is not None:
                    h = h + self.gate_up_proj_bias[e]
                y = self.project(self.activation(h), "down_proj", e)
                if self.down_proj_bias is not None and self.adds_down_bias:
                    y = y + self.down_proj_bias[e]
                out[start:end] = y
            start = end
        return out

    def grouped_mm(self, x: torch.Tensor, name: str, ends: torch.Tensor) -> torch.Tensor:
        weight, scale = getattr(self, name), getattr(self, name + "_scale")
        return (
            torch._grouped_mm(x, weight, offs=ends)
            if scale is None
            else fp8_grouped_mm(x, weight, scale, ends)
        )

    def project(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        """x @ weight[expert] for the fused weight `name`, in FP8 where it is."""
        weight, scale = getattr(self, name)[expert], getattr(self, name + "_scale")
        return x @ weight if scale is None else fp8_matmul(x, weight.t(), scale[expert])


def fused_experts(config: ModelConfig, shard: TPShard) -> FusedExperts:
    whole = shard.moe_intermediate_size == config.moe_intermediate_size
    return FusedExperts(
        shard.num_experts,
        config.hidden_size,
        shard.moe_intermediate_size,
        interleaved=config.experts_layout == "fused_interleaved",
        bias=config.experts_bias,
        swiglu=config.swiglu,
        adds_down_bias=whole or shard.rank == 0,
    )


class Llama4MoeBlock(nn.Module):
    """Llama 4: the router's top-k logits through a sigmoid scale each chosen expert's *input*
    (not its output); a shared expert (dense, TP-split like any MLP, never dispatched) runs on
    every token and its output is added."""

    def __init__(self, config: ModelConfig, shard: TPShard, shared_expert: nn.Module):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = fused_experts(config, shard)
        self.shared_expert = shared_expert

    def forward(self, x, ctx):
        tokens, hidden = x.shape
        top, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k]
        scores = torch.sigmoid(top.float()).to(x.dtype)
        # One row per (token, choice), already scaled: each row goes to one expert with weight 1.
        rows = (x.unsqueeze(1) * scores.unsqueeze(-1)).reshape(tokens * self.top_k, hidden)
        ids = expert_ids.reshape(-1, 1)
        routed = ctx.run_experts(self.experts, rows, ids, torch.ones_like(ids, dtype=x.dtype))
        return self.shared_expert(x, ctx) + routed.view(tokens, self.top_k, hidden).sum(dim=1)


class GptOssMoeBlock(nn.Module):
    """gpt-oss: router with a bias, softmax over the top-k logits only, experts with biases."""

    def __init__(self, config: ModelConfig, shard: TPShard):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = fused_experts(config, shard)

    def forward(self, x, ctx):
        top, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)
        return ctx.run_experts(self.experts, x, expert_ids, weights)
