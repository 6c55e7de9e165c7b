"""Tensor parallelism: which slice of each weight a rank holds.

Column-parallel (output rows split): q/k/v, gate/up (and each expert's), the vocabulary
of the embedding and LM head. Slices are given by on-disk name (q_proj, ...); the loader
writes a rank's q/k/v (gate/up) slices into their rows of its fused qkv_proj (gate_up_proj). Row-parallel (input columns split): o_proj and down_proj,
whose partial outputs the model sums with `ctx.all_reduce`. Norms and the MoE router are
replicated. When tp exceeds the KV heads, each KV head is replicated on the ranks whose
query heads use it.
"""

from __future__ import annotations

from ringserve.config import ModelConfig, TPShard
from ringserve.model.weights import ShardPlan


class TensorParallelPlan(ShardPlan):
    """This rank's slices under tensor parallelism, and its experts under expert parallelism."""

    def __init__(self, config: ModelConfig, shard: TPShard):
        self.shard = shard
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.whole_experts = shard.num_experts < config.num_experts  # spread by expert parallelism
        self.fused_experts = config.experts_layout != "per_expert"
        self.interleaved_gate_up = config.experts_layout == "fused_interleaved"

    def _rows(self, start: int, count: int, unit: int = 1) -> slice:
        return slice(start * unit, (start + count) * unit)

    def local_slice(self, param_name: str, full_shape: tuple[int, ...]):
        s, d = self.shard, self.head_dim
        if self.fused_experts and ".experts." in param_name:
            return self._fused_experts_slice(param_name, full_shape)
        if param_name.endswith("self_attn.sinks"):
            return (self._rows(s.rank * s.num_heads, s.num_heads),)
        if param_name.endswith(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")):
            return (self._even_share(full_shape[0]),)
        if param_name.endswith("shared_expert.down_proj.weight"):
            return (slice(None), self._even_share(full_shape[1]))
        if param_name.endswith(("q_proj.weight", "q_proj.bias")):
            return (self._rows(s.rank * s.num_heads, s.num_heads, d),)
        if param_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return (self._rows(s.kv_head_start, s.num_kv_heads, d),)
        if param_name.endswith("o_proj.weight"):
            return (slice(None), self._rows(s.rank * s.num_heads, s.num_heads, d))
        if param_name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return (self._rows(s.rank * s.intermediate_size, s.intermediate_size),)
        if param_name.endswith("mlp.down_proj.weight"):
            return (slice(None), self._rows(s.rank * s.intermediate_size, s.intermediate_size))
        # Stacked experts: the plan sees one expert's on-disk [I, H] or [H, I] tensor; under
        # expert parallelism experts are whole.
        if (
            param_name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))
            and self.whole_experts
        ):
            return None
        if param_name.endswith(("experts.gate_proj", "experts.up_proj")):
            return (self._rows(s.rank * s.moe_intermediate_size, s.moe_intermediate_size),)
        if param_name.endswith("experts.down_proj"):
            return (slice(None), self._rows(s.rank * s.moe_intermediate_size, s.moe_intermediate_size))
        if param_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return (slice(s.vocab_start, min(s.vocab_start + s.vocab_size, self.vocab_size)),)
        return None

    def _even_share(self, size: int) -> slice:
        per = size // self.shard.size
        return self._rows(self.shard.rank * per, per)

    def _fused_experts_slice(self, param_name: str, full_shape: tuple[int, ...]):
        """Fused experts (Llama 4, gpt-oss): gate_up_proj [E, H, 2I] (+ bias [E, 2I]),
        down_proj [E, I, H] (+ bias [E, H]). Under expert parallelism this rank's experts,
        whole; under tensor parallelism every expert's share of I (down_proj_bias whole: only
        TP rank 0 adds it). Interleaved gate/up columns (gpt-oss) keep a share contiguous;
        concatenated ones (Llama 4) take a piece of the gate half and one of the up half."""
        s = self.shard
        if self.whole_experts:
            return (slice(s.expert_start, s.expert_start + s.num_experts),)
        share = self._rows(s.rank * s.moe_intermediate_size, s.moe_intermediate_size)
        if param_name.endswith("down_proj"):
            return (slice(None), share)
        if param_name.endswith(("gate_up_proj", "gate_up_proj_bias")):
            if self.interleaved_gate_up:
                columns = slice(2 * share.start, 2 * share.stop)
            else:
                half = full_shape[-1] // 2
                columns = [share, slice(half + share.start, half + share.stop)]
            return (slice(None),) * (len(full_shape) - 1) + (columns,)
        return None

    def pads(self, param_name: str) -> bool:
        return param_name.endswith(("embed_tokens.weight", "lm_head.weight"))

    def local_expert(self, expert: int) -> int | None:
        local = expert - self.shard.expert_start
        return local if 0 <= local < self.shard.num_experts else None
