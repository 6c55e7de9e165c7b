"""Tensor parallelism: the sizes a model allows (its heads, KV heads, vocabulary and
experts split evenly, or KV heads replicated), checked before any process starts. Which
slice of each weight a rank loads is the model's (model/tp_shard_plan.py); the partial
sums of row-parallel layers meet in the allreduce (allreduce.py)."""

from __future__ import annotations

from ringserve.config import ModelConfig


def _tp_problems(config: ModelConfig, tp: int) -> list[str]:
    problems = []
    if config.num_attention_heads % tp:
        problems.append(f"num_attention_heads={config.num_attention_heads}")
    nkv = config.num_key_value_heads
    if nkv % tp and tp % nkv:
        problems.append(f"num_key_value_heads={nkv} (neither divides the other)")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.is_moe and config.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size}")
    if config.shared_expert_intermediate_size % tp:
        problems.append(f"shared expert intermediate_size={config.shared_expert_intermediate_size}")
    return problems


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every tp the model can be split over (each divides the attention heads)."""
    return [t for t in range(1, config.num_attention_heads + 1) if not _tp_problems(config, t)]


def validate_tp(config: ModelConfig, tp: int) -> None:
    """Raise before any weight is read if the model cannot be split tp ways."""
    problems = _tp_problems(config, tp)
    if problems:
        raise ValueError(
            f"tp={tp}: cannot split {config.architecture} over {tp} ranks: {', '.join(problems)} "
            f"not divisible by {tp}; tp can be {', '.join(map(str, valid_tp_sizes(config)))}"
        )
