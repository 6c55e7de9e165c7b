"""Per-request sampling parameters (the vLLM names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.errors import RequestError

_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass
class SamplingParams:
    max_tokens: int = 16  # new tokens at most; 0: only the prefill (e.g. for prompt_logprobs)
    temperature: float = 1.0  # 0 (below 1e-5): greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k likeliest tokens; 0 or -1: all
    seed: int | None = None  # same seed, same prompt, same output
    stop: list[str] | str | None = None  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Per generated token: its log-probability and the N likeliest (token, log-probability)
    # pairs, from the model's raw distribution (before temperature, top-k, top-p), as vLLM.
    # None: none computed (no cost).
    logprobs: int | None = None
    # Per prompt token (the first has None): its log-probability given the tokens before it
    # and the N likeliest there, as vLLM. Such a request computes its whole prompt (no
    # prefix-cache hit: cached tokens have no logits). None: none computed.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise RequestError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (or -1 for all), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise RequestError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        n = self.prompt_logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise RequestError(f"prompt_logprobs must be an integer >= 0, got {n!r}")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy; dividing logits by it overflows float32
        # (1e-300 is 0 there), and the NaN rows would sample an arbitrary token.
        return self.temperature < _GREEDY_BELOW
