"""Prompt-lookup drafts (engine/ngram_proposer.py) against a scan of the whole sequence, and
the work per step of a 100K-token prompt's lookups."""

import random

import pytest

from ringserve.engine.ngram_proposer import NgramIndex


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The reference: for the longest n first, the latest earlier place where the last n tokens
    occur with a token after them; the k tokens that follow it, the copy running on into the
    tokens it adds (an overlapping copy) where it reaches the end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for j in range(length - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                copied = list(tokens)
                for i in range(k):
                    copied.append(copied[j + n + i])
                return copied[length:]
    return []


@pytest.mark.parametrize("min_n,max_n,vocab", [(1, 3, 4), (2, 4, 6), (3, 5, 3), (1, 1, 10)])
def test_drafts_equal_a_scan_of_the_sequence(min_n, max_n, vocab):
    rng = random.Random(min_n * 100 + max_n)
    for trial in range(20):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        index = NgramIndex(min_n, max_n, prompt)
        tokens = list(prompt)
        for _ in range(30):
            k = rng.randrange(1, 6)
            assert index.propose(k) == scan(tokens, k, min_n, max_n), (trial, tokens)
            step = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]  # a step's accepted tokens
            index.extend(step)
            tokens += step
        cut = rng.randrange(0, len(tokens) + 1)
        index.truncate(cut)
        assert index.propose(3) == scan(tokens[:cut], 3, min_n, max_n)


def test_copied_passage_is_drafted_from_its_latest_occurrence():
    passage = list(range(100, 120))
    index = NgramIndex(2, 4, [1, 2, *passage, 3, 4, 5, *passage[:6]])
    assert index.propose(5) == passage[6:11]
    index.extend(passage[6:11])
    draft = index.propose(50)
    assert draft[:23] == passage[11:] + [3, 4, 5] + passage[:6] + passage[6:11]
    assert draft[23:] == draft[:27]  # past the end the copy runs on into itself


def test_lookup_work_per_step_does_not_grow_with_a_100k_prompt():
    """Each step costs a few dictionary probes per n-gram size and the draft's slice, whether
    the prompt is 1K or 100K tokens long (a scan would cost the prompt's length)."""
    rng = random.Random(0)
    per_step = {}
    for length in (1_000, 100_000):
        prompt = [rng.randrange(50_000) for _ in range(length)]
        index = NgramIndex(2, 5, prompt)
        assert index.probes <= 4 * length  # indexed once: one write per n-gram size per token
        before = index.probes
        for i in range(200):  # decode, copying spans of the prompt back (drafts found) or not
            draft = index.propose(4)
            start = rng.randrange(length - 8)
            index.extend(prompt[start : start + 2] if i % 2 else [rng.randrange(50_000)])
            assert len(draft) <= 4
        per_step[length] = (index.probes - before) / 200
    assert per_step[100_000] <= per_step[1_000] + 1 and per_step[100_000] <= 4 + 2 * 4
