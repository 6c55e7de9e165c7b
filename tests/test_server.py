"""`ringserve serve`: the OpenAI-compatible server, on the built-in model on the CPU.

One live uvicorn server (in a thread of this process, so the tests can look at its engine)
serves the module; a subprocess checks SIGTERM. The engine loop's failure paths run on a
fake engine, and the engine's own additions (per-token logprobs, a request larger than the
KV cache) on a tiny random model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx2 as httpx
import openai
import pytest
import torch

from ringserve import SamplingParams
from ringserve.config import EngineConfig
from ringserve.engine.engine import LLMEngine
from ringserve.errors import RequestError, RequestTooLargeError
from ringserve.parallel.local_world import free_port
from ringserve.server import build_app
from ringserve.server.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError

from conftest import KEY, MAX_MODEL_LEN, MAX_WAITING, NAME, scrape_metrics
from helpers import prompts_of_lengths, serve_in_thread


def _wait_idle(live, timeout=10.0):
    """The engine has nothing in flight and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            not live.engine.has_unfinished()
            and live.engine.block_manager.num_free_blocks == live.idle_free_blocks
            and not live.app.state.server.async_engine.routes
        ):
            return True
        time.sleep(0.02)
    return False


def _alone(live, prompt, max_tokens=12):
    out = live.client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


# The official client ------------------------------------------------------------------------


def test_completion_and_usage(live):
    out = live.client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert out.object == "text_completion" and out.model == NAME
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    prompt_len = len(live.engine.input_processor.tokenize("The capital of France is"))
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == prompt_len + 8


def test_completion_prompt_forms_and_n(live):
    ids = live.engine.input_processor.tokenize("The capital of France is")
    text = _alone(live, "The capital of France is", 6)
    for prompt in ("The capital of France is", ids):
        assert _alone(live, prompt, 6) == text
    out = live.client.completions.create(
        model=NAME,
        prompt=[ids, live.engine.input_processor.tokenize("One, two,")],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == text
    assert out.choices[2].text == out.choices[3].text == _alone(live, "One, two,", 6)
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == len(ids) + len(live.engine.input_processor.tokenize("One, two,"))
    # n=2 sampled with a seed: reproducible, and the two choices draw differently
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=7)
    a, b = live.client.completions.create(**kw), live.client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_completion_stream_with_usage(live):
    prompt = "The capital of France is"
    chunks = list(
        live.client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _alone(live, prompt, 8)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(live.engine.input_processor.tokenize(prompt))


def test_raw_sse_format(live):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with live.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events) == 3 + 2


def test_chat(live):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    text = live.engine.input_processor.chat_prompt(messages)[0]
    prompt_len = len(live.engine.tokenizer.encode(text, add_special_tokens=False))
    assert out.usage.prompt_tokens == prompt_len

    stream = live.client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.role is None and chunks[1].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_logprobs(live):
    out = live.client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value)  # greedy: the likeliest token
        assert top[tok] == pytest.approx(value)
    # the first token's logprob is log_softmax of the prompt's last logits
    ids = live.engine.input_processor.tokenize("The capital of France is")
    ref = _reference_logprobs(live.engine, ids)[-1]
    first = ref.topk(3)
    assert lp.token_logprobs[0] == pytest.approx(first.values[0].item(), abs=1e-4)

    chat = live.client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content
    )
    assert bytes(content[0].bytes).decode() == content[0].token
    plain = live.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=2, temperature=0
    )
    assert plain.choices[0].logprobs is None


def _reference_logprobs(engine, ids):
    """transformers' log_softmax [len(ids), V] of the next token at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, -1)


def test_echo(live):
    prompt = "The capital of France is"
    out = live.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == prompt + _alone(live, prompt, 4)
    zero = live.client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True)
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs is None


def _offsets(tokens):
    return [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def _token_text(live, token_id):
    return live.engine.tokenizer.decode([token_id])


def test_echo_with_logprobs_scores_the_prompt(live):
    """What eval harnesses send (lm-evaluation-harness local-completions): echo, logprobs=1,
    max_tokens 0 (or 1); the prompt's logprobs equal transformers' log_softmax."""
    prompt = "The capital of France is a city that"
    ids = live.engine.input_processor.tokenize(prompt)
    ref = _reference_logprobs(live.engine, ids)[:-1]  # [len - 1, V]: position i scores ids[i + 1]
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    best_values, best_ids = ref.max(-1)
    texts = [_token_text(live, i) for i in ids]
    for form in (prompt, ids):
        out = live.client.completions.create(model=NAME, prompt=form, echo=True, max_tokens=0, logprobs=1)
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        assert lp.tokens == texts and lp.text_offset == _offsets(texts)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        # the likeliest token, then the prompt's own when it is not the likeliest (as vLLM)
        assert [list(top) for top in lp.top_logprobs[1:]] == [
            [_token_text(live, b)] + ([_token_text(live, t)] if t != b else [])
            for b, t in zip(best_ids.tolist(), ids[1:])
        ]
        assert [list(top.values())[0] for top in lp.top_logprobs[1:]] == pytest.approx(
            best_values.tolist(), abs=1e-4
        )
        assert [top[tok] for tok, top in zip(texts[1:], lp.top_logprobs[1:])] == pytest.approx(want, abs=1e-4)
    # With generated tokens (lm-eval sends max_tokens=1): the prompt's entries, then the
    # generated ones as a plain logprobs request gives them; streamed chunks add up to it.
    kw = dict(model=NAME, prompt=prompt, max_tokens=2, temperature=0, logprobs=1)
    plain = live.client.completions.create(**kw).choices[0]
    both = live.client.completions.create(echo=True, **kw).choices[0]
    assert both.text == prompt + plain.text
    assert both.logprobs.tokens == texts + plain.logprobs.tokens
    assert both.logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:] + plain.logprobs.token_logprobs, abs=1e-5
    )
    assert both.logprobs.text_offset == _offsets(both.logprobs.tokens)
    chunks = [c.choices[0] for c in live.client.completions.create(echo=True, stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == both.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.logprobs, name) for c in chunks), []) == getattr(both.logprobs, name)


def test_vllm_prompt_logprobs_field(live):
    prompt = "One, two, three, four"
    ids = live.engine.input_processor.tokenize(prompt)
    ref = _reference_logprobs(live.engine, ids)[:-1]
    out = live.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert out.choices[0].logprobs is None and len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        token = entry[str(ids[i + 1])]
        assert token["logprob"] == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-4)
        assert token["rank"] == int((ref[i] > ref[i, ids[i + 1]]).sum()) + 1
        assert token["decoded_token"] == _token_text(live, ids[i + 1])
        values, top = ref[i].topk(2)
        for rank, (t, v) in enumerate(zip(top.tolist(), values.tolist()), start=1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
        assert len(entry) == len({*top.tolist(), ids[i + 1]})


def test_chat_logprobs_bytes_rebuild_emoji_and_cjk(live):
    """Each content entry carries its token's own bytes: a character split over tokens (an
    emoji, CJK in byte-level BPE) is rebuilt from them, streamed or not."""
    pieces_split = 0
    for question in ("Reply with three emoji.", "Write the word 'hello' in Chinese characters."):
        kw = dict(
            model=NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=24,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        out = live.client.chat.completions.create(**kw)
        text, content = out.choices[0].message.content, out.choices[0].logprobs.content
        assert any(ord(c) > 0x2E80 for c in text), text  # the answer holds CJK or emoji
        stopped = out.choices[0].finish_reason == "stop"
        if stopped:  # the end-of-turn token is listed (as vLLM lists it) but is not in the text
            assert content[-1].token == "<|im_end|>"
            content = content[:-1]
        assert bytes(b for c in content for b in c.bytes).decode() == text
        for c in content:
            try:
                assert bytes(c.bytes).decode() == c.token
            except UnicodeDecodeError:  # a piece of a character: its text alone is U+FFFD
                pieces_split += 1
                assert c.token.strip(" ") and set(c.token.strip(" ")) == {"\ufffd"}
            # the likeliest token at each greedy step is the chosen one, with its bytes
            assert c.top_logprobs[0].bytes == c.bytes and c.top_logprobs[0].token == c.token
            assert len(c.top_logprobs) == 2
        streamed = live.client.chat.completions.create(stream=True, **kw)
        chunks = [
            c
            for chunk in streamed
            if chunk.choices and chunk.choices[0].logprobs
            for c in chunk.choices[0].logprobs.content
        ]
        assert bytes(b for c in chunks[: len(content)] for b in c.bytes).decode() == text
    assert pieces_split  # the check above met split characters


def test_chosen_token_outside_top_n_is_listed(live):
    """A forced token (logit_bias) far down the model's ranking is still in top_logprobs, with
    its raw log-probability, as vLLM lists it: completions after the N likeliest (N + 1
    entries), chat first of N."""
    prompt = "The capital of France is"
    ids = live.engine.input_processor.tokenize(prompt)
    ref = _reference_logprobs(live.engine, ids)[-1]
    forced = int(ref.argsort()[len(ref) // 2])  # a token of middling likelihood
    pieces = live.app.state.server.pieces
    kw = dict(model=NAME, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(forced): 100})
    for n in (0, 2):
        lp = live.client.completions.create(logprobs=n, **kw).choices[0].logprobs
        assert lp.tokens == [pieces.text(forced)]
        assert lp.token_logprobs[0] == pytest.approx(ref[forced].item(), abs=1e-4)  # raw, not biased
        top = lp.top_logprobs[0]
        want = [live.engine.tokenizer.decode([i]) for i in ref.topk(n).indices.tolist()] + [
            pieces.text(forced)
        ]
        assert list(top) == want and top[pieces.text(forced)] == pytest.approx(ref[forced].item(), abs=1e-4)
    chat = live.client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        temperature=0,
        logit_bias={str(forced): 100},
        logprobs=True,
        top_logprobs=2,
    )
    entry = chat.choices[0].logprobs.content[0]
    assert entry.token == pieces.text(forced) and entry.bytes == list(pieces.bytes(forced))
    # chat lists N, the chosen token first, then the likeliest after the chat template
    chat_ids = live.engine.input_processor.chat_prompt([{"role": "user", "content": prompt}])[1]
    chat_ref = _reference_logprobs(live.engine, chat_ids)[-1]
    top1 = next(i for i in chat_ref.argsort(descending=True).tolist() if i != forced)
    assert [t.token for t in entry.top_logprobs] == [pieces.text(forced), pieces.text(top1)]
    assert entry.top_logprobs[1].logprob == pytest.approx(chat_ref[top1].item(), abs=1e-4)
    assert entry.top_logprobs[0].logprob == entry.logprob < entry.top_logprobs[1].logprob
    no_top = live.client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        logit_bias={str(forced): 100},
        logprobs=True,
        top_logprobs=0,
    )
    assert no_top.choices[0].logprobs.content[0].top_logprobs == []  # 0 lists none, as vLLM


def _sentencepiece_model(folder: str) -> str:
    """A tiny random Llama whose tokenizer is SentencePiece-style (as Llama 2 and Mistral):
    Metaspace pre-tokenizer, byte-fallback Unigram, the '▁' -> ' ' decoder that strips the
    sequence's first space, and a BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from ringserve.model.tiny_models import make_hf_config, save_random_model

    words = [
        "\u2581Hello",
        "\u2581world",
        "\u2581the",
        "\u2581cat",
        "\u2581sat",
        "\u2581on",
        "\u2581",
        "Hello",
    ]
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(w, -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyzH"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    config = make_hf_config("llama")
    config.vocab_size = 320
    save_random_model(config, folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def test_sentencepiece_tokens_keep_their_spaces_and_offsets(tmp_path):
    """Legacy completions logprobs on a SentencePiece tokenizer: each token keeps its
    word-initial space (decode([id]) drops it), and text_offset places every token in the
    returned text, the echoed prompt's BOS and dummy-prefix space included."""
    from starlette.testclient import TestClient

    folder = _sentencepiece_model(str(tmp_path / "sp"))
    engine = LLMEngine(folder, device="cpu", dtype="float32", engine_config=EngineConfig(num_blocks=32))
    vocab = engine.tokenizer.get_vocab()
    # generated tokens forced among whole words, so the text is known to be words and spaces
    bias = {str(vocab[w]): 100 for w in ("\u2581the", "\u2581cat", "\u2581sat", "\u2581on")}
    prompt = "Hello world \u4f60"  # 你: three byte-fallback tokens
    with TestClient(build_app(engine, "sp")) as client:
        body = dict(prompt=prompt, max_tokens=5, temperature=0, logprobs=1, logit_bias=bias, echo=True)
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
        assert text.startswith(prompt)
        assert lp["tokens"][:7] == ["<s>", " Hello", " world", " ", "\ufffd", "\ufffd", "\ufffd"]
        # BOS is not in the text; the dummy prefix before "Hello" neither; 你's pieces share its offset
        assert lp["text_offset"][:7] == [0, 0, 5, 11, 12, 12, 12]
        generated, offsets = lp["tokens"][7:], lp["text_offset"][7:]
        assert len(generated) == 5 and all(t.startswith(" ") and t.strip() for t in generated)
        assert "".join(generated) == text[len(prompt) :]
        assert offsets == [len(prompt) + sum(map(len, generated[:i])) for i in range(5)]
        for token, at in zip(generated, offsets):
            assert text[at : at + len(token)] == token
        # streamed, the chunks' offsets are the same
        chunks = [
            json.loads(line[6:])
            for line in client.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
            if line.startswith("data: {")
        ]
        streamed = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert streamed == lp["text_offset"]
        # without echo the offsets count from the generated text's start
        plain = client.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
        assert plain["logprobs"]["tokens"] == generated
        assert plain["logprobs"]["text_offset"] == [o - len(prompt) for o in offsets]


def test_stream_without_include_usage_has_no_usage_chunk(live):
    """stream_options absent, or include_usage false: no usage chunk at the end."""
    messages = [{"role": "user", "content": "Say hi"}]
    for extra in ({}, {"stream_options": {"include_usage": False}}):
        kw = dict(model=NAME, max_tokens=3, temperature=0, stream=True, **extra)
        chunks = list(live.client.completions.create(prompt="Hi", **kw))
        assert chunks and all(c.choices and c.usage is None for c in chunks), extra
        chunks = list(live.client.chat.completions.create(messages=messages, **kw))
        assert chunks and all(c.choices and c.usage is None for c in chunks), extra


def test_top_logprobs_are_cut_to_the_number_asked(live):
    """echo scores the prompt with the larger of logprobs and prompt_logprobs (one pass):
    the legacy logprobs list `logprobs` alternatives per token, vLLM's field its own number."""
    out = live.client.completions.create(
        model=NAME,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 4},
    )
    choice = out.choices[0]
    tops = choice.logprobs.top_logprobs
    assert len(tops) == out.usage.prompt_tokens + 3 and tops[0] is None
    # the likeliest one, and the token itself after it when it is not the likeliest (vLLM's N + 1)
    tokens = choice.logprobs.tokens
    assert all(len(top) == 1 or (len(top) == 2 and t in top) for t, top in zip(tokens[1:], tops[1:]))
    assert any(len(top) == 2 for top in tops[1:])  # a cut to 2 would pass the line above alone
    entries = choice.model_extra["prompt_logprobs"]
    assert all(len(entry) in (4, 5) for entry in entries[1:])  # the top 4 and the prompt token


def test_text_offsets_count_characters_not_bytes(live):
    prompt = "Crème brûlée à Zürich coûte 5 €, naïvement: 東京"
    out = live.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0
    )
    lp = out.choices[0].logprobs
    assert any(len(t) != len(t.encode()) for t in lp.tokens)  # the test can tell bytes apart
    text = out.choices[0].text
    # each token is found at its offset in the text, in characters; the pieces of a character
    # split over tokens (東京 here, shown as U+FFFD) share that character's offset
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert "\ufffd" in token or text[offset:].startswith(token), (token, offset)
    assert lp.text_offset == sorted(lp.text_offset) and "\ufffd" in "".join(lp.tokens)
    chunks = [c.choices[0] for c in live.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0, stream=True
    ) if c.choices]  # fmt: skip
    assert sum((c.logprobs.text_offset for c in chunks), []) == lp.text_offset


def test_default_max_tokens(live):
    """Completions default to 16 tokens (OpenAI's default); chat to the context left."""
    out = live.client.completions.create(
        model=NAME, prompt="Hi", temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "hi " * 460}]
    out = live.client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN
    assert 16 < out.usage.completion_tokens <= 48 and out.choices[0].finish_reason == "length"


def test_echo_of_several_prompts_with_n_echoes_each_its_own(live):
    prompts = ["The capital of France is", "One, two,"]
    alone = [_alone(live, p, 3) for p in prompts]
    expected = [prompts[0] + alone[0]] * 2 + [prompts[1] + alone[1]] * 2
    for form in (prompts, [live.engine.input_processor.tokenize(p) for p in prompts]):
        kw = dict(model=NAME, prompt=form, max_tokens=3, temperature=0, n=2, echo=True)
        out = live.client.completions.create(**kw)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
        streamed = {}
        for chunk in live.client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert [streamed[i] for i in range(4)] == expected


def test_prefix_cache_hits_count_only_blocks_found_cached(live):
    bs = live.engine.block_manager.block_size
    prompt = prompts_of_lengths([2 * bs + 8], seed=21, vocab=20000)[0]
    other = prompt[:bs] + prompts_of_lengths([bs + 8], seed=22, vocab=20000)[0]

    def hits_and_queries(tokens, **kw):
        before = scrape_metrics(live)
        live.client.completions.create(model=NAME, prompt=tokens, max_tokens=1, temperature=0, **kw)
        after = scrape_metrics(live)
        return tuple(
            after[n] - before.get(n, 0)
            for n in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        )

    n = len(prompt)
    assert hits_and_queries(prompt) == (0, n)  # new: nothing found
    assert hits_and_queries(prompt) == (2 * bs, n)  # its full blocks (the last token's is computed)
    assert hits_and_queries(other) == (bs, n)  # the shared first block
    # a scored prompt is computed whole (cached tokens have no logits): no hit
    assert hits_and_queries(prompt, extra_body={"prompt_logprobs": 1}) == (0, n)


# Concurrency, disconnects, overload ---------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fibonacci(n):",
    "The quick brown fox",
    "My favourite colour is",
    "Water boils at",
    "Monday, Tuesday,",
    "The largest planet is",
    "import numpy as np\n",
    "Roses are red,",
]


def test_concurrent_streams_are_not_lost_or_crossed(live):
    alone = {p: _alone(live, p, 8) for p in PROMPTS}

    async def one(client, prompt):
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        client = live.aclient()
        try:
            return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)]) for i in range(200)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 200
    wrong = [(p, t, alone[p]) for p, t in results if t != alone[p]]
    assert not wrong, wrong[:3]
    assert _wait_idle(live)


def test_client_disconnect_frees_blocks(live):
    assert _wait_idle(live)
    body = {"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with live.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert live.engine.has_unfinished()
        assert live.engine.block_manager.num_free_blocks < live.idle_free_blocks
    assert _wait_idle(live, 5), "a disconnected stream kept its request and blocks"
    # not streamed: the client gives up waiting
    with pytest.raises(httpx.TimeoutException):
        live.http.post("/v1/completions", json=body, timeout=1.0)
    assert _wait_idle(live, 5), "a disconnected request kept its blocks"


# Errors -------------------------------------------------------------------------------------


@dataclass
class Raw:
    """A body sent as these bytes, under this Content-Type."""

    content: str | bytes
    content_type: str = "application/json"


def _post(live, path: str, body):
    if isinstance(body, Raw):
        return live.http.post(path, content=body.content, headers={"content-type": body.content_type})
    return live.http.post(path, json={"model": NAME, **body})


def _assert_refused(live, r, status: int, param: str | None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    assert err["param"] == param, err
    assert param is None or param in err["message"] or status == 404  # the message names the field
    assert live.http.get("/health").status_code == 200  # and the engine loop goes on


RAW_HI = f'{{"model": "{NAME}", "prompt": "Hi", '
BAD = [
    (Raw("not json"), 400, None),
    (Raw(b'{"prompt": "\xff\xfe"}'), 400, None),  # not UTF-8
    (Raw(RAW_HI + '"temperature": NaN}'), 400, "temperature"),
    (Raw(RAW_HI + '"top_p": Infinity}'), 400, "top_p"),
    (Raw(RAW_HI + '"max_tokens": -Infinity}'), 400, "max_tokens"),
    (Raw(RAW_HI + '"max_tokens": 4}', "text/plain"), 415, None),
    (Raw(RAW_HI + '"max_tokens": 4}', "application/x-www-form-urlencoded"), 415, None),
    ({"prompt": 12}, 400, "prompt"),
    ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "4"}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 4.5}, 400, "max_tokens"),
    ({"prompt": "Hi", "n": True}, 400, "n"),
    ({"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "Hi", "echo": 1}, 400, "echo"),
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    ({"prompt": "Hi", "n": 0}, 400, "n"),
    ({"prompt": "Hi", "n": 10**6}, 400, "n"),
    ({"prompt": "Hi", "logprobs": 1000}, 400, "logprobs"),
    ({"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "Hi", "seed": 10**30}, 400, "seed"),
    ({"prompt": "Hi", "seed": -(10**30)}, 400, "seed"),
    ({"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "Hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"prompt": "Hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "Hi", "stop": ["."] * 65}, 400, "stop"),
    ({"prompt": "Hi", "stop": [1]}, 400, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [""]}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": [[5], []]}, 400, "prompt"),
    ({"prompt": [5, 1.5]}, 400, "prompt"),
    ({"prompt": [5, True]}, 400, "prompt"),
    ({"prompt": [5, 49152]}, 400, "prompt"),
    ({"prompt": [[5], [49152]]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    (Raw(json.dumps({"model": NAME, "prompt": "a\ud800b"})), 400, "prompt"),
    (Raw(json.dumps({"model": NAME, "prompt": ["ok", "a\udfffb"]})), 400, "prompt"),
    ({"prompt": "Hi", "stop": ["x", ""]}, 400, "stop"),
    (Raw(json.dumps({"model": NAME, "prompt": "Hi", "stop": "\ud800"})), 400, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [1] * 257}, 400, "stop_token_ids"),
    ({"prompt": "Hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "Hi", "model": "gpt-5"}, 404, "model"),
    ({"prompt": "Hi", "stream": True, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests_are_4xx(live, body, status, param):
    _assert_refused(live, _post(live, "/v1/completions", body), status, param)


HI = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}, "messages"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": HI, "logprobs": "yes"}, "logprobs"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HI, "n": MAX_WAITING + 1}, "n"),
    (Raw(json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a\ud800"}]})), "messages"),
    (
        Raw(
            json.dumps(
                {
                    "model": NAME,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
                }
            )
        ),
        "messages",
    ),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests_are_4xx(live, body, param):
    _assert_refused(live, _post(live, "/v1/chat/completions", body), 400, param)


def test_bad_chat_requests_through_the_client(live):
    with pytest.raises(openai.NotFoundError):
        live.client.chat.completions.create(model="other", messages=HI)
    with pytest.raises(openai.BadRequestError, match="context length"):
        live.client.chat.completions.create(model=NAME, messages=HI, max_tokens=MAX_MODEL_LEN)
    assert _alone(live, "Hi", 2)  # still serving
    assert _wait_idle(live)


# Fields of OpenAI's or vLLM's requests that ringserve does not implement: each must be
# refused by name, never answered as if it had been honoured.
UNSUPPORTED = [
    ("/v1/completions", "truncate_prompt_tokens", 8),  # vLLM
    ("/v1/completions", "allowed_token_ids", [1, 2]),  # vLLM
    ("/v1/completions", "best_of_all", 3),  # nobody's
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),  # OpenAI
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "Paris"}),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": False}),  # vLLM
    ("/v1/chat/completions", "use_beam_search", True),
]


@pytest.mark.parametrize("path,field,value", UNSUPPORTED, ids=[f for _, f, _ in UNSUPPORTED])
def test_unsupported_fields_are_refused_by_name(live, path, field, value):
    body = {"max_tokens": 2, field: value}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": HI})
    r = _post(live, path, body)
    _assert_refused(live, r, 400, field)
    assert "does not support" in r.json()["error"]["message"]


def test_every_unsupported_field_is_named_nested_ones_by_path(live):
    body = {"messages": [{**HI[0], "mood": "calm"}], "max_tokens": 2, "x": 1, "y": "z"}
    r = _post(live, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(f"{where}: " in message for where in ("messages.0.mood", "x", "y")), message
    r = _post(live, "/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {"continuous": 1}})
    _assert_refused(live, r, 400, "stream_options.continuous")


def test_a_message_name_reaches_the_chat_template(live, monkeypatch):
    seen = []
    chat_prompt = live.engine.input_processor.chat_prompt
    monkeypatch.setattr(
        live.engine.input_processor,
        "chat_prompt",
        lambda messages, **kw: seen.append(messages) or chat_prompt(messages, **kw),
    )
    body = {"messages": [{"role": "user", "content": "hi", "name": "ada"}, *HI], "max_tokens": 2}
    assert _post(live, "/v1/chat/completions", body).status_code == 200
    assert seen[-1][0]["name"] == "ada" and "name" not in seen[-1][1]


def test_metadata_fields_are_accepted_and_change_nothing(live):
    kw = {"messages": HI, "max_tokens": 4, "temperature": 0}
    expected = _post(live, "/v1/chat/completions", kw).json()["choices"][0]["message"]["content"]
    labels = {
        "user": "u-1",
        "metadata": {"team": "search", "run": "7"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "hash-of-user",
        "prompt_cache_key": "tenant-3",
    }
    # null is an unset field in OpenAI's API: clients echo messages with such nulls
    assistant = {"role": "assistant", "content": "Hello!", "tool_calls": None, "refusal": None}
    r = _post(live, "/v1/chat/completions", {**kw, **labels, "tools": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    r = _post(live, "/v1/chat/completions", {**kw, "messages": [*HI, assistant, *HI]})
    assert r.status_code == 200, r.text
    # through the official client, as an application labels its requests
    out = live.client.chat.completions.create(model=NAME, **kw, user="u-1", metadata={"a": "b"}, store=False)
    assert out.choices[0].message.content == expected
    # values that would ask for something ringserve does not do are refused, naming the field
    for field, value in (("store", True), ("service_tier", "priority"), ("metadata", {"k": 1})):
        _assert_refused(live, _post(live, "/v1/chat/completions", {**kw, field: value}), 400, field)
    many = {str(i): "v" for i in range(17)}  # OpenAI's bound: 16 pairs
    _assert_refused(live, _post(live, "/v1/chat/completions", {**kw, "metadata": many}), 400, "metadata")


def test_sampling_controls_reach_the_engine(live):
    tok = live.engine.tokenizer
    token = tok.encode(" banana", add_special_tokens=False)[0]
    kw = dict(model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0)
    out = live.client.completions.create(**kw, logit_bias={str(token): 100})
    assert out.choices[0].text == tok.decode([token] * 3)
    chat = live.client.chat.completions.create(
        model=NAME, messages=HI, max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert chat.choices[0].message.content == tok.decode([token] * 3)
    plain = _alone(live, kw["prompt"], 8)
    penalised = live.client.completions.create(
        **{**kw, "max_tokens": 8}, frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"repetition_penalty": 1.5, "min_p": 0.1},
    )  # fmt: skip
    assert penalised.choices[0].text != plain
    eos = {str(min(live.engine.eos_token_ids)): 100}  # EOS would come first
    held = live.client.completions.create(
        **{**kw, "max_tokens": 8}, logit_bias=eos, extra_body={"min_tokens": 5}
    )
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"  # 5, then EOS
    # bad_words: the word the greedy answer starts with is never written
    first_word = plain.split()[0]
    avoided = live.client.completions.create(
        **{**kw, "max_tokens": 8}, extra_body={"bad_words": [first_word]}
    )
    assert first_word not in avoided.choices[0].text.split()[:1] and avoided.choices[0].text != plain


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"logit_bias": {"x1": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"10000000": 5}}, None, "outside the vocabulary"),
        ({"best_of": 3}, "best_of", "best_of"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"min_tokens": 9}, None, "min_tokens must be at most max_tokens"),
    ],
)
def test_bad_sampling_controls_are_400(live, extra, param, message):
    r = _post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_chat_content_as_text_parts(live):
    question = "What is the capital of France?"
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    kw = dict(model=NAME, max_tokens=8, temperature=0)
    as_text = live.client.chat.completions.create(messages=[{"role": "user", "content": question}], **kw)
    as_parts = live.client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_fastapi_refusals_are_in_openai_shape(live):
    _assert_refused(live, live.http.get("/v1/nothing"), 404, None)
    _assert_refused(live, live.http.get("/v1/completions"), 405, None)


def test_openapi_describes_the_request_and_answer_models(live):
    from ringserve.server import protocol as P

    schema = live.http.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, request, answer, chunk in (
        ("/v1/completions", P.CompletionRequest, P.CompletionResponse, P.CompletionResponse),
        ("/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse, P.ChatCompletionChunk),
    ):
        op = schema["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
        assert body == request.__name__ and set(components[body]["properties"]) == set(request.model_fields)
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith("/" + answer.__name__)
        assert chunk.__name__ in json.dumps(ok["text/event-stream"]) and chunk.__name__ in components
        for status in ("4XX", "5XX"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse"
            )
        assert "422" not in op["responses"]  # refusals are 400s, never FastAPI's 422
    prompt = components["CompletionRequest"]["properties"]["prompt"]["oneOf"]
    assert [p.get("type") for p in prompt] == ["string", "array", "array", "array"]


def test_huge_body_is_413(live):
    from ringserve.server.api import MAX_BODY_BYTES

    chunk = b" " * 2**20
    for how in ("announced", "chunked"):  # Content-Length given, or not (counted as it is read)

        def body():
            yield b'{"prompt": "'
            for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
                yield chunk
            yield b'"}'

        headers = {"content-type": "application/json"}
        if how == "announced":
            headers["content-length"] = str(MAX_BODY_BYTES + len(chunk) + 14)
        r = live.http.post("/v1/completions", content=body(), headers=headers)
        _assert_refused(live, r, 413, None)
    assert _alone(live, "Hi", 2)


def test_api_key(live):
    wrong = ["Bearer wrong", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"bearer {KEY}"]
    for headers in ({}, *({"Authorization": w} for w in wrong)):
        r = httpx.get(live.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert [m.id for m in live.client.models.list().data] == [NAME]
    assert httpx.get(live.url + "/health").status_code == 200  # outside /v1: no key
    version = httpx.get(live.url + "/version").json()
    assert version["version"] and version["parallel"] == {"tp": 1, "cp": 1, "ep": 1, "dp": 1}


def test_cache_config_info_tells_the_kv_capacity(live):
    """vLLM's vllm:cache_config_info: the KV cache's blocks, tokens and dtype in its labels."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.url + "/metrics").text
    (info,) = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    blocks = live.engine.block_manager
    assert info.value == 1 and info.labels["cache_dtype"] == "auto"
    assert int(info.labels["num_gpu_blocks"]) == blocks.num_blocks
    assert int(info.labels["num_gpu_tokens"]) == blocks.num_blocks * blocks.block_size


def testscrape_metrics(live):
    before = scrape_metrics(live)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert name in before
    live.client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0)
    live.client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0)
    after = scrape_metrics(live)
    prompt_len = len(live.engine.input_processor.tokenize("The capital of France is"))
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 2 * prompt_len
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 10
    assert (
        after["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0)
        == 2 * prompt_len
    )
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert after[name] - before.get(name, 0) == 2
    assert (
        after["vllm:inter_token_latency_seconds_count"]
        - before.get("vllm:inter_token_latency_seconds_count", 0)
        == 8
    )


def test_vllm_v1_request_metrics(live):
    """The per-request histograms vLLM v1's dashboards read, the tokens per step, n, and the
    engine (replica) label on the finished-request counter."""
    from prometheus_client.parser import text_string_to_metric_families

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert _wait_idle(live)
    before, computed = scrape_metrics(live), live.engine.num_computed_tokens
    prompt = "The capital of France is"
    live.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    live.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    after, computed = scrape_metrics(live), live.engine.num_computed_tokens - computed
    prompt_len = len(live.engine.input_processor.tokenize(prompt))
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == 3 * prompt_len
    assert delta("vllm:request_generation_tokens_count") == 3
    assert delta("vllm:request_generation_tokens_sum") == 5 + 3 + 3
    for phase in ("prefill", "decode"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3
        assert delta(f"vllm:request_{phase}_time_seconds_sum") > 0
    assert delta("vllm:iteration_tokens_total_sum") == computed > 0
    assert 0 < delta("vllm:iteration_tokens_total_count") <= 5 + 3  # at most one step per token
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 1 + 2
    assert delta("vllm:request_success_total") == 3
    text = httpx.get(live.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    success = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert success and all(s.labels["engine"] == "0" for s in success)
    assert {s.labels["finished_reason"] for s in success} >= {"length"}
    # the token-count buckets run 1, 2, 5, ... up to max_model_len, as vLLM's
    bounds = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if "le" in s.labels]
    assert bounds[:4] == ["1.0", "2.0", "5.0", "10.0"] and bounds[-2] == "500.0" and bounds[-1] == "+Inf"


def test_model_route(live):
    card = live.client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    r = live.http.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("nope")


def test_several_served_model_names(tiny_model_dir, monkeypatch):
    """--served-model-name a b: /v1/models lists both, a request may name either (or none),
    responses and metrics carry the first, as vLLM's."""
    import ringserve.server
    from ringserve.cli.main import main

    seen = {}
    monkeypatch.setattr(
        ringserve.server, "run_server", lambda engine, names, *a, **k: seen.setdefault("names", names)
    )
    assert main(["serve", "--device", "cpu", "--served-model-name", "first", "org/second"]) == [
        "first",
        "org/second",
    ]
    assert seen["names"] == ["first", "org/second"]

    engine = LLMEngine(
        tiny_model_dir("llama"), device="cpu", dtype="float32", engine_config=EngineConfig(num_blocks=32)
    )
    names = ["first", "org/second"]
    with serve_in_thread(build_app(engine, names)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == names
        assert [client.models.retrieve(name).id for name in names] == names  # a name with a slash too
        for name in (*names, None):
            body = {"prompt": [1, 2, 3], "max_tokens": 2, **({"model": name} if name else {})}
            out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            assert out["model"] == "first" and len(out["choices"]) == 1
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="third", prompt=[1, 2, 3], max_tokens=2)
        assert 'model_name="first"' in httpx.get(url + "/metrics").text


# The engine loop's failures, on a fake engine -----------------------------------------------


class FakeInputProcessor:
    """Token ids as given, no checks but an empty prompt, no generation_config.json."""

    def tokenize(self, prompt, chat=False):
        return list(prompt)

    def check_prompt(self, ids):
        if not ids:
            raise RequestError("the prompt is empty")

    def check_params(self, params):
        pass

    def default_params(self, **given):  # the fields as given
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})


class FakeEngine:
    """Fails every step with `error`; without one, never answers (what is added keeps waiting)."""

    def __init__(self, error: BaseException | None):
        self.error, self.seqs, self.pending, self.aborted, self.closed = error, {}, [], [], False
        self.max_model_len, self.tokenizer, self.model_path = 64, None, "fake"
        blocks = SimpleNamespace(num_free_blocks=8, num_blocks=8)
        self.replicas = [SimpleNamespace(running=[], waiting=[], num_preemptions=0, block_manager=blocks)]
        self.cp_steps = {}
        self.drafter = None  # no speculative decoding
        self.dead: BaseException | None = None  # what check_health raises (a rank died)
        self.input_processor = FakeInputProcessor()

    def add_request(self, prompt, params, request_id, prompt_token_ids=None, checked=False):
        self.pending.append(request_id)

    def has_unfinished(self):
        return bool(set(self.pending) - set(self.aborted))

    def step(self):
        if self.error is not None:
            raise self.error
        time.sleep(0.01)
        return []

    def abort(self, request_id):
        self.aborted.append(request_id)

    def check_health(self):
        if self.dead is not None:
            raise self.dead

    def close(self):
        self.closed = True


def test_overload_is_503_and_a_waiting_stream_is_aborted_when_its_client_leaves():
    engine = FakeEngine(None)
    with serve_in_thread(build_app(engine, "fake", max_waiting=4)) as url:
        body = {"prompt": [1, 2], "n": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as first:
            assert first.status_code == 200
            r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2]}, timeout=10)
            assert r.status_code == 503
            err = r.json()["error"]
            assert "overloaded" in err["message"] and err["code"] == 503
        # the client left before any token: its requests are aborted at once, not at the
        # first token (none would come here)
        deadline = time.monotonic() + 5
        while sorted(engine.aborted) != sorted(engine.pending):
            assert time.monotonic() < deadline, (engine.pending, engine.aborted)
            time.sleep(0.02)
        # and its --max-waiting slots are free again: as many choices wait at once as before
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as again:
            assert again.status_code == 200, again.read()
        # more choices than may ever wait: no use retrying, a 400
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "n": 5}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "--max-waiting 4" in r.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_requests_while_the_server_shuts_down_are_503():
    """Once the shutdown began (the lifespan stops the engine loop), a request still waiting
    ends with EngineStoppedError and one that arrives is refused: 503, never a hang."""

    async def main():
        ae = AsyncEngine(FakeEngine(None))  # never answers: the request stays waiting
        ae.start()
        await ae.wait_built()
        stream = ae.submit([("r0", [1, 2], SamplingParams())])
        await ae.stop()
        with pytest.raises(EngineStoppedError):
            async for _ in ae.results(stream):
                pass
        with pytest.raises(EngineStoppedError):
            ae.submit([("r1", [1, 2], SamplingParams())])

    asyncio.run(main())
    from starlette.testclient import TestClient

    engine = FakeEngine(None)
    client = TestClient(build_app(engine, "fake"))
    with client:  # start-up, then shutdown: the engine loop stops
        assert client.get("/health").status_code == 200
    assert engine.closed
    for body in ({"prompt": [1, 2]}, {"prompt": [1, 2], "stream": True}):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"] and r.json()["error"]["code"] == 503


# Routes anyone may call; every other route needs the API key when one is set.
PUBLIC_ROUTES = {
    "/health",
    "/version",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
}


def test_api_key_guards_every_route_but_the_public_ones():
    """Every route of the app (a new one included) answers 401 without the right key,
    unless it is one of PUBLIC_ROUTES."""
    from starlette.routing import Route
    from starlette.testclient import TestClient

    app = build_app(FakeEngine(None), "fake", api_key="the-key")
    routes = {(r.path, m) for r in app.routes if isinstance(r, Route) for m in (r.methods or ["GET"])}
    guarded = sorted((p, m) for p, m in routes if p not in PUBLIC_ROUTES)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= {p for p, _ in guarded}
    with TestClient(app) as client:
        for path, method in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "the-key"}):
                r = client.request(method, path, headers=headers, json={"prompt": [1, 2]})
                assert r.status_code == 401, (method, path, headers, r.status_code)
        assert client.get("/v1/models", headers={"Authorization": "Bearer the-key"}).status_code == 200
        for path in ("/health", "/metrics", "/openapi.json"):
            assert client.get(path).status_code == 200, path


def test_step_error_fails_requests_with_500_and_health_503():
    from starlette.testclient import TestClient

    engine = FakeEngine(RuntimeError("boom"))
    with TestClient(build_app(engine, "fake")) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 500 and "RuntimeError: boom" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})  # refused, still answering
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


def test_request_failing_in_a_step_is_a_500_for_it_alone():
    """An output with finish_reason "error" (the engine ended that request alone) fails only
    that request; the engine loop and /health are fine."""
    from starlette.testclient import TestClient

    from ringserve.outputs import RequestOutput

    class EngineFailingOneRequest(FakeEngine):
        def step(self):
            rid = self.pending.pop(0)
            return [RequestOutput(rid, None, [1], "", [], True, "error", error="TypeError: bad field")]

    with TestClient(build_app(EngineFailingOneRequest(None), "fake")) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "the request failed: TypeError: bad field"
        assert client.get("/health").status_code == 200


def test_worker_error_is_fatal():
    from ringserve.engine.executor import WorkerError

    fatal = []

    async def main():
        ae = AsyncEngine(FakeEngine(WorkerError("rank 1 died")), on_fatal=fatal.append)
        ae.start()
        stream = ae.submit([("r0", [1, 2], SamplingParams())])
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            async for _ in ae.results(stream):
                pass
        assert ae.fatal and not ae.healthy
        await ae.stop()

    asyncio.run(main())
    assert len(fatal) == 1 and "rank 1 died" in str(fatal[0])


def test_rank_death_while_idle_is_fatal_without_a_request():
    from ringserve.engine.executor import WorkerError

    fatal = []
    engine = FakeEngine(RuntimeError("never stepped"))

    async def main():
        ae = AsyncEngine(engine, on_fatal=fatal.append)
        ae.start()
        assert ae.healthy
        engine.dead = WorkerError("rank 2 (pid 7) was killed by SIGKILL")
        deadline = time.monotonic() + 5
        while not fatal and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert ae.fatal and not ae.healthy
        await ae.stop()

    asyncio.run(main())
    assert len(fatal) == 1 and "rank 2" in str(fatal[0])


def test_worker_error_ends_the_server_with_exit_code_1():
    from ringserve.engine.executor import WorkerError
    from ringserve.server import run_server

    port = free_port()
    answers = []

    def client():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
                answers.append(r)
                return
            except httpx.TransportError:
                time.sleep(0.1)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    engine = FakeEngine(WorkerError("rank 1 died"))
    assert run_server(engine, "fake", port=port, log_level="warning") == 1
    thread.join(10)
    assert answers[0].status_code == 500 and "rank 1 died" in answers[0].json()["error"]["message"]


# Start-up: the port first, then the engine, built on the engine thread ----------------------


@pytest.mark.timeout(60)
def test_a_taken_port_fails_at_once_before_the_engine_is_built(monkeypatch, capsys):
    from ringserve.cli.main import main
    from ringserve.engine.engine import LLMEngine

    def from_options(options, weights=None):
        raise AssertionError("the engine was built before the port was bound")

    monkeypatch.setattr(LLMEngine, "from_options", from_options)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        start = time.monotonic()
        code = main(["serve", "--device", "cpu", "--port", str(port)])
        elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), err
    assert elapsed < 1.0  # the imports are done: nothing loads before the port is bound


@pytest.mark.timeout(60)
def test_the_engine_is_built_and_stepped_on_the_engine_thread_after_the_port_listens():
    """A connection made while the engine is built waits in the listen backlog and is
    answered once it is built; the build and every step run on the one engine thread."""
    from ringserve.outputs import RequestOutput
    from ringserve.server import run_server

    threads = {"build": None, "steps": set()}
    building, connected = threading.Event(), threading.Event()

    class AnsweringEngine(FakeEngine):
        def step(self):
            threads["steps"].add(threading.current_thread())
            rid = self.pending.pop(0)
            return [RequestOutput(rid, None, [1], "x", [7], True, "length")]

    def build():
        threads["build"] = threading.current_thread()
        building.set()
        assert connected.wait(30), "no connection came while the engine was built"
        return AnsweringEngine(None)

    port = free_port()
    answers = []

    def client():
        assert building.wait(30)
        body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:  # during the build
            connected.set()
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            answers.append(b"".join(iter(lambda: conn.recv(65536), b"")))
        os.kill(os.getpid(), signal.SIGTERM)  # served: stop the server (exit 0)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    assert run_server(build, "fake", port=port, log_level="warning") == 0
    thread.join(10)
    assert answers and answers[0].startswith(b"HTTP/1.1 200"), answers
    assert threads["build"] is not threading.main_thread()
    assert threads["build"].name == "ringserve-engine" and threads["steps"] == {threads["build"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [ValueError("no such model"), MemoryError("too little memory")])
def test_an_engine_that_cannot_be_built_fails_the_start_with_exit_code_2(error, capsys):
    from ringserve.server import run_server

    def build():
        raise error

    assert run_server(build, "fake", port=free_port(), log_level="warning") == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {error}\n") and "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_a_bug_while_building_the_engine_keeps_its_traceback():
    from ringserve.server import run_server

    def build():
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        run_server(build, "fake", port=free_port(), log_level="warning")


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_engine_is_built_stops_at_once():
    """The build cannot be interrupted; the server gives up on it (KeyboardInterrupt, which
    `ringserve serve` reports as `interrupted`, exit 130) and leaves its thread behind."""
    from ringserve.server import run_server

    building, release = threading.Event(), threading.Event()

    def build():
        building.set()
        release.wait(30)
        return FakeEngine(None)

    def interrupt():
        assert building.wait(30)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_server(build, "fake", port=free_port(), log_level="warning")
        assert time.monotonic() - start < 10
    finally:
        release.set()


# The engine's additions, on a tiny random model ---------------------------------------------


def test_engine_logprobs_match_log_softmax(tiny_model_dir):
    from ringserve.model.tiny_models import hf_model

    folder = tiny_model_dir("llama")
    engine = LLMEngine(folder, device="cpu", dtype="float32", engine_config=EngineConfig(num_blocks=32))
    prompt = [5, 17, 42, 99, 3]
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=4), "a")
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0), "b")
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=1), "c")  # same steps
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert all(o.new_logprobs is None for o in outs["b"])
    first = outs["a"][0].new_logprobs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(folder)(torch.tensor([prompt])).logits[0, -1], -1)
    values, ids = ref.topk(4)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.token_id == ids[0].item() and first.logprob == pytest.approx(values[0].item(), abs=1e-4)
    assert [len(o.new_logprobs) for o in outs["a"]] == [1, 1, 1]
    # each row lists its own number of alternatives, though the batch computed the top 4
    assert [len(lp.top) for o in outs["a"] for lp in o.new_logprobs] == [4, 4, 4]
    assert [len(lp.top) for o in outs["c"] for lp in o.new_logprobs] == [1, 1, 1]
    engine.close()


def test_request_larger_than_the_cache_fails_alone(tiny_model_dir):
    # The engine refuses a cache smaller than max_model_len at start; a request can still
    # outgrow the cache where blocks are spread unevenly (CP ranks). Lift the limit after start.
    engine = LLMEngine(
        tiny_model_dir("llama"),
        device="cpu",
        dtype="float32",
        engine_config=EngineConfig(num_blocks=4, max_model_len=64),
    )
    engine.max_model_len = 512
    with pytest.raises(RequestError, match="whole KV cache"):
        engine.add_request(list(range(1, 70)), SamplingParams(max_tokens=2))  # 5 blocks of 16
    engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=60, ignore_eos=True), "big")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), "small")
    failed, done = [], {}
    while engine.has_unfinished():
        try:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        except RequestTooLargeError as e:
            failed.append(e.request_id)
    assert failed == ["big"] and list(done) == ["small"] and len(done["small"].token_ids) == 5
    assert engine.block_manager.num_free_blocks == 4 and not engine.seqs
    engine.close()


def test_scheduler_drops_a_request_larger_than_the_cache():
    from ringserve.engine.block_manager import BlockManager
    from ringserve.engine.scheduler import Scheduler
    from ringserve.engine.sequence import Sequence, Status

    scheduler = Scheduler(BlockManager(4, 16), 2048, 8)
    big, small = (
        Sequence("big", list(range(70)), SamplingParams()),
        Sequence("small", [1, 2], SamplingParams()),
    )
    scheduler.add(big)
    scheduler.add(small)
    with pytest.raises(RequestTooLargeError) as e:
        scheduler.schedule()
    assert e.value.request_id == "big" and big.status is Status.FINISHED
    assert isinstance(e.value, MemoryError)  # what callers caught before
    assert scheduler.block_manager.num_free_blocks == 4
    assert scheduler.schedule().seqs == [small]


# SIGTERM ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _served(tmp_path, *flags: str):
    """`ringserve serve` on the built-in model on the CPU as a subprocess: (process, URL, a
    function that reads its log); killed on exit if it is still running."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringserve.cli", "serve", "--device", "cpu", "--dtype", "float32"]
            + ["--port", str(port), "--max-model-len", "512", *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the server did not come up"
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            yield proc, url, log_path.read_text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _Streams:
    """Streamed requests, each read on a thread of its own into a list of its `data:` lines."""

    def __init__(self, url: str, bodies: list[tuple[str, dict]]):
        self.lines: list[list[str]] = [[] for _ in bodies]
        self.threads = [
            threading.Thread(target=self._read, args=(url + path, body, lines), daemon=True)
            for (path, body), lines in zip(bodies, self.lines)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(url: str, body: dict, lines: list[str]) -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            lines.extend(line for line in r.iter_lines() if line)

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.lines):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream did not end"


def _draining(url: str, timeout: float = 10) -> None:
    """Until /health says the server is shutting down (the signal was handled)."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.02)


def test_sigterm_finishes_every_stream_in_flight_and_refuses_new_requests(tmp_path):
    """20 streams in flight at SIGTERM all end as they would have (every token, then
    [DONE]); requests that come during the drain get a 503; the server then exits 0."""
    n, max_tokens = 20, 16  # a 2-core CI machine runs 20 streams at a few tokens a second
    body = {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    with _served(tmp_path) as (proc, url, log):
        streams = _Streams(url, [("/v1/completions", body)] * n)
        streams.wait_started()
        proc.send_signal(signal.SIGTERM)
        _draining(url)
        late = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert late.status_code == 503, late.text
        error = late.json()["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        streams.join()
        assert proc.wait(timeout=30) == 0, log()[-3000:]
        assert "Traceback" not in log() and "Cancel" not in log(), log()[-3000:]
    for lines in streams.lines:
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert sum(len(c["choices"]) for c in chunks) == max_tokens  # one token per chunk
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("cut", ["timeout", "second signal"])
def test_requests_still_running_at_the_shutdown_timeout_end_with_an_openai_error(tmp_path, cut):
    """Cut by --shutdown-timeout, or, without one, by a second signal (Ctrl-C again)."""
    long = {"max_tokens": 480, "ignore_eos": True}
    flags = ["--shutdown-timeout", "1"] if cut == "timeout" else []
    why = "--shutdown-timeout 1 s passed" if cut == "timeout" else "a second stop signal"
    with _served(tmp_path, *flags) as (proc, url, log):
        streams = _Streams(
            url,
            [
                ("/v1/completions", {"prompt": "Count:", **long}),
                ("/v1/chat/completions", {"messages": HI, **long}),
            ],
        )
        result = {}

        def plain():  # not streamed: its answer is one error body
            result["r"] = httpx.post(url + "/v1/completions", json={"prompt": "Go:", **long}, timeout=60)

        thread = threading.Thread(target=plain, daemon=True)
        thread.start()
        streams.wait_started()
        time.sleep(0.3)  # the plain request is admitted too
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if cut == "second signal":
            _draining(url)
            time.sleep(1)  # the requests go on meanwhile, however long they take
            assert all(not lines[-1].startswith("data: [DONE]") for lines in streams.lines)
            proc.send_signal(signal.SIGINT)
        streams.join()
        thread.join(60)
        assert proc.wait(timeout=30) == 0, log()[-3000:]
        assert time.monotonic() - signalled < 2 + 20  # the timeout (or wait), the cut, the exit
    for lines in streams.lines:
        assert lines[-1] == "data: [DONE]"  # the stream still ends as streams end
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert "shut down before the request finished" in error["message"]
        assert why in error["message"]
    r = result["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["code"] == 503 and "shut down" in r.json()["error"]["message"]


def _memory_mib(pid: int) -> dict[str, int]:
    """VmHWM (the peak resident set since start, or since the last reset) and VmRSS, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_a_50_mb_prompt_is_refused_at_once_in_bounded_memory(tmp_path):
    """Before: a 10 MB text prompt took 14.5 s and 3.4 GiB to refuse, a 50 MB one 13 GiB
    (the whole text through the tokenizer). Now it is refused by its length: the server's peak
    memory grows by a few copies of the body at most (parsing it), the tokenizer never runs."""
    big = "word " * (10 * 2**20)  # 50 MiB, 10 Mi tokens
    bound_mib = 400  # 8 copies of the prompt; measured: about 160 (completions), 210 (chat)
    with _served(tmp_path) as (proc, url, log):
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        for path, body in (
            ("/v1/completions", {"prompt": big}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
        ):
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from the present size
            before = _memory_mib(proc.pid)["VmRSS"]
            start = time.monotonic()
            r = httpx.post(url + path, json={**body, "max_tokens": 2}, timeout=120)
            took = time.monotonic() - start
            assert r.status_code == 400, r.text[:500]
            assert "characters long" in r.json()["error"]["message"]
            grown = _memory_mib(proc.pid)["VmHWM"] - before
            assert grown < bound_mib, f"{path}: the peak grew by {grown} MiB"
            assert took < 30, f"{path}: refused after {took:.1f} s"


@pytest.mark.parametrize(
    "flag,value",
    [("--max-waiting", "0"), ("--port", "-1"), ("--port", "70000"), ("--shutdown-timeout", "-1")],
)
def test_serve_refuses_bad_server_flags(flag, value, capsys):
    from ringserve.cli.main import main

    assert main(["serve", flag, value]) == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_access_log_is_off_by_default_and_structured_when_on(caplog):
    from starlette.testclient import TestClient

    caplog.set_level("INFO", logger="ringserve.access")
    with TestClient(build_app(FakeEngine(None), "fake")) as client:
        assert client.get("/health").status_code == 200
    assert not [r for r in caplog.records if r.name == "ringserve.access"]
    with TestClient(build_app(FakeEngine(None), "fake", access_log=True)) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ringserve.access"]
    assert [(line["method"], line["path"], line["status"]) for line in lines] == [
        ("GET", "/health", 200),
        ("POST", "/v1/completions", 400),
    ]
    assert all(line["duration_ms"] >= 0 for line in lines)
