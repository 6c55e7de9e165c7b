"""How many characters a text can have and still fit in a number of tokens, known before
tokenizing it: a prompt longer than that is refused at once, so a huge prompt costs neither
the time nor the memory of its tokenization (a 10 MB text took 14.5 s and 3.4 GiB to refuse;
the tokenizer keeps hundreds of bytes per character while it works).

The bound is sound, never an estimate. Every token of the model's vocabulary stands for at
most L bytes of the normalized text: L is the longest token, counted in the bytes it covers
(one per symbol for a byte-level vocabulary, whose symbols each stand for one byte; its UTF-8
length otherwise, which for SentencePiece's "▁" (3 bytes for a 1-byte space) or a byte
fallback "<0x41>" is more than the bytes covered). A normalizer may make the text shorter,
by a factor F at most (Unicode composition and lower-casing: 3, as Hangul's three jamo of 3
bytes compose to one syllable of 3, and the Kelvin sign's 3 bytes lower to "k"). The
tokens cover the whole normalized text, so a text of B bytes needs at least B / (F * L)
tokens, and since a character is at least a byte, a text of more than N * F * L characters
needs more than N tokens.

That holds only where no part of the text can vanish or be swallowed whole: a normalizer
that strips accents or control characters, a pre-tokenizer that drops what it splits on
(BERT's whitespace), a model that fuses a run of unknown characters into one token, an added
token that takes the whitespace beside it (lstrip / rstrip), or a vocabulary other than
BPE's (WordPiece's [UNK] for a whole word). For such tokenizers no
bound is given (None) and prompts are tokenized whole, as before.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# The most a normalizer of each kind can shorten a text, in bytes (see the module's doc).
_SHRINK = {"NFC": 3, "NFKC": 3, "NFD": 3, "NFKD": 3, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that keep every byte of the text in some piece (a Split may drop what it
# matches: checked apart).
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _state(component) -> dict[str, Any] | None:
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _shrink(normalizer: dict[str, Any] | None) -> float | None:
    """The most `normalizer` can shorten a text by (a factor >= 1); None: no bound."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers", []):
            shrink = _shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        if "String" not in pattern or not content:  # a regex, or a deletion: no bound
            return None
        return max(1.0, len(pattern["String"].encode()) / len(content.encode()))
    return _SHRINK.get(kind)


def _keeps_every_byte(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING


def chars_per_token(tokenizer) -> float | None:
    """F * L of the module's doc: no token of `tokenizer` stands for more characters of a
    text than this; None when no such bound can be known for it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer
    if backend is None:
        return None
    model = backend.model
    if type(model).__name__ != "BPE" or (model.fuse_unk and model.unk_token):
        return None
    shrink = _shrink(_state(backend.normalizer))
    pre_tokenizer = _state(backend.pre_tokenizer)
    if shrink is None or not _keeps_every_byte(pre_tokenizer):
        return None
    added = set(backend.get_added_tokens_decoder().values())
    if any(token.lstrip or token.rstrip for token in added):  # it takes the spaces beside it, any number
        return None
    byte_level = "ByteLevel" in json.dumps(pre_tokenizer)  # its symbols are bytes, one each
    # an unknown character is one unknown token (not fused: checked above), whatever its name
    longest = 4 if model.unk_token else 0
    for token in backend.get_vocab(with_added_tokens=False):
        longest = max(longest, len(token) if byte_level else len(token.encode()))
    for token in added:  # matched in the raw text before normalization: their own bytes
        longest = max(longest, len(token.content.encode()))
    return shrink * longest if longest else None


def max_prompt_chars(tokenizer, max_tokens: int) -> int | None:
    """The most characters a text of at most `max_tokens` tokens can have; None: unknown."""
    per_token = chars_per_token(tokenizer)
    if per_token is None:
        logger.info("no bound on characters per token for this tokenizer: long texts are tokenized whole")
        return None
    return int(max_tokens * per_token)
