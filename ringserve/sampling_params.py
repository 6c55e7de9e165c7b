"""Per-request sampling parameters (the vLLM names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ringserve.errors import RequestError

# Temperatures below this sample greedily, as vLLM: logits / 1e-300 would overflow to inf,
# and softmax over several infs is NaN.
GREEDY_BELOW = 1e-5


@dataclass
class StructuredOutputsParams:
    """What the output must follow (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema, any JSON object, a regular expression, a choice of strings, or a grammar (Lark,
    or llama.cpp's GBNF). The engine enforces it token by token (engine/structured_output.py)."""

    json: dict | str | None = None  # a JSON schema, as a dict or its JSON text
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a context-free grammar, Lark or GBNF
    # JSON without free whitespace between tokens: "{\"a\":1}" only, not "{ \"a\" : 1 }"
    disable_any_whitespace: bool = False

    def __post_init__(self):
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        if len(kinds) != 1:
            raise RequestError(
                "structured_outputs must set exactly one of json, json_object, regex, choice and grammar"
                f", got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise RequestError(f"structured_outputs.json must be a JSON schema, got {_shorten(self.json)}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise RequestError(f"structured_outputs.{name} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise RequestError(
                f"structured_outputs.choice must be a non-empty list of strings, got {_shorten(self.choice)}"
            )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"structured_outputs.{name} must be True or False")


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
    # Adjustments of the logits before sampling, with vLLM's meanings, in vLLM's order: the
    # bias, min_tokens, the penalties; then temperature, min_p, top-k, top-p. Greedy rows
    # take the argmax of the adjusted logits; logprobs stay those of the raw distribution.
    presence_penalty: float = 0.0  # minus this for each token generated at least once
    frequency_penalty: float = 0.0  # minus this times the times a token was generated
    # > 1 discourages tokens of the prompt or the output: a positive logit is divided by it,
    # a negative one multiplied (CTRL's rule, as vLLM and transformers apply it)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest's probability
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    # words never generated (vLLM's bad_words): each word's tokens, alone and after a space;
    # a word's last token is banned where the output's last tokens are the rest of it
    bad_words: list[str] = field(default_factory=list)
    # The output follows a JSON schema, regex, choice or grammar; None: free text. Its mask
    # applies before everything above, and logprobs are those of the masked distribution, as vLLM.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        """Raise RequestError naming the first field that cannot work (a wrong type, NaN or
        inf, out of range). The engine calls it again when a request is added, so a field
        changed after construction is checked before it can reach a step."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise RequestError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (or -1 for all), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if "" in self.stop:  # it would end every request at once; vLLM refuses it too
            raise RequestError("stop cannot contain an empty string")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) for t in self.stop_token_ids
        ):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise RequestError(
                f"bad_words must be a list of non-empty strings, got {_shorten(self.bad_words)}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise RequestError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        n = self.prompt_logprobs
        if n is not None and (not _is_int(n) or n < 0):
            raise RequestError(f"prompt_logprobs must be an integer >= 0, got {n!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0 < r < math.inf:
            raise RequestError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise RequestError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_real(v) and math.isfinite(v) for k, v in bias.items()
            ):
                raise RequestError(
                    f"logit_bias must map token ids (integers >= 0) to finite numbers, got {_shorten(bias)}"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling needs the logits adjusted (bias, min_tokens, penalties, bad words)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalized or bool(self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether the tokens seen so far change the logits (the three penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float, not a bool (True would pass as 1). NaN fails every range test after."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shorten(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
