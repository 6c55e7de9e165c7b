"""What generate() returns and the stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability and the likeliest alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first
    rank: int | None = None  # 1 + the number of tokens likelier than this one (vLLM's rank)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all generated text so far (stop strings excluded)
    token_ids: list[int]  # all generated token ids so far
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
