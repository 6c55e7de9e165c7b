"""Which ring runs a step under context parallelism: the one asked for, or under "auto" the
one the cost model (parallel/cp.py) expects to be faster for the step's new and cached tokens."""

from __future__ import annotations

import logging

import torch

from ringserve.config import ModelConfig
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.parallel.cp.policy import CPCalibration, choose_cp_algo, visible_cached_tokens

logger = logging.getLogger(__name__)


class CPPolicy:
    def __init__(
        self, cp_algo: str, cp: int, model_config: ModelConfig, dtype: torch.dtype, device_type: str
    ):
        self.cp_algo = cp_algo  # "auto", "pass_kv" or "pass_q"
        self.cp = cp
        self.model_config = model_config
        self.dtype = dtype
        self.calibration = CPCalibration.load(device_type)

    def choose(self, batch: ScheduledBatch) -> str:
        if self.cp_algo != "auto":
            return self.cp_algo
        c = self.model_config
        new = sum(batch.num_tokens)
        # the cached keys the new tokens can see (all of them without local attention)
        cached = visible_cached_tokens(c.attention_windows, [seq.num_computed_tokens for seq in batch.seqs])
        algo = choose_cp_algo(
            new,
            cached,
            self.cp,
            c.num_attention_heads,
            c.num_key_value_heads,
            torch.empty((), dtype=self.dtype).element_size(),
            self.calibration,
        )
        logger.debug("cp step: %d new, %d cached tokens over %d ranks -> %s", new, cached, self.cp, algo)
        return algo
