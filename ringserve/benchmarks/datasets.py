"""The benchmark's prompts: random token ids, ShareGPT conversations from a local file, and
shared prefixes with random suffixes, as `vllm bench serve` samples them; and passages of a
local text that the answer copies (speculative decoding's workload: RAG, edits, summaries).

Prompt lengths are exact where they can be: with the server's tokenizer, a /v1/completions
prompt is sent as token ids, which the server takes as they are (no re-tokenising, so the
prompt is exactly --random-input-len tokens). A chat prompt must be text: random ids are
decoded and re-encoded until the text is exactly the asked number of tokens (the chat
template then adds its own tokens, as in vLLM). Without a tokenizer the random datasets fall
back to common English words, about one token each; the server's `usage` still gives the
true counts, which the metrics use.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

# Words that are one token in the usual BPE vocabularies (with their leading space).
WORDS = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no "
    "will more out up into do any your what some can time only other new about could these may "
    "first then like over such very after two most made also well back good where through".split()
)


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids for /v1/completions
    prompt_len: int  # tokens, by the benchmark's tokenizer (the server's usage is the truth)
    expected_output_len: int  # max_tokens to ask for


def load_tokenizer(path: str | None):
    """The tokenizer in a local model folder, or None (no folder, or none in it)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not path or not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """n integer lengths, uniform over [floor(mean*(1-r)), ceil(mean*(1+r))], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


class PromptMaker:
    """Random prompts of exact token lengths: token ids, or text that re-encodes to them."""

    def __init__(self, tokenizer, rng: np.random.Generator, as_text: bool):
        self.tokenizer, self.rng, self.as_text = tokenizer, rng, as_text
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)  # EOS, BOS, ... and the added markers:
            special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
            # sample only ordinary tokens: no EOS or chat markers inside a prompt
            self.allowed = np.array([i for i in range(len(tokenizer)) if i not in special])

    def ids(self, length: int) -> list[int]:
        return self.rng.choice(self.allowed, size=length).tolist()

    def make(self, length: int, prefix: str | list[int] | None = None) -> tuple[str | list[int], int]:
        """A prompt of `length` new tokens after `prefix` (made by `make` too), and its length."""
        if self.tokenizer is None:
            words = " ".join(self.rng.choice(WORDS, size=length).tolist())
            text = f"{prefix} {words}" if prefix else words
            return text, len(text.split())
        if not self.as_text:
            ids = (prefix or []) + self.ids(length)
            return ids, len(ids)
        text = self.text(length)
        if prefix:
            text = prefix + text
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, length: int, tries: int = 10) -> str:
        """Text that encodes to `length` tokens: decode random ids, re-encode, trim or pad, again."""
        tok = self.tokenizer
        ids = self.ids(length)
        for _ in range(tries):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == length:
                return text
            ids = ids[:length] if len(ids) > length else ids + self.ids(length - len(ids))
        return tok.decode(ids)  # within a token or two after the tries


def random_requests(
    maker: PromptMaker,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """vLLM's random dataset: a shared random prefix, then random tokens of sampled lengths."""
    input_lens = sample_lengths(maker.rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(maker.rng, output_len, range_ratio, num_prompts)
    prefix = maker.make(prefix_len)[0] if prefix_len else None
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt, length = maker.make(int(n_in), prefix)
        out.append(SampleRequest(prompt, length, int(n_out)))
    return out


def prefix_repetition_requests(
    maker: PromptMaker,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[SampleRequest]:
    """num_prefixes random prefixes, each shared by its share of the requests (a random suffix
    each), in a shuffled order: what prefix caching is measured with."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be at least 1, got {num_prefixes}")
    prefixes = [maker.make(prefix_len)[0] for _ in range(num_prefixes)]
    out = []
    for i in maker.rng.permutation(num_prompts):
        prompt, length = maker.make(suffix_len, prefixes[i % num_prefixes])
        out.append(SampleRequest(prompt, length, output_len))
    return out


def sharegpt_requests(
    path: str,
    tokenizer,
    num_prompts: int,
    rng: np.random.Generator,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """The first human turn of each conversation as the prompt, the answer's length in tokens
    as max_tokens (or output_len), filtered as vLLM does: at least 4 tokens each, a prompt of at
    most 1024 and a total of at most 2048. Repeats conversations when there are too few."""
    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer: pass --tokenizer MODEL_FOLDER")
    with open(path) as f:
        data = json.load(f)
    conversations = [
        d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    out = []
    for i in rng.permutation(len(conversations)):
        prompt, answer = conversations[i][0]["value"], conversations[i][1]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        too_short = prompt_len < 4 or (output_len is None and n_out < 4)
        if too_short or prompt_len > 1024 or prompt_len + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, prompt_len, n_out))
        if len(out) == num_prompts:
            return out
    if not out:
        raise ValueError(f"{path}: no conversation fits (two turns, 4..1024 prompt tokens, 2048 in all)")
    return [out[i % len(out)] for i in range(num_prompts)]


# What the copy dataset asks of a passage: answers that copy most of the prompt, as RAG
# quotes, code edits and rewrites do (prompt lookup and draft models feed on them).
COPY_INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word:",
    "Copy the passage below, correcting any spelling mistakes and changing nothing else:",
    "Rewrite the passage below with each sentence on a line of its own:",
)


def copy_requests(
    path: str,
    tokenizer,
    num_prompts: int,
    passage_len: int,
    rng: np.random.Generator,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """Passages of about passage_len tokens from random places of a local text file, each
    after one of COPY_INSTRUCTIONS; max_tokens is the passage's length, so a model that does
    what it is asked copies its prompt to the end. The text is tokenised once. Without a
    tokenizer a word counts as a token."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if tokenizer is not None:
        units, join = tokenizer.encode(text, add_special_tokens=False), tokenizer.decode

        def count(s: str) -> int:
            return len(tokenizer.encode(s, add_special_tokens=False))
    else:
        units, join = text.split(), " ".join

        def count(s: str) -> int:
            return len(s.split())

    if num_prompts < 1:
        return []
    lengths = sample_lengths(rng, passage_len, range_ratio, num_prompts)
    if len(units) < lengths.max():
        raise ValueError(f"{path}: {len(units)} tokens, fewer than a passage of {lengths.max()}")
    out = []
    for n in lengths:
        start = int(rng.integers(0, len(units) - n + 1))
        # cut on tokens: a character split at either end decodes as U+FFFD, dropped
        passage = join(units[start : start + n]).strip("\ufffd").strip()
        if not passage:
            raise ValueError(f"{path}: a passage of {n} tokens holds no text; the file needs longer text")
        prompt = f"{COPY_INSTRUCTIONS[int(rng.integers(len(COPY_INSTRUCTIONS)))]}\n\n{passage}"
        out.append(SampleRequest(prompt, count(prompt), count(passage)))
    return out
