"""What generate() returns and the stream yields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability and the likeliest alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first
    rank: int | None = None  # 1 + the number of tokens likelier than this one (vLLM's rank)


class TokensSoFar(Sequence):
    """The first `length` ids of a sequence's generated tokens, read-only, without a copy:
    copying the whole list into every step's output made the host's work per step grow with
    the output's length (35 ms a step at 64 sequences x 32K tokens). The list only grows and
    its first `length` entries never change afterwards, so the view stays what it was. It
    equals a list with the same ids; a finished request's output holds a plain list."""

    __slots__ = ("_ids", "_length")

    def __init__(self, ids: list[int], length: int):
        self._ids, self._length = ids, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[: self._length][index]
        if not -self._length <= index < self._length:
            raise IndexError("token index out of range")
        return self._ids[index % self._length]

    def __iter__(self):
        return iter(self._ids[: self._length]) if self._length < len(self._ids) else iter(self._ids)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, TokensSoFar)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._ids[: self._length])


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all generated text so far (stop strings excluded)
    # all generated token ids so far: a list once finished, a TokensSoFar view (no copy) before
    token_ids: list[int] | TokensSoFar
    finished: bool
    # "stop" or "length" once finished; "error" when this request failed inside a step
    # (the others went on), with the reason in `error`
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or string, if one ended it
    new_text: str = ""  # text added since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    time_to_first_token: float | None = None  # seconds from arrival to the first token
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when params.logprobs is set
    # One per prompt token when params.prompt_logprobs is set, as vLLM: None for the first
    # (nothing precedes it), then each token's log-probability given the tokens before it.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    # the failure was the request's own doing (e.g. a grammar the vocabulary cannot follow),
    # not the engine's: the server answers 400, not 500
    request_at_fault: bool = False
