"""Per-layer-type KV block accounting (engine/kv_groups.py): a hybrid model (three layers
with a sliding window of 8, one full layer) keeps every block in its full group only; its
windowed groups hold about a window's blocks, and it still answers as transformers does."""

from __future__ import annotations

import pytest
import torch

TOKENS = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
BS = 4
# A windowed group (lookback 7, blocks of 4) holds the blocks of its next token's lookback
# (at most 3) and the one being filled, and at most 2 more while a step's tokens land.
WINDOW_BLOCKS = -(-(7 + BS) // BS) + 2


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from ringserve.model.tiny_models import hf_model, save_tiny_model

    folder = save_tiny_model("qwen3_hybrid", str(tmp_path_factory.mktemp("qwen3_hybrid")))
    return folder, hf_model(folder)


def test_groups_follow_layer_types():
    """Layers group by lookback, every group of the smallest type's size (3 sliding and 1
    full: four groups of one layer, one KV tensor); no window or one window everywhere: one
    group of every layer (tensor j is layer j)."""
    from ringserve.config import AttentionWindow, ModelConfig
    from ringserve.worker.kv_cache import KVCache
    from ringserve.worker.kv_groups import KVGroups

    sliding, full = AttentionWindow(sliding=8), AttentionWindow()

    def config(windows):
        return ModelConfig("X", 8, 8, 8, len(windows), 1, 1, 4, 1e-5, 64, attention_windows=tuple(windows))

    groups = KVGroups.for_model(config([sliding, full, sliding, sliding]))
    assert groups.lookbacks == (7, 7, 7, None) and groups.group_size == 1
    assert groups.layer_group == (0, 3, 1, 2) and groups.layer_tensor == (0, 0, 0, 0)
    groups = KVGroups.for_model(config([sliding, full] * 2))  # gpt-oss-like: two groups of 2
    assert groups.lookbacks == (7, None) and groups.layer_tensor == (0, 0, 1, 1)
    assert KVCache.bytes_per_block(groups, 4, 1, 4, torch.float32) == 2 * 2 * 4 * 4 * 4
    for windows, lookback in (([full] * 2, None), ([sliding] * 3, 7)):
        groups = KVGroups.for_model(config(windows))
        assert groups.lookbacks == (lookback,) and groups.layer_tensor == tuple(range(len(windows)))
    # 30 tokens: the full group holds 8 blocks, a windowed one blocks 5.. (its last token sees 22..).
    assert KVGroups.for_model(config([sliding, full])).min_blocks(30, 4) == 8 + 3


def test_min_blocks_is_the_peak_of_computing_a_token_at_a_time():
    """min_blocks against brute force: a BlockManager computing the sequence one token a
    step (the fewest blocks any chunking can hold: a chunk needs at least what each of its
    tokens needs), releasing windowed blocks after each step as the engine does; the most
    blocks held at once. Token 6 of 8 (lookback 3, blocks of 4) still sees block 0 though
    the last token does not: the peak is not at the last token."""
    from ringserve.engine.block_manager import BlockManager
    from ringserve.engine.sequence import Sequence
    from ringserve.sampling_params import SamplingParams
    from ringserve.worker.kv_groups import min_blocks

    def peak(lookbacks, num_tokens, block_size):
        manager = BlockManager(1000, block_size, False, group_lookbacks=lookbacks)
        seq = Sequence("a", list(range(num_tokens)), SamplingParams())
        most = 0
        while seq.num_computed_tokens < num_tokens:
            assert manager.allocate(seq, 1)
            most = max(most, manager.num_blocks - manager.num_free_blocks)
            seq.num_computed_tokens += 1
            manager.release_outside_window(seq)
        return most

    assert min_blocks((3, None), 8, 4) == peak((3, None), 8, 4) == 4
    for block_size in (1, 2, 4, 5):
        for lookbacks in ((None,), (3,), (7, None), (4, 9, None), (15,), (0, None)):
            for num_tokens in range(1, 41):
                want = peak(lookbacks, num_tokens, block_size)
                assert min_blocks(lookbacks, num_tokens, block_size) == want, (
                    lookbacks,
                    num_tokens,
                    block_size,
                )


def test_prefix_hit_needs_only_the_blocks_windowed_groups_still_see():
    """Groups (lookback 7, full), blocks of 4: a finished 30-token sequence leaves its full
    blocks cached in both groups. A sequence sharing 24 tokens hits 6 blocks: the windowed
    group takes only blocks 4-5 (the next token, at 24, sees 17..), its earlier entries
    RELEASED. With its block 5 evicted the hit falls back to where both groups agree."""
    from ringserve.engine.block_manager import RELEASED, BlockManager
    from ringserve.engine.sequence import Sequence
    from ringserve.sampling_params import SamplingParams

    manager = BlockManager(40, 4, True, group_lookbacks=(7, None))
    first = Sequence("a", list(range(30)), SamplingParams())
    assert manager.allocate(first, 30) and manager.blocks_held(first) == [8, 8]
    first.num_computed_tokens = 30
    manager.cache_full_blocks(first)
    manager.release_outside_window(first)
    assert manager.blocks_held(first) == [3, 8]  # blocks 5-7 of the window (next token at 30 sees 23..)
    window_block_5 = first.block_tables[0][5]
    manager.free(first)

    second = Sequence("b", list(range(24)) + [99] * 10, SamplingParams())
    manager.match_prefix(second)
    assert second.num_computed_tokens == 24
    assert second.block_tables[0][:4] == [RELEASED] * 4 and RELEASED not in second.block_tables[0][4:]
    assert len(second.block_tables[1]) == 6 and RELEASED not in second.block_tables[1]
    assert second.num_released_blocks == [4, 0]
    manager.free(second)

    # The windowed group's block 5 reused by others (its cache entry evicted): 6 blocks no
    # longer hit; 5 do (the next token, at 20, sees 13..: blocks 3-4, still cached there).
    del manager.cached[(0, first.block_hashes[5])]
    manager.block_key[window_block_5] = None
    third = Sequence("c", list(range(24)) + [98] * 10, SamplingParams())
    manager.match_prefix(third)
    assert third.num_computed_tokens == 20
    assert third.block_tables[0][:3] == [RELEASED] * 3 and RELEASED not in third.block_tables[0][3:]


def test_hybrid_logits_and_greedy_tokens_equal_transformers(hybrid):
    """Prefill 30 tokens, chunks of 5 and 3 across window and block edges, then decode to
    80 through the paged cache (windowed groups' early blocks released as it goes): logits
    within 1e-4 of transformers'; greedy tokens equal."""
    from ringserve import LLM, SamplingParams
    from ringserve.engine.logits_probe import engine_logits
    from ringserve.model.tiny_models import hf_greedy

    folder, ref = hybrid
    with LLM(folder, device="cpu", dtype="float32", block_size=BS) as llm:
        ours = engine_logits(llm.engine, TOKENS, prefill=30, chunks=[5, 3])
        out = llm.generate([TOKENS[:30]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    with torch.no_grad():
        expected = ref(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert out[0].token_ids == hf_greedy(ref, TOKENS[:30], 20)


def _run_counting_blocks(engine, prompts, params):
    """Run the prompts together: (each one's tokens, per group the most blocks any sequence
    held after a step, per group the blocks each sequence held at its end)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    most = [0] * engine.block_manager.num_groups
    last = {}
    while engine.has_unfinished():
        for seq in engine.scheduler.running:
            last[seq.request_id] = engine.block_manager.blocks_held(seq)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        for seq in engine.scheduler.running:
            most = [max(m, h) for m, h in zip(most, engine.block_manager.blocks_held(seq))]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[i] for i in ids], most, [last[i] for i in ids]


def test_windowed_groups_stay_bounded_while_the_full_group_grows(hybrid):
    """Two sequences of 30 + 40 and 12 + 40 tokens at once, blocks of 4, chunked prefill of
    16 tokens a step: each windowed group holds at most WINDOW_BLOCKS of a sequence after
    every step, the full group all ceil(len / 4); greedy tokens equal transformers'."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy

    folder, ref = hybrid
    prompts = [TOKENS[:30], TOKENS[40:52]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(
        folder, device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=16, max_prefill_tokens=16
    ) as llm:
        groups = llm.engine.kv_groups
        tokens, most, last = _run_counting_blocks(llm.engine, prompts, params)
    full = groups.lookbacks.index(None)
    for g, lookback in enumerate(groups.lookbacks):
        if lookback is not None:
            assert 0 < most[g] <= WINDOW_BLOCKS, most
    # Before its last step a sequence holds, in the full group, every block of its context
    # (the prompt and 38 computed tokens: the 39th was sampled, the 40th ends it).
    assert [held[full] for held in last] == [-(-(len(p) + 38) // BS) for p in prompts]
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(ref, prompt, 40)


def test_hybrid_chunked_prefill_and_prefix_hit_match_transformers(hybrid):
    """Prefill in chunks of 5 tokens (ends across window and block edges), then a second
    request sharing the first 24 tokens: a hit of 24 cached tokens (the windowed groups
    reuse only their blocks from 16 on), only the rest computed; both continue as
    transformers does."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy

    folder, ref = hybrid
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first, second = TOKENS[:33], TOKENS[:24] + TOKENS[60:70]
    with LLM(
        folder, device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=5, max_prefill_tokens=5
    ) as llm:
        assert llm.generate([first], params)[0].token_ids == hf_greedy(ref, first, 20)
        before = llm.engine.num_computed_tokens
        out = llm.generate([second], params)[0]
        assert out.num_cached_tokens == 24
        assert llm.engine.num_computed_tokens - before == len(second) - 24 + 19
    assert out.token_ids == hf_greedy(ref, second, 20)


def test_hybrid_preemption_under_memory_pressure_matches_transformers(hybrid):
    """40 blocks, max_model_len 100: three requests of 8 + 60 tokens start together (8
    blocks each) and grow to 17 full blocks and ~4 per windowed group each: they cannot all
    fit, preempted ones are recomputed, and every greedy continuation equals transformers'."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy

    folder, ref = hybrid
    prompts = [TOKENS[10:18], TOKENS[20:28], TOKENS[50:58]]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=BS, num_blocks=40, max_model_len=100) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 60)


def test_hybrid_under_cp2_matches_transformers_with_bounded_windowed_groups(hybrid):
    """cp=2, blocks of 4: logits of a 40-token prefill and decode to 60 through the ring
    within 1e-4 of transformers'; then two sequences at once whose windowed groups hold at
    most WINDOW_BLOCKS each over both ranks' pools while their greedy tokens equal
    transformers'."""
    from ringserve import LLM, SamplingParams
    from ringserve.engine.logits_probe import engine_logits
    from ringserve.model.tiny_models import hf_greedy

    folder, ref = hybrid
    prompts = [TOKENS[:30], TOKENS[40:52]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=BS, cp=2, timeout_s=60) as llm:
        assert llm.engine.kv_groups.lookbacks == (7, 7, 7, None)
        ours = engine_logits(llm.engine, TOKENS[:60], prefill=40)
        tokens, most, _ = _run_counting_blocks(llm.engine, prompts, params)
    with torch.no_grad():
        expected = ref(torch.tensor([TOKENS[:60]])).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert all(0 < held <= WINDOW_BLOCKS for held in most[:3]), most
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(ref, prompt, 24)
