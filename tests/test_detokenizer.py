"""Incremental detokenization and stop strings against the tokenizer's own decode of the whole.

The tokenizer is SentencePiece-style (as Llama's and Mistral's): "▁" marks a word start,
the decoder strips the first space, and characters outside the vocabulary fall back to one
token per UTF-8 byte, so a multi-byte character spans several tokens. It is trained here,
offline, on a few sentences.
"""

from __future__ import annotations

import json

import pytest

from ringserve.engine.detokenizer import IncrementalDetokenizer
from ringserve.engine.sequence import Sequence
from ringserve.sampling_params import SamplingParams

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stop string may span several tokens of the stream",
    "café crème brûlée and naïve résumé",
    "streaming text must never show what it takes back",
] * 20

# é is in the corpus (a token of its own); the rest only reach the model as bytes.
TEXT = "the quick café fox 日本語 jumps 🙂 over naïve dogs ∑ streaming stop tokens of the lazy stream"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Merges learnt from the corpus, then a vocabulary with the 256 byte tokens added as
    # ordinary (not special) tokens, as Llama's has them.
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizer
    specials = ["<unk>", "<s>", "</s>"]
    learner.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=160, special_tokens=specials, show_progress=False)
    )
    learnt = json.loads(learner.to_str())["model"]
    vocab = dict(learnt["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], stop=()):
    """Feed the output tokens one at a time as the engine does: (the streamed deltas, the
    sequence at the end, how many tokens were fed before it stopped)."""
    seq = Sequence("r", prompt_ids, SamplingParams(stop=list(stop)))
    detok = IncrementalDetokenizer(tokenizer, seq)
    deltas = []
    for token in output_ids:
        seq.output_token_ids.append(token)
        detok.add_token(seq, token)
        deltas.append(detok.new_text(seq))
        if seq.finish_reason:
            break
    return deltas, seq, len(seq.output_token_ids)


def continuation(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The output's text as decoding prompt and output together shows it."""
    whole = tokenizer.decode(prompt_ids + output_ids)
    prompt = tokenizer.decode(prompt_ids)
    assert whole.startswith(prompt)
    return whole[len(prompt) :]


def test_multi_byte_characters_come_from_byte_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces and "<0xF0>" in pieces  # 日 (3 bytes) and 🙂 (4 bytes) byte by byte
    assert tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("split", [1, 3, 6, 9])
def test_incremental_text_equals_decoding_the_whole(tokenizer, split):
    """Prompt/output splits, some inside a word; the output starts and ends inside characters'
    bytes. (A prompt that ends inside a character has no text of its own to continue.)"""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for cut in range(split, len(ids) - 1, 4):
        prompt, output = ids[:cut], ids[cut:]
        if "\ufffd" in tokenizer.decode(prompt):
            continue
        deltas, seq, _ = stream(tokenizer, prompt, output)
        expected = continuation(tokenizer, prompt, output)
        assert seq.text == expected
        assert "".join(deltas) == expected
        assert all("\ufffd" not in d for d in deltas)  # half a character is never streamed


def stops_spanning_tokens(tokenizer, prompt: list[int], output: list[int], span: int):
    """Stop strings from the last character of output token i to the first of token
    i + span - 1 (so they span `span` tokens), each at its first occurrence: (i, stop)."""
    full = continuation(tokenizer, prompt, output)
    # Where each token's text ends in `full`; None while a character is incomplete.
    ends = []
    for k in range(1, len(output) + 1):
        text = continuation(tokenizer, prompt, output[:k])
        ends.append(len(text) if full.startswith(text) else None)
    cases = []
    for i in range(1, len(output) - span + 1):
        window = ends[i - 1 : i + span]  # the end before token i, then those of tokens i ..
        if None in window or any(b <= a for a, b in zip(window, window[1:])):
            continue  # some token of the span adds no complete character
        stop = full[window[1] - 1 : window[-2] + 1]
        if full.find(stop) == window[1] - 1:
            cases.append((i, stop))
    return cases


@pytest.mark.parametrize("span", [2, 3])
def test_stop_string_spanning_tokens_never_reaches_the_stream(tokenizer, span):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt, output = ids[:2], ids[2:]
    full = continuation(tokenizer, prompt, output)
    cases = stops_spanning_tokens(tokenizer, prompt, output, span)
    assert len(cases) >= 5
    for i, stop in cases:
        deltas, seq, fed = stream(tokenizer, prompt, output, stop=[stop])
        expected = full[: full.index(stop)]
        assert seq.finish_reason == "stop" and seq.stop_reason == stop
        assert fed == i + span  # it stopped at the token that completed the stop string
        assert seq.text == expected
        streamed = ""
        for d in deltas:
            streamed += d
            assert expected.startswith(streamed), (stop, streamed)  # nothing shown is taken back
        assert streamed == expected


@pytest.mark.parametrize("order", [1, -1])
def test_the_earliest_stop_string_wins_whatever_the_list_order(tokenizer, order):
    """Stop strings completed by the same token: the text ends at the one that starts
    first, not at the first one listed."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt, output = ids[:2], ids[2:]
    full = continuation(tokenizer, prompt, output)
    stops = ["lazy", "zy"]  # "zy" ends where "lazy" does: both complete at the same token
    assert full.index("zy") == full.index("lazy") + 2
    _, seq, _ = stream(tokenizer, prompt, output, stop=stops[::order])
    assert seq.stop_reason == "lazy" and seq.text == full[: full.index("lazy")]
