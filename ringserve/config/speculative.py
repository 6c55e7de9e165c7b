"""--speculative-config: how the engine guesses tokens for one forward pass to check (vLLM's
option, its JSON object and field names).

Methods, each with `num_speculative_tokens` drafts a step at most:
- "ngram" (prompt lookup: engine/ngram_proposer.py), from n-grams of `prompt_lookup_min` ..
  `prompt_lookup_max` tokens (as vLLM: either one alone sets both; neither: 5);
- "draft_model" (engine/draft_model.py): a smaller model with the same vocabulary, its folder
  in `model` (as vLLM, `model` without a method means this one), run on the engine's first
  GPU (`draft_tensor_parallel_size` 1, the only size);
- "eagle3" (engine/eagle.py): an EAGLE-3 head, its folder in `model`, on the first GPU too.
`disable_by_batch_size` (vLLM's): no drafts in a step while at least that many sequences run
(a verify step is no longer nearly free when the batch already fills the GPU). EAGLE-1,
Medusa, MTP and the others are not built: asking for them is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle3")
_NOT_YET = ("eagle", "medusa", "mlp_speculator", "mtp", "suffix")
_DEFAULT_NGRAM = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's folder (or GGUF file); eagle3: the head's

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
        model = fields.pop("model", None)
        if method is None and model is not None:  # as vLLM: a model alone is a draft model
            method = "draft_model"
        if method in _NOT_YET:
            raise ValueError(f"method {method!r} is not supported yet (ringserve speculates with {METHODS})")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        k = fields.pop("num_speculative_tokens", None)
        batch = fields.pop("disable_by_batch_size", None)
        low = high = None
        if method == "ngram":
            low = fields.pop("prompt_lookup_min", None)
            high = fields.pop("prompt_lookup_max", None)
            if model is not None:
                raise ValueError("model is a draft_model and eagle3 field: method 'ngram' needs no model")
        else:
            if not isinstance(model, str) or not model:
                example = _DRAFT_EXAMPLE if method == "draft_model" else _EAGLE_EXAMPLE
                raise ValueError(f"method {method!r} needs model, the draft's folder, e.g. {example}")
            draft_tp = fields.pop("draft_tensor_parallel_size", 1)
            if draft_tp != 1:
                raise ValueError(
                    f"draft_tensor_parallel_size must be 1 (the draft runs on the first GPU), got {draft_tp!r}"
                )
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
        if method != "ngram":
            return cls(method, k, 0, 0, batch, model)
        return cls(method, k, low, high, batch)


_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
_EAGLE_EXAMPLE = (
    '{"method": "eagle3", "model": "/models/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4}'
)
_DRAFT_EXAMPLE = '{"method": "draft_model", "model": "/models/SmolLM2-135M", "num_speculative_tokens": 4}'
