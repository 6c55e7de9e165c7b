"""Incremental detokenization and stop strings.

Decoding a few tokens of context before the new ones keeps word boundaries right for
byte-level and SentencePiece tokenizers; text that ends in an incomplete UTF-8 sequence
waits for the next token.
"""

from __future__ import annotations

from ringserve.engine.sequence import Sequence

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, seq: Sequence):
        self.tokenizer = tokenizer
        self.skip_special = seq.params.skip_special_tokens
        self.ids = list(seq.prompt_token_ids[-_CONTEXT_TOKENS:])
        # A context that starts inside a character (byte-fallback tokens of a SentencePiece
        # vocabulary, or byte-level BPE) decodes to U+FFFD, and with a byte-fallback decoder
        # it garbles every byte token joined to it, so the output's first characters would
        # never decode: start the context at a character instead.
        while self.ids and self._decode(self.ids).startswith("\ufffd"):
            del self.ids[0]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stops = seq.params.stop
        self.include_stop = seq.params.include_stop_str_in_output
        self.min_tokens = seq.params.min_tokens
        # Text that might be the start of a stop string is held back from streaming.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.emitted = 0  # characters of seq.text already streamed

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, seq: Sequence, token_id: int) -> None:
        """Extend seq.text by the new token; finish the sequence's text at a stop string."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(seq.text) - self.holdback)
        seq.text += new
        if len(seq.output_token_ids) < self.min_tokens:  # no stop string before min_tokens, as vLLM
            return
        hits = [(at, stop) for stop in self.stops if (at := seq.text.find(stop, start)) != -1]
        if hits:
            at, stop = min(hits)
            seq.text = seq.text[: at + len(stop) if self.include_stop else at]
            seq.finish_reason = "stop"
            seq.stop_reason = stop

    def new_text(self, seq: Sequence) -> str:
        """The text not streamed yet that can be streamed now."""
        end = len(seq.text) if seq.finish_reason else max(self.emitted, len(seq.text) - self.holdback)
        delta = seq.text[self.emitted : end]
        self.emitted = end
        return delta
