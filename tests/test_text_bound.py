"""The character bound that refuses a text too long to fit before it is tokenized
(ringserve/engine/text_bound.py): sound on the texts that pack the most characters into a
token, and not given where a tokenizer can swallow text."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ringserve.engine.loading import load_tokenizer
from ringserve.engine.text_bound import chars_per_token, max_prompt_chars


@pytest.fixture(scope="module")
def builtin_tokenizer(builtin_dir):
    return load_tokenizer(builtin_dir)


def _dense_texts(tokenizer) -> list[str]:
    """Texts made of the tokens that stand for the most characters each, and random ones."""
    vocab = tokenizer.backend_tokenizer.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:50]
    rng = random.Random(0)
    texts = [tokenizer.decode([vocab[t]] * 40) for t in longest[:10]]
    texts.append(tokenizer.decode([vocab[rng.choice(longest)] for _ in range(400)]))
    texts.append("".join(chr(rng.randrange(32, 0x3000)) for _ in range(3000)))
    texts.append("<|im_start|>" * 200)  # special tokens written in the text
    return texts


def test_no_text_has_more_characters_per_token_than_the_bound(builtin_tokenizer):
    per_token = chars_per_token(builtin_tokenizer)
    assert per_token is not None
    for text in _dense_texts(builtin_tokenizer):
        ids = builtin_tokenizer.encode(text, add_special_tokens=False)
        assert len(text) <= per_token * len(ids), (len(text), len(ids))


def test_a_text_over_the_bound_is_refused_before_it_is_tokenized(builtin_dir, monkeypatch):
    from ringserve import LLM
    from ringserve.errors import RequestError

    with LLM(builtin_dir, device="cpu", dtype="float32", max_model_len=64) as llm:
        engine = llm.engine
        limit = engine.input_processor.max_prompt_chars
        assert limit == max_prompt_chars(engine.tokenizer, 64)
        calls = []
        encode = engine.tokenizer.encode
        monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
        for text in ("x" * (limit + 1), " " * 10**7):
            with pytest.raises(RequestError, match="characters long"):
                engine.input_processor.tokenize(text)
            with pytest.raises(RequestError, match="characters long"):
                engine.input_processor.tokenize(text, chat=True)
        assert not calls  # never tokenized
        with pytest.raises(RequestError, match="context"):  # within the bound: tokenized, then refused
            llm.generate(["hello " * 100])


def _fast(model, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


VOCAB = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3, "Ġ": 4, "ĠĠĠ": 5}


def _bpe(**kw):
    return models.BPE(vocab=dict(VOCAB), merges=[("a", "b")], **kw)


def test_bound_per_tokenizer_kind():
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert (
        chars_per_token(_fast(_bpe(), pre_tokenizer=byte_level)) == 5
    )  # "[UNK]": "ĠĠĠ" stands for 3 bytes, one a symbol
    nfc = normalizers.NFC()
    assert chars_per_token(_fast(_bpe(), nfc, byte_level)) == 15  # composition shortens 3x at most
    spaces = normalizers.Replace(" ", "▁")  # SentencePiece's: lengthens
    assert (
        chars_per_token(_fast(_bpe(), spaces, pre_tokenizers.Metaspace())) == 6
    )  # "ĠĠĠ", in UTF-8 bytes (more than it stands for)
    # what can swallow text has no bound
    assert chars_per_token(_fast(_bpe(), normalizers.StripAccents(), byte_level)) is None
    assert chars_per_token(_fast(_bpe(), normalizers.Replace("x", ""), byte_level)) is None
    assert chars_per_token(_fast(_bpe(), None, pre_tokenizers.Whitespace())) is None
    assert chars_per_token(_fast(_bpe(unk_token="[UNK]", fuse_unk=True), None, byte_level)) is None
    stripping = _fast(_bpe(), None, byte_level)
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<m>", lstrip=True)]})
    assert chars_per_token(stripping) is None
    wordpiece = models.WordPiece(vocab=dict(VOCAB), unk_token="[UNK]")
    assert chars_per_token(_fast(wordpiece, None, pre_tokenizers.Whitespace())) is None
