"""Each token's own bytes and text, for the logprobs of the OpenAI API.

`tokenizer.decode([id])` is the wrong tool for one token: a piece of a multi-byte character
(byte-level BPE, or a SentencePiece byte-fallback token like `<0xE2>`) decodes to U+FFFD, so
the bytes of an emoji cannot be rebuilt from the pieces, and SentencePiece decoders drop the
word-initial space of a sequence's first token, so every listed token loses its space and the
text offsets drift. The token's raw bytes come from its vocabulary entry instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the entry stands for one
  byte through GPT-2's bytes_to_unicode table;
- SentencePiece (Llama 2, Mistral, Gemma): '▁' is a space and `<0xNN>` (byte fallback) is
  that byte;
- added and special tokens: their text;
- any other tokenizer (WordPiece, ...): what decode gives for the token alone.
"""

from __future__ import annotations

import codecs
import json
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _decoder_kinds(tokenizer) -> set[str]:
    """The kinds of step the tokenizer's decoder takes ("ByteLevel", "ByteFallback",
    "Metaspace" for '▁' -> ' '), read from a fast tokenizer's decoder; empty for others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    kinds = set()

    def walk(step: dict) -> None:
        kind = step.get("type")
        if kind == "Replace" and step.get("pattern", {}).get("String") == _METASPACE:
            kind = "Metaspace"
        kinds.add(kind)
        for inner in step.get("decoders") or ():
            walk(inner)

    walk(json.loads(decoder.__getstate__()))
    return kinds


class TokenPieces:
    """Token id -> its raw bytes and its text, cached per id (a server lists the same few
    thousand tokens over and over)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer) if tokenizer is not None else set()
        # a slow SentencePiece tokenizer has no decoder object, but its pieces use '▁' and
        # byte fallback the same way
        sentencepiece = tokenizer is not None and hasattr(tokenizer, "sp_model")
        self.byte_level = "ByteLevel" in kinds
        self.metaspace = "Metaspace" in kinds or sentencepiece
        self.byte_fallback = "ByteFallback" in kinds or sentencepiece
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {i: t.content if hasattr(t, "content") else str(t) for i, t in added.items()}
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def text(self, token_id: int) -> str:
        """The token's text alone, as vLLM lists it: its bytes as UTF-8, a piece of a
        character as U+FFFD (what vLLM's decode of the lone token gives); unlike vLLM, a
        SentencePiece token keeps its word-initial space."""
        text = self._text.get(token_id)
        if text is None:
            if self.tokenizer is None:  # as vLLM's return_tokens_as_token_ids
                text = f"token_id:{token_id}"
            else:
                text = self.bytes(token_id).decode("utf-8", errors="replace")
            self._text[token_id] = text
        return text

    def _raw_bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}".encode()
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = tok.convert_ids_to_tokens(token_id)
        if piece is None:  # outside the vocabulary
            return b""
        if self.byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if self.metaspace or self.byte_fallback:
            match = _BYTE_TOKEN.fullmatch(piece) if self.byte_fallback else None
            if match:
                return bytes([int(match.group(1), 16)])
            return (piece.replace(_METASPACE, " ") if self.metaspace else piece).encode()
        return tok.decode([token_id]).encode()

    # Text offsets --------------------------------------------------------------------------

    def counter(self, start: int = 0, skip_special: bool = True) -> OffsetCounter:
        return OffsetCounter(self, start, skip_special)

    def align(self, text: str, token_ids: list[int]) -> list[int]:
        """Each token's character offset in `text`, a text the tokens were made from or
        decode to (an echoed prompt): a token starts where the text the ones before it
        spell ends. A token the text does not show (a BOS the prompt string lacks) takes
        the offset it would have and moves nothing; a word-initial space the text lacks
        (SentencePiece's dummy prefix before the first word) is skipped."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offsets, at = [], 0
        for token_id in token_ids:
            offsets.append(at)
            # the characters this token completes (none for the first piece of a character)
            spelled = decoder.decode(self.bytes(token_id))
            if text.startswith(spelled, at):
                at += len(spelled)
            elif spelled.startswith(" ") and text.startswith(spelled[1:], at):
                at += len(spelled) - 1
        return offsets


class OffsetCounter:
    """Character offsets of generated tokens in the text they decode to, one token at a
    time (a stream's tokens arrive a few at a time): a token's offset is the number of
    characters the tokens before it complete, so every piece of a multi-byte character
    has that character's offset. A special token the text skips takes no characters."""

    def __init__(self, pieces: TokenPieces, start: int, skip_special: bool):
        self.pieces, self.offset, self.skip_special = pieces, start, skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> int:
        at = self.offset
        if not (self.skip_special and token_id in self.pieces.special):
            self.offset += len(self._decoder.decode(self.pieces.bytes(token_id)))
        return at
