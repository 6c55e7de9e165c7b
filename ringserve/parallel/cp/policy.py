"""Which ring a step takes (DESIGN.md 2.5): the cost of pass-KV against pass-Q for its new
and cached tokens, from the measured attention throughput and link bandwidth
(calibrate.py measures them). CPPolicy makes the choice for the engine: the ring asked
for, or under "auto" the one the cost model expects to be faster."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ringserve.config import AttentionWindow, ModelConfig
from ringserve.measurements import load_measurement

logger = logging.getLogger(__name__)


@dataclass
class CPCalibration:
    attention_flops: float = 600e12  # achieved attention FLOP/s on one rank (C)
    link_bytes_per_s: float = 50e9  # CP link bandwidth (BW)

    @classmethod
    def load(cls, device_type: str) -> CPCalibration:
        """Measured by `ringserve bench cp-calibrate`, else defaults for the device type."""
        measured = load_measurement("cp_calibration", device_type)
        if measured:
            return cls(**measured)
        if device_type == "cpu":
            return cls(attention_flops=20e9, link_bytes_per_s=2e9)
        return cls()


def visible_cached_tokens(windows: tuple[AttentionWindow, ...], cached: list[int]) -> float:
    """The cached keys a step's new tokens can see, averaged over the layers (the cost model
    counts only those): a full layer sees every sequence's cache, a windowed one at most
    its lookback of it. windows: per layer (() all full); cached: per sequence."""
    if not windows or all(w.is_full for w in windows):
        return float(sum(cached))
    per_layer = [sum(p if w.is_full else min(p, w.lookback()) for p in cached) for w in windows]
    return sum(per_layer) / len(per_layer)


def choose_cp_algo(
    new_tokens: int,
    cached_tokens: int,
    cp_size: int,
    num_heads: int,
    num_kv_heads: int,
    element_bytes: int,
    calibration: CPCalibration,
) -> str:
    """pass_kv or pass_q for a step with T new and P cached tokens (DESIGN.md 2.5).

    pass-KV if its transfer hides under the attention compute (T >= N*C*NKV*e / (2*NH*BW)),
    or if the new tokens are a large enough share of the context once pass-Q's all-to-all
    is counted (T/(T+P) >= 2*NKV/NH - 4*T*BW / (N*C*e)); pass-Q otherwise.
    """
    t, p, n = new_tokens, cached_tokens, cp_size
    c, bw, e = calibration.attention_flops, calibration.link_bytes_per_s, element_bytes
    if t >= n * c * num_kv_heads * e / (2 * num_heads * bw):
        return "pass_kv"
    if t / (t + p) >= 2 * num_kv_heads / num_heads - 4 * t * bw / (n * c * e):
        return "pass_kv"
    return "pass_q"


class CPPolicy:
    def __init__(
        self, cp_algo: str, cp: int, model_config: ModelConfig, dtype: torch.dtype, device_type: str
    ):
        self.cp_algo = cp_algo  # "auto", "pass_kv" or "pass_q"
        self.cp = cp
        self.model_config = model_config
        self.dtype = dtype
        self.calibration = CPCalibration.load(device_type)

    def choose(self, batch) -> str:
        """The ring of a step: batch, the engine's ScheduledBatch (its sequences and the new
        tokens of each; the engine's type, named but not imported beneath it)."""
        if self.cp_algo != "auto":
            return self.cp_algo
        c = self.model_config
        new_tokens = sum(batch.num_tokens)
        # the cached keys the new tokens can see (all of them without local attention)
        cached = visible_cached_tokens(c.attention_windows, [seq.num_computed_tokens for seq in batch.seqs])
        algo = choose_cp_algo(
            new_tokens,
            cached,
            self.cp,
            c.num_attention_heads,
            c.num_key_value_heads,
            torch.empty((), dtype=self.dtype).element_size(),
            self.calibration,
        )
        logger.debug(
            "cp step: %d new, %d cached tokens over %d ranks -> %s", new_tokens, cached, self.cp, algo
        )
        return algo
