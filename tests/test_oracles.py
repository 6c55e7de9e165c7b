"""Oracles for engine behaviours that can break while greedy tokens still agree (issue 12):
logits on the prefix-cache, chunked and preemption paths against a plain run; LRU eviction
of cached blocks; the scheduler's limits and its no-starvation rule checked on every step;
the ring that actually ran under context parallelism."""

from __future__ import annotations

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.sequence import Sequence
from ringserve.parallel.cp.ring import RingAttention

import helpers
from helpers import VOCAB, run_requests, scored


def prompts_of_lengths(lengths, seed=0):
    return helpers.prompts_of_lengths(lengths, seed, VOCAB)


def assert_same_logits(got, expected):
    for (got_tokens, got_rows), (exp_tokens, exp_rows) in zip(got, expected, strict=True):
        assert got_tokens == exp_tokens
        torch.testing.assert_close(got_rows, exp_rows, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def uncached(folder, prompts, params, **kw):
    with LLM(folder, device="cpu", dtype="float32", enable_prefix_caching=False, **kw) as llm:
        return [run_requests(llm.engine, [p], params)[0] for p in prompts]


def test_prefix_cache_logits_equal_an_uncached_run(llama):
    """A block's cache entry is named by its tokens and everything before them: the same 8
    tokens after a different prefix are not reused (their keys were rotated for other
    positions and attended other tokens), while a true shared prefix is."""
    x, s = prompts_of_lengths([8, 8], seed=7)
    first = x + s + [1]
    moved = s + [9, 9, 9]  # s as its first block, not after x
    shared = x + s + [5, 6]
    params = scored(4)
    expected = uncached(llama, [moved, shared], params, block_size=4)
    with LLM(llama, device="cpu", dtype="float32", block_size=4) as llm:
        run_requests(llm.engine, [first], params)
        got = [run_requests(llm.engine, [p], params)[0] for p in (moved, shared)]
        before = llm.engine.num_computed_tokens
        run_requests(llm.engine, [shared], SamplingParams(max_tokens=1, temperature=0))
        assert llm.engine.num_computed_tokens - before == len(shared) - 16  # the hit is real
    assert_same_logits(got, expected)


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    """Two cached prompts, the older one used again: under pressure the other goes first."""
    bs = 4
    manager = BlockManager(num_blocks=9, block_size=bs)
    a, b, c = prompts_of_lengths([9, 9, 9], seed=8)  # 2 full blocks and a partial one each

    def serve(tokens) -> int:
        """Run a request to the end as the engine does: its prefix-cached tokens."""
        seq = Sequence("r", tokens, SamplingParams())
        manager.match_prefix(seq)
        hit = seq.num_computed_tokens
        assert manager.allocate(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
        manager.free(seq)
        return hit

    assert (serve(a), serve(b), serve(c)) == (0, 0, 0)  # 6 blocks cached, 3 never hashed
    assert serve(a) == 8  # a, most recently used now; b is the least
    big = Sequence("big", prompts_of_lengths([16], seed=9)[0], SamplingParams())
    # 4 blocks: the 3 never-cached partial blocks, then one cached block, b's last.
    assert manager.allocate(big, 16)
    manager.free(big)
    assert serve(c) == 8 and serve(a) == 8
    assert serve(b) == 4  # only its first block left


def check_every_step(
    scheduler, max_num_seqs: int, max_num_batched_tokens: int, max_prefill_tokens: int | None = None
) -> list[bool]:
    """Wrap the scheduler's schedule so that every step is checked: at most max_num_seqs
    running and in the batch, at most max_num_batched_tokens computed while some running
    sequence has its prompt computed (max_prefill_tokens while none has), and in a step that
    preempted, no request admitted (a waiting one would take the blocks just freed, and the
    preempted one, readmitted at once, could lose them again: either can starve). Returns
    the list, filled per step, of whether it preempted."""
    schedule = scheduler.schedule
    preempted_steps = []

    def checked_schedule():
        computed_before = {s.request_id: s.num_computed_tokens for s in scheduler.running}
        decoding = any(s.num_tokens - s.num_computed_tokens <= 1 for s in scheduler.running)
        limit = max_num_batched_tokens if decoding else (max_prefill_tokens or max_num_batched_tokens)
        preemptions_before = scheduler.num_preemptions
        batch = schedule()
        preempted = scheduler.num_preemptions > preemptions_before
        preempted_steps.append(preempted)
        assert len(batch.seqs) <= max_num_seqs and len(scheduler.running) <= max_num_seqs
        assert sum(batch.num_tokens) <= limit
        if preempted:
            # Admitted: not running before, or preempted (its computed tokens dropped) and back.
            admitted = {
                s.request_id for s in batch.seqs if computed_before.get(s.request_id) != s.num_computed_tokens
            }
            assert not admitted, f"admitted {admitted} in a step that preempted"
        return batch

    scheduler.schedule = checked_schedule
    return preempted_steps


def test_limits_every_step_and_chunked_logits(llama):
    """Many short prompts, chunked 16 tokens a step, at most 3 running: every step within
    the limits, and every generated token's log-probabilities those of the request alone."""
    prompts = prompts_of_lengths([9, 30, 5, 12, 7, 21, 6, 11, 8, 17], seed=3)
    params = scored(6)
    expected = uncached(llama, prompts, params)
    with LLM(
        llama,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        max_prefill_tokens=16,
    ) as llm:
        check_every_step(llm.engine.scheduler, 3, 16)
        got = run_requests(llm.engine, prompts, params)
    assert_same_logits(got, expected)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_admission_in_a_step_that_preempts_and_preempted_logits(prefix_caching, llama):
    """So few blocks that running requests are preempted, often, mid-prefill and mid-decode:
    no step that preempts admits anyone, and the recomputed requests' log-probabilities are
    those of each request alone."""
    prompts = prompts_of_lengths([40, 35, 30, 45, 20, 38, 25], seed=2)
    params = scored(20)
    expected = uncached(llama, prompts, params)
    with LLM(
        llama,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_blocks=36,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        max_prefill_tokens=12,
        enable_prefix_caching=prefix_caching,
    ) as llm:
        preempted_steps = check_every_step(llm.engine.scheduler, 4, 12)
        got = run_requests(llm.engine, prompts, params)
    assert sum(preempted_steps) >= 2
    assert_same_logits(got, expected)


class RingsRun:
    """Counts the rings rank 0 (the driver's worker) actually ran, one per layer and step
    (a pass-Q decode step's full-attention layers read the cache in place)."""

    def __init__(self, monkeypatch):
        self.counts = {"pass_kv": 0, "pass_q": 0}
        for method, algo in (("_pass_kv", "pass_kv"), ("_pass_q", "pass_q"), ("attend_in_place", "pass_q")):
            monkeypatch.setattr(RingAttention, method, self._counting(algo, getattr(RingAttention, method)))

    def _counting(self, algo, ring):
        def run(attn, *args):
            self.counts[algo] += 1
            return ring(attn, *args)

        return run

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return {k: v for k, v in counts.items() if v}


@pytest.mark.parametrize("algo", ["pass_kv", "pass_q"])
def test_forced_ring_runs_on_prefill_follow_up_turn_and_decode(algo, llama, monkeypatch):
    """cp=2 with the ring forced: a fresh prefill, its decode steps, and a follow-up turn
    over the cached first turn all run that ring (counted where it runs), with the tokens
    and logits of one rank."""
    first = prompts_of_lengths([37], seed=11)[0]
    common = dict(device="cpu", dtype="float32", block_size=4, timeout_s=60)
    with LLM(llama, **common) as llm:
        ref_first = run_requests(llm.engine, [first], scored(6))[0]
        second = first + ref_first[0] + [7, 8, 9]
        ref_second = run_requests(llm.engine, [second], scored(6))[0]
    rings = RingsRun(monkeypatch)
    layers = 2  # the tiny model's
    with LLM(llama, cp=2, cp_algo=algo, **common) as llm:
        engine = llm.engine
        engine.add_request(first, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        engine.step()
        assert rings.take() == {algo: layers}  # the fresh prefill
        got_first = run_requests(engine, [first], scored(6))[0]  # cached prefill + 5 decode steps
        assert rings.take() == {algo: 6 * layers}
        got_second = run_requests(engine, [second], scored(6))[0]
        assert rings.take() == {algo: 6 * layers}
        assert dict(engine.cp_steps) == {algo: 13}
    assert_same_logits([got_first, got_second], [ref_first, ref_second])


def test_prefix_cache_keys_are_sha256_of_the_chained_blocks_hashed_once_each(monkeypatch):
    """Python's hash() of int tuples is deterministic: colliding blocks could be searched
    offline. The keys are SHA-256 (hashlib here is the reference), each block's digest over
    its parent's digest and its int64 token ids; a growing sequence hashes each block once."""
    import hashlib
    import struct

    from ringserve.engine import block_manager as bm

    bs = 4
    manager = BlockManager(num_blocks=16, block_size=bs)
    tokens = prompts_of_lengths([11], seed=9)[0]
    seq = Sequence("r", tokens, SamplingParams())
    hashed = []
    real = bm.block_hash
    monkeypatch.setattr(bm, "block_hash", lambda parent, ids: hashed.append(len(ids)) or real(parent, ids))
    assert manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    for token in range(100, 110):  # decode: a block fills every 4 tokens
        seq.output_token_ids.append(token)
        assert manager.allocate(seq, 1)
        seq.num_computed_tokens += 1
        manager.cache_full_blocks(seq)
    all_tokens = tokens + list(range(100, 110))
    parent, expected = b"", []
    for i in range(len(all_tokens) // bs):
        parent = hashlib.sha256(parent + struct.pack(f"<{bs}q", *all_tokens[i * bs : (i + 1) * bs])).digest()
        expected.append(parent)
    assert seq.block_hashes == expected
    assert hashed == [bs] * len(expected)  # each block once, its own tokens only
    assert {key for _, key in manager.cached} == set(expected)
