"""Log-probabilities in the shapes the endpoints answer with: the legacy completions object,
vLLM's prompt_logprobs, and chat's content list. Each token is named by its own text (and,
in chat, its bytes), read from TokenPieces."""

from __future__ import annotations

from collections.abc import Iterator

from ringserve.outputs import TokenLogprob
from ringserve.server import protocol as P
from ringserve.server.token_pieces import OffsetCounter, TokenPieces


def finite(logprob: float) -> float:
    """-inf (a token the model rules out) as -9999.0, OpenAI's value for it, as vLLM: JSON has no inf."""
    return max(logprob, -9999.0)


def add_completion_logprobs(
    lp: P.CompletionLogprobs,
    pieces: TokenPieces,
    token_ids: list[int],
    logprobs: list[TokenLogprob | None] | None,
    num_top: int,
    offsets: OffsetCounter | Iterator[int],
) -> None:
    """Append tokens to a legacy completions logprobs object. offsets: the tokens' text
    offsets (characters of the choice's text before each, echoed prompt included), or
    the counter that makes them from the tokens. Each token is its own text, its
    word-initial space kept. top_logprobs holds the num_top likeliest and the chosen
    token (num_top + 1 entries when it is not among them), as vLLM. A None entry (the
    first prompt token) has no logprob and no top_logprobs."""
    for token_id, entry in zip(token_ids, logprobs or [None] * len(token_ids)):
        lp.tokens.append(pieces.text(token_id))
        lp.token_logprobs.append(None if entry is None else finite(entry.logprob))
        top = None
        if entry is not None:
            top = {pieces.text(i): finite(v) for i, v in _with_chosen(entry, num_top)}
        lp.top_logprobs.append(top)
        lp.text_offset.append(offsets.add(token_id) if isinstance(offsets, OffsetCounter) else next(offsets))


def vllm_prompt_logprobs(
    pieces: TokenPieces, token_ids: list[int], logprobs: list[TokenLogprob | None], num_top: int
) -> list[dict[int, P.PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: entry}
    for the prompt token and the num_top likeliest."""
    result = []
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            result.append(None)
            continue
        ranked = {i: P.PromptLogprob(logprob=v, rank=r + 1) for r, (i, v) in enumerate(entry.top[:num_top])}
        ranked.setdefault(token_id, P.PromptLogprob(logprob=entry.logprob, rank=entry.rank))
        for i, e in ranked.items():
            e.decoded_token = pieces.text(i)
        result.append(ranked)
    return result


def chat_logprobs(
    pieces: TokenPieces, logprobs: list[TokenLogprob] | None, num_top: int | None
) -> P.ChatLogprobs | None:
    """Chat's logprobs of the given tokens; None when the request did not ask (num_top None)."""
    if num_top is None:
        return None

    def entry(token_id: int, value: float) -> dict:
        # bytes: the token's own, so a character split over tokens is rebuilt
        # from its pieces (its text alone is U+FFFD)
        return dict(token=pieces.text(token_id), logprob=finite(value), bytes=list(pieces.bytes(token_id)))

    content = []
    for t in logprobs or []:
        # top_logprobs 0 lists none (as vLLM and OpenAI); otherwise N entries, the
        # chosen token first (vLLM's chat)
        top = [P.TopLogprob(**entry(i, v)) for i, v in _chosen_first(t, num_top)] if num_top else []
        content.append(P.ChatTokenLogprob(**entry(t.token_id, t.logprob), top_logprobs=top))
    return P.ChatLogprobs(content=content)


def _with_chosen(entry: TokenLogprob, num_top: int) -> list[tuple[int, float]]:
    """The num_top likeliest (token id, logprob), then the chosen token when it is not among
    them, as vLLM lists a position's top logprobs (num_top + 1 entries then)."""
    top = entry.top[:num_top]
    if all(i != entry.token_id for i, _ in top):
        top = [*top, (entry.token_id, entry.logprob)]
    return top


def _chosen_first(entry: TokenLogprob, num_top: int) -> list[tuple[int, float]]:
    """num_top (token id, logprob): the chosen token, then the likeliest others, as vLLM's
    chat lists a position's top logprobs (N entries, where completions list N + 1)."""
    others = [(i, v) for i, v in entry.top if i != entry.token_id]
    return [(entry.token_id, entry.logprob), *others][:num_top]
