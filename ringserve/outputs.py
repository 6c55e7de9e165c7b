"""What generate() returns and the stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all generated text so far (stop strings excluded)
    token_ids: list[int]  # all generated token ids so far
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop token id or string, if one ended it
    new_text: str = ""  # text added since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    time_to_first_token: float | None = None  # seconds from arrival to the first token
