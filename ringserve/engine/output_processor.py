"""Sampled tokens to what callers receive: each request's incremental detokenizer (and the
stop strings it finds), the other reasons a request ends (stop tokens, EOS, a complete
grammar, its length), and the RequestOutput of each step, carrying only the step's new
tokens and text (a view of the tokens so far, copied only when the request ends).

The engine core calls it for every token it reads; the LLM class and the server consume
the outputs it builds.
"""

from __future__ import annotations

from ringserve.engine.detokenizer import IncrementalDetokenizer
from ringserve.engine.sequence import ContextLimit, Sequence
from ringserve.errors import RequestError
from ringserve.outputs import RequestOutput, TokensSoFar


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, context: ContextLimit):
        self.tokenizer = tokenizer  # None: token ids only, no text
        self.eos_token_ids = eos_token_ids
        self.context = context
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.detokenizers[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq)

    def remove(self, request_id: str) -> None:
        """The request's detokenizer goes: its output will not decode again."""
        self.detokenizers.pop(request_id, None)

    def take_token(self, seq: Sequence, token: int) -> None:
        """A token read for the sequence (already its last output token): its text, then
        whether it ends the request (seq.finish_reason / stop_reason set)."""
        detok = self.detokenizers.get(seq.request_id)
        if detok is not None:
            detok.add_token(seq, token)  # sets finish_reason on a stop string
        params = seq.params
        if seq.finish_reason is not None:
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif seq.grammar is not None and _grammar_done(seq):
            seq.finish_reason = "stop"
        elif self.at_length_limit(seq):
            seq.finish_reason = "length"

    def at_length_limit(self, seq: Sequence) -> bool:
        return (
            len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.context.max_model_len
        )

    def output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        detok = self.detokenizers.get(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            token_ids=(
                list(seq.output_token_ids)
                if seq.finished
                else TokensSoFar(seq.output_token_ids, len(seq.output_token_ids))
            ),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            new_text=detok.new_text(seq) if detok is not None else "",
            new_token_ids=new_tokens,
            num_cached_tokens=seq.num_prefix_cached_tokens,
            time_to_first_token=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            prompt_logprobs=seq.prompt_logprobs,
        )


def _grammar_done(seq: Sequence) -> bool:
    """Whether the output is complete in its grammar (nothing more may follow); a grammar
    that failed ends its request alone, with the reason."""
    seq.grammar.advance(seq.output_token_ids)
    if seq.grammar.error is not None:
        # e.g. a grammar that needs a byte no token of this vocabulary holds
        raise RequestError(
            "structured_outputs: the model's tokens cannot follow the grammar here: "
            + seq.grammar.error.split("\n")[0]
        )
    return seq.grammar.done
