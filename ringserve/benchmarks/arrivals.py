"""When each request is sent: all at once, or a Poisson / gamma arrival process."""

from __future__ import annotations

import math

import numpy as np


def send_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each of n requests is sent.

    Gaps between arrivals are gamma distributed with shape `burstiness` and mean 1/request_rate
    (as `vllm bench serve`): burstiness 1 is a Poisson process (exponential gaps), below 1
    burstier, above 1 more even. The first request goes at once; an infinite rate sends all
    at once."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive or inf, got {request_rate}")
    if n == 0 or math.isinf(request_rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
