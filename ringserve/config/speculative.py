"""--speculative-config: how the engine guesses tokens for one forward pass to check (vLLM's
option, its JSON object and field names).

Methods: "ngram" (prompt lookup: engine/ngram_proposer.py), `num_speculative_tokens` drafts
a step at most, from n-grams of `prompt_lookup_min` .. `prompt_lookup_max` tokens (as vLLM:
either one alone sets both; neither: 5). `disable_by_batch_size` (vLLM's): no drafts in a
step while at least that many sequences run (a verify step is no longer nearly free when the
batch already fills the GPU). Draft models and EAGLE heads are not built yet: asking for them
is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
_NOT_YET = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
_DEFAULT_NGRAM = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A JSON object (a dict, or its text from the command line) -> the config; None for
        None or {}; a ValueError that names the field otherwise."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"must be a JSON object, e.g. {_EXAMPLE}: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, e.g. {_EXAMPLE}, got {value!r}")
        if not value:
            return None
        fields = dict(value)
        method = fields.pop("method", None)
        if method in _NOT_YET:
            raise ValueError(f"method {method!r} is not supported yet (ringserve speculates with {METHODS})")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        k = fields.pop("num_speculative_tokens", None)
        low = fields.pop("prompt_lookup_min", None)
        high = fields.pop("prompt_lookup_max", None)
        batch = fields.pop("disable_by_batch_size", None)
        if fields:
            raise ValueError(f"unknown field(s) {sorted(fields)} for method {method!r}")
        for name, number in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_min", low),
            ("prompt_lookup_max", high),
            ("disable_by_batch_size", batch),
        ):
            if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
                raise ValueError(f"{name} must be a positive integer, got {number!r}")
        if k is None:
            raise ValueError(f"num_speculative_tokens is required, e.g. {_EXAMPLE}")
        low, high = (low or high or _DEFAULT_NGRAM), (high or low or _DEFAULT_NGRAM)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        return cls(method, k, low, high, batch)


_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
