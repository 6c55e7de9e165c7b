"""What a request must be for this engine to serve it: checked before it is queued, so a bad
prompt or parameter fails alone with a RequestError that names it (the engine's add_request,
the LLM class for a whole batch at once, and the server, for its 400s)."""

from __future__ import annotations

from ringserve.errors import RequestError
from ringserve.sampling_params import SamplingParams
from ringserve.worker.kv_groups import KVGroups


def check_prompt(
    token_ids: list[int],
    *,
    max_model_len: int,
    vocab_size: int,
    num_blocks: int,
    block_size: int,
    kv_groups: KVGroups,
) -> None:
    """token_ids fit the KV cache (num_blocks of block_size tokens, shared by the KV
    groups) and the model's context with one new token, and are ints of the vocabulary."""
    if not token_ids:
        raise RequestError("the prompt is empty")
    blocks = kv_groups.min_blocks(len(token_ids), block_size)
    if blocks > num_blocks:
        raise RequestError(
            f"the prompt has {len(token_ids)} tokens, more than the whole KV cache holds "
            f"({num_blocks} blocks of {block_size})"
        )
    if len(token_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(token_ids)} tokens, but the model's context is "
            f"{max_model_len} (max_model_len) including at least one new token"
        )
    # type(t) is int: a float or bool id would pass the range test and fail inside a step.
    bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"token ids out of the vocabulary (0..{vocab_size - 1}) or not integers: {bad[:5]}"
        )


def check_params(params: SamplingParams, *, max_model_len: int, vocab_size: int) -> None:
    """Sampling parameters this model can serve; RequestError names the field."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.verify()  # again: a field may have changed since construction
    if params.max_tokens > max_model_len:
        raise RequestError(
            f"max_tokens={params.max_tokens} can never be reached: the model's context is "
            f"{max_model_len} tokens (max_model_len), prompt included"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise RequestError(f"logprobs={params.logprobs} is more than the vocabulary's {vocab_size} tokens")
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(
            f"stop_token_ids: token id {outside[0]} is outside the vocabulary (ids 0..{vocab_size - 1})"
        )
    outside = [t for t in params.logit_bias or () if t >= vocab_size]
    if outside:
        raise RequestError(
            f"logit_bias: token id {outside[0]} is outside the vocabulary (ids 0..{vocab_size - 1})"
        )


def check_text(text: str) -> None:
    """Text a tokenizer can encode: not a lone UTF-16 surrogate (JSON's "\\ud800" decodes to
    one), which would fail inside the tokenizer with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
        ) from None
