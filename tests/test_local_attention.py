"""Local attention (sliding windows, attention chunks) and attention sinks at the attention
level, against a dense masked softmax written out here with transformers' mask rules."""

from __future__ import annotations

import pytest
import torch

from ringserve.attention.dense import VarlenBatch, attention_with_lse
from ringserve.attention.local import chunk_pieces
from ringserve.config import AttentionWindow
from ringserve.kernels.lse_merge import add_sinks


def dense_reference(q, k, v, q_pos, k_pos, scale, sliding=None, chunk=None, sinks=None):
    """One sequence: q [Lq, NH, D] at q_pos, k/v [Lk, NKV, D] at k_pos; a query at p sees
    k <= p, p - sliding < k (sliding) and k // chunk == p // chunk (chunk), as
    transformers' masking_utils; a sink is one more logit per head with no value.
    -> (out, lse over the keys alone) in float64."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [NH, Lq, Lk]
    qp, kp = q_pos[:, None], k_pos[None, :]
    visible = kp <= qp
    if sliding is not None:
        visible &= kp > qp - sliding
    if chunk is not None:
        visible &= kp // chunk == qp // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [NH, Lq]
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], -1)
        vv = torch.cat([vv, torch.zeros_like(vv[:1])], 0)
    probs = torch.softmax(scores, -1)
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out, lse.transpose(0, 1)


def _suffix_batch(q_lens, k_lens, offsets):
    """Sequences whose keys are positions offsets[i] .. + k_lens[i] - 1, queries the last."""
    cu_q, cu_k = [0], [0]
    for a, b in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    q_pos = torch.cat([torch.arange(o + b - a, o + b) for a, b, o in zip(q_lens, k_lens, offsets)])
    k_pos = torch.cat([torch.arange(o, o + b) for b, o in zip(k_lens, offsets)])
    batch = VarlenBatch(
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        max(q_lens),
        max(k_lens),
        q_pos,
        k_pos,
        True,
        cu_q,
        cu_k,
        k_offsets=list(offsets),
    )
    return batch, q_pos, k_pos


@pytest.mark.parametrize("sliding,chunk", [(5, None), (300, None), (None, 8), (None, 7), (6, 16)], ids=str)
def test_windowed_attention_equals_the_dense_masked_softmax(sliding, chunk):
    """Fresh prompts, a chunk after a cached prefix, decode rows and keys gathered from a
    later block (k_offsets), with prompts spanning several windows or chunks, one spanning
    more than a tile of queries (_TILE)."""
    nh, nkv, d = 4, 2, 8
    q_lens, k_lens, offsets = [40, 9, 1, 300, 1], [40, 30, 23, 300, 5], [0, 0, 0, 0, 12]
    batch, q_pos, k_pos = _suffix_batch(q_lens, k_lens, offsets)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), nh, d, generator=g)
    k = torch.randn(sum(k_lens), nkv, d, generator=g)
    v = torch.randn(sum(k_lens), nkv, d, generator=g)
    window = AttentionWindow(sliding=sliding, chunk=chunk)
    out, lse = attention_with_lse(q, k, v, batch, d**-0.5, window)
    for i in range(len(q_lens)):
        qs, ks = (
            slice(batch.q_bounds[i], batch.q_bounds[i + 1]),
            slice(batch.k_bounds[i], batch.k_bounds[i + 1]),
        )
        ref_out, ref_lse = dense_reference(q[qs], k[ks], v[ks], q_pos[qs], k_pos[ks], d**-0.5, sliding, chunk)
        torch.testing.assert_close(out[qs].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qs].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_chunk_pieces_drop_chunks_before_the_first_query():
    """A chunk of 8 after 21 cached keys: the keys of chunks 0 and 1 form one piece with no
    query; then the first query's chunk (16..23) and the next (24..29)."""
    qb, kb, offs = chunk_pieces([0, 9], [0, 30], [0], 8)
    assert (qb, kb, offs) == ([0, 0, 3, 9], [0, 16, 24, 30], [0, 16, 24])


def test_sinks_join_the_softmax_denominator_only():
    """A sink per head, added after attention (and so after any LSE merge), equals a
    softmax with one more logit of value zero; a row that saw no key stays zero."""
    nh, nkv, d, n = 4, 2, 8, 12
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (nh, nkv, nkv))
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0])
    batch, q_pos, k_pos = _suffix_batch([n], [n], [0])
    for window in (AttentionWindow(), AttentionWindow(sliding=3)):
        out, lse = attention_with_lse(q, k, v, batch, d**-0.5, window)
        ref, _ = dense_reference(q, k, v, q_pos, k_pos, d**-0.5, window.sliding, sinks=sinks)
        torch.testing.assert_close(add_sinks(out, lse, sinks).double(), ref, rtol=1e-5, atol=1e-5)
    unseen = add_sinks(torch.zeros(1, nh, d), torch.full((1, nh), float("-inf")), sinks)
    assert torch.equal(unseen, torch.zeros(1, nh, d))


def _windowed_ring_rank(rank, world_size, algo, window):
    """One rank's ring attention for a whole prompt of 200 tokens (zigzag chunks of about
    25 tokens, far longer than the window) and 30 new tokens after 22 cached ones, against
    the dense masked softmax; with the ring's counts of skipped steps and transfers."""
    import torch.distributed as dist

    from ringserve.parallel.cp.ring import RingAttention

    from helpers import ring_inputs, ring_step

    block, heads, kv_heads, dim = 4, 4, 2, 8
    starts, totals = [0, 22], [200, 52]
    step, _, key_positions = ring_step(starts, totals, block, world_size, window.lookback())
    qs, ks, vs, q_positions, q, k, v = ring_inputs(step, key_positions, totals, rank, heads, kv_heads, dim)
    ring = RingAttention(dist.group.WORLD, step, algo, dim**-0.5, "cpu")
    rows = ring.local_key_rows(window)  # the keys some query sees, as the engine gathers them
    got, got_lse = ring(q, k[rows], v[rows], window)
    want, want_lse = [], []
    for x, kk, vv, p, total in zip(qs, ks, vs, q_positions, totals):
        out, lse = dense_reference(
            x, kk, vv, torch.arange(total), torch.arange(total), dim**-0.5, window.sliding, window.chunk
        )
        want.append(out[p])
        want_lse.append(lse[p])
    err = max(
        (got.double() - torch.cat(want)).abs().max().item(),
        (got_lse.double() - torch.cat(want_lse)).abs().max().item(),
    )
    return err, ring.skipped_steps, ring.transfers, ring.sent_keys, len(rows)


@pytest.mark.parametrize(
    "algo,window", [("pass_kv", AttentionWindow(sliding=5)), ("pass_q", AttentionWindow(chunk=8))], ids=str
)
def test_ring_skips_steps_outside_every_window(algo, window):
    """4 gloo ranks: the windowed ring equals the dense masked softmax, and ring steps
    between ranks whose keys no query sees are skipped (no attention call) with no
    transfer: with a window of 5 each zigzag chunk sees only the chunk before it (held by
    a neighbour at ring distance 1 or 3), so distance 2 never runs, and pass-KV sends just
    the keys the receiver's windows reach; chunks of 8 do not align with the zigzag chunks,
    so some spill over to a neighbour too."""
    from ringserve.parallel.local_world import run_local_world

    results = run_local_world(_windowed_ring_rank, 4, algo, window, timeout_s=60)
    assert all(err < 1e-5 for err, *_ in results), results
    skipped = [s for _, s, *_ in results]
    transfers = [t for _, _, t, *_ in results]
    # Keys gathered: every key of the fresh prompt, and of the other only those from the
    # first one its new tokens (positions 22..51) see on.
    assert sum(r[-1] for r in results) == 200 + 52 - window.first_visible(22), results
    if algo == "pass_kv":  # each transfer: at most the window's reach of 2 chunks of 2 sequences
        assert all(0 < k <= 2 * 2 * (window.sliding - 1) * t for _, _, t, k, _ in results), results
    assert sum(skipped) >= 4, skipped  # every rank skips a step (distance 2 at least)
    assert max(transfers) <= 2, transfers  # never the 3 transfers of a full ring


def test_auto_counts_only_the_keys_windows_see():
    """The cost model's cached tokens are those the new tokens can see, averaged over the
    layers: a follow-up turn of 1% new tokens on a 128K cache is pass-Q for full attention
    (the paper's figures, tests/test_cp.py: pass-KV from 8.4% new tokens at this T) but
    pass-KV when every layer has a window of 4096, and still pass-Q when one layer in six
    is full (5% visible new tokens)."""
    from ringserve.parallel.cp.policy import CPCalibration, choose_cp_algo, visible_cached_tokens

    paper = CPCalibration(attention_flops=800e12, link_bytes_per_s=50e9)
    context = 128 * 1024
    new = context // 100
    full, sliding = AttentionWindow(), AttentionWindow(sliding=4096)
    cached = [context - new]
    assert visible_cached_tokens((full,) * 6, cached) == context - new
    assert visible_cached_tokens((sliding,) * 6, cached) == 4095
    assert visible_cached_tokens((sliding,) * 5 + (full,), cached) == (5 * 4095 + context - new) / 6

    def algo(windows):
        return choose_cp_algo(new, visible_cached_tokens(windows, cached), 4, 128, 8, 2, paper)

    assert algo((full,) * 6) == "pass_q"
    assert algo((sliding,) * 6) == "pass_kv"
    assert algo((sliding,) * 5 + (full,)) == "pass_q"


MISTRAL_TOKENS = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("algo", ["pass_kv", "pass_q"])
def test_mistral_under_cp2_matches_transformers_and_skips_steps(algo, tiny_model_dir, monkeypatch):
    """cp=2 with the ring forced, blocks of 16 and a window of 8: a prefill of 40 tokens
    then decode steps, logits against transformers; the windowed ring ran (rank 0, in this
    process) and skipped the steps whose keys lay on a rank the window did not reach (a
    decode token whose window lies in one block sees nothing on the other rank)."""
    from ringserve import LLM
    from ringserve.engine.logits_probe import engine_logits
    from ringserve.model.tiny_models import hf_model
    from ringserve.parallel.cp.ring import RingAttention

    ran = {"pass_kv": 0, "pass_q": 0, "skipped": 0}
    for name in ran.keys() - {"skipped"}:
        original = getattr(RingAttention, "_local_" + name)

        def counting(attn, *args, name=name, original=original):
            before = attn.skipped_steps
            result = original(attn, *args)
            ran[name] += 1
            ran["skipped"] += attn.skipped_steps - before
            return result

        monkeypatch.setattr(RingAttention, "_local_" + name, counting)
    folder = tiny_model_dir("mistral")
    with LLM(folder, device="cpu", dtype="float32", block_size=16, cp=2, cp_algo=algo, timeout_s=60) as llm:
        ours = engine_logits(llm.engine, MISTRAL_TOKENS, prefill=40)
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([MISTRAL_TOKENS])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    layers, steps = 2, 1 + 20
    assert ran[algo] == layers * steps and ran[({"pass_kv", "pass_q"} - {algo}).pop()] == 0
    assert ran["skipped"] > 0


def _held_blocks(engine) -> int:
    manager = engine.block_manager
    return sum(1 for count in manager.ref_count if count > 0)


def _generate_counting_blocks(engine, prompts, params):
    """Run the prompts together: (each one's tokens, the most blocks held while all ran)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if len(engine.scheduler.running) == len(prompts):
            most = max(most, _held_blocks(engine))
    assert _held_blocks(engine) == 0
    return [tokens[i] for i in ids], most


# With a window of 8 (lookback 7) and blocks of 4, a sequence holds the blocks of its next
# token's lookback (3) and the one being filled; at most 2 more while a step's tokens land.
WINDOW_BLOCKS = -(-(7 + 4) // 4) + 1


def test_windowed_sequence_holds_a_bounded_number_of_blocks(tiny_model_dir):
    """Every layer of the tiny Mistral has a window of 8: with blocks of 4, two sequences
    of 90 and 70 tokens (23 + 18 blocks without releasing) hold at most their windows'
    blocks, counted after every step, while their greedy tokens still equal
    transformers'; they run at once, so released blocks are reused meanwhile."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy, hf_model

    folder = tiny_model_dir("mistral")
    prompts = [MISTRAL_TOKENS[:30], MISTRAL_TOKENS[30:40]]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=False) as llm:
        tokens, most = _generate_counting_blocks(llm.engine, prompts, params)
    assert 0 < most <= 2 * WINDOW_BLOCKS, most
    ref = hf_model(folder)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(ref, prompt, 60)


def test_windowed_chunked_prefill_and_prefix_hit_match_transformers(tiny_model_dir):
    """Prefill in chunks of 5 tokens (chunks end across window and block boundaries), then a
    second request sharing a 24-token prefix (longer than the window): the hit reuses the
    cached blocks that are still held, and both continue as transformers does."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy, hf_model

    folder = tiny_model_dir("mistral")
    first, second = MISTRAL_TOKENS[:33], MISTRAL_TOKENS[:24] + MISTRAL_TOKENS[40:50]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = hf_model(folder)
    with LLM(
        folder, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=5, max_prefill_tokens=5
    ) as llm:
        assert llm.generate([first], params)[0].token_ids == hf_greedy(ref, first, 20)
        before = llm.engine.num_computed_tokens
        out = llm.generate([second], params)[0]
        assert out.token_ids == hf_greedy(ref, second, 20)
        assert out.num_cached_tokens == 24
        assert llm.engine.num_computed_tokens - before == len(second) - 24 + 19


def test_release_frees_exactly_the_blocks_before_the_next_tokens_lookback():
    """Lookback 7, blocks of 4: after 30 computed tokens the next token (position 30) sees
    positions 23.., so blocks 0-4 (positions 0-19) are released and block 5 (20-23) kept;
    a full group (lookback None) keeps them all; freeing skips released ones."""
    from ringserve.engine.block_manager import RELEASED, BlockManager
    from ringserve.engine.sequence import Sequence
    from ringserve.sampling_params import SamplingParams

    for release in (True, False):
        manager = BlockManager(16, 4, False, lookback=7, group_lookbacks=(7 if release else None,))
        seq = Sequence("a", list(range(30)), SamplingParams())
        assert manager.allocate(seq, 30)
        seq.num_computed_tokens = 30
        manager.release_outside_window(seq)
        if release:
            assert seq.block_table[:5] == [RELEASED] * 5 and RELEASED not in seq.block_table[5:]
            assert manager.num_free_blocks == 16 - 3
        else:
            assert RELEASED not in seq.block_table and manager.num_free_blocks == 16 - 8
        manager.free(seq)
        assert manager.num_free_blocks == 16


def test_windowed_decode_under_cp_is_one_fused_call_over_each_windows_keys():
    """A decode step of the ring (one query per sequence, after all its keys on this rank)
    under a window: still the one fused varlen call, each sequence's keys starting at its
    window (a suffix of them); a sequence whose window holds none of its keys here is left
    out, and a prefill chunk takes the block plan."""
    from ringserve.attention.plan import plan_seen

    def t(*values):
        return torch.tensor(values, dtype=torch.int64)

    plan = plan_seen([0, 1, 2, 3], [0, 10, 14, 20], [t(10), t(4), t(6)], [t(6), t(0), t(6)])
    layout = plan.decode
    assert layout.rows == [0, 1] and layout.k_starts == [6, 10] and layout.k_counts == [4, 4]
    chunk = plan_seen([0, 3], [0, 10], [t(8, 9, 10)], [t(2, 3, 4)])
    assert chunk.decode is None and chunk.banded


def test_mistral_under_cp2_releases_blocks_and_generates_as_transformers(tiny_model_dir):
    """cp=2 (auto ring), blocks of 4: two sequences generate together while each releases
    the blocks behind its window on both ranks (and the other takes them): the blocks held
    stay bounded and the greedy tokens equal transformers'."""
    from ringserve import LLM, SamplingParams
    from ringserve.model.tiny_models import hf_greedy, hf_model

    folder = tiny_model_dir("mistral")
    prompts = [MISTRAL_TOKENS[:30], MISTRAL_TOKENS[30:41]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, cp=2, timeout_s=60) as llm:
        tokens, most = _generate_counting_blocks(llm.engine, prompts, params)
    assert 0 < most <= 2 * WINDOW_BLOCKS, most
    ref = hf_model(folder)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(ref, prompt, 24)


def test_first_visible_block_against_brute_force():
    """config.first_visible_block against the masks, key by key. With a window (exact): the
    block of the first key its mask lets a query at p see. With a lookback L (a KV group's,
    the CP layout's widest): the block of the first of keys p - L .. p, never after the
    exact block of any window whose lookback is at most L, so a group keeps every block
    each of its layers reads."""
    from ringserve.config import first_visible_block

    windows = [AttentionWindow(sliding=s, chunk=c) for s in (None, 1, 3, 8) for c in (None, 1, 4, 7)]
    for block_size in (1, 2, 4, 5):
        for p in range(40):
            for w in windows:
                seen = [
                    k
                    for k in range(p + 1)
                    if (w.sliding is None or p - w.sliding < k)
                    and (w.chunk is None or k // w.chunk == p // w.chunk)
                ]
                assert first_visible_block(p, block_size, w) == seen[0] // block_size, (p, block_size, w)
            for lookback in (None, 0, 2, 7, 15):
                keys = range(p + 1) if lookback is None else range(max(0, p - lookback), p + 1)
                first = first_visible_block(p, block_size, lookback)
                assert first == keys[0] // block_size, (p, block_size, lookback)
                for w in windows:
                    if lookback is None or (w.lookback() is not None and w.lookback() <= lookback):
                        assert first <= first_visible_block(p, block_size, w), (p, block_size, lookback, w)


def test_windows_come_from_the_transformers_config():
    """layer_types where the config has it (Gemma 3, gpt-oss, Llama 4 text), sliding_window
    on every layer otherwise (Mistral; null: full); an unknown layer type is refused by name."""
    import transformers as tf

    from ringserve.config import attention_windows_from_hf
    from ringserve.errors import ModelLoadError

    full, sliding = AttentionWindow(), AttentionWindow(sliding=128)
    oss = tf.GptOssConfig(num_hidden_layers=4, sliding_window=128)
    assert attention_windows_from_hf(oss, 4) == (sliding, full, sliding, full)
    llama4 = tf.Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=16)
    assert attention_windows_from_hf(llama4, 4) == (AttentionWindow(chunk=16),) * 3 + (full,)
    mistral = tf.MistralConfig(num_hidden_layers=2, sliding_window=8)
    assert attention_windows_from_hf(mistral, 2) == (AttentionWindow(sliding=8),) * 2
    assert (
        attention_windows_from_hf(tf.MistralConfig(num_hidden_layers=2, sliding_window=None), 2)
        == (full,) * 2
    )
    oss.layer_types = ["sliding_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(ModelLoadError, match="linear_attention"):
        attention_windows_from_hf(oss, 4)
    window = AttentionWindow(sliding=5, chunk=8)
    assert window.first_visible(20) == 16 and window.first_visible(13) == 9 and window.lookback() == 4
    assert window.first_visible(torch.tensor([0, 20])).tolist() == [0, 16]


@pytest.mark.parametrize("window", [AttentionWindow(sliding=5), AttentionWindow(chunk=8)], ids=str)
def test_windowed_ring_plans_equal_the_masked_math(window):
    """Every (query rank, key rank) batch of a 4-rank windowed ring step, planned as the GPU
    runs it (shifted blocks, masked band tiles, unseen rows), against the count-masked math
    path; full and trimmed (what a pass-KV step receives) key sets."""
    from ringserve.attention.dense import _math_varlen, _planned

    from helpers import ring_step

    step, _, _ = ring_step([0, 22], [200, 52], 4, 4, window.lookback())
    g = torch.Generator().manual_seed(2)
    planned_kinds = set()
    for q_rank in range(4):
        for k_rank in range(4):
            for trimmed in (False, True):
                batch = step.varlen(q_rank, k_rank, "cpu", window, trimmed=trimmed)
                q = torch.randn(batch.q_bounds[-1], 4, 8, generator=g)
                k, v = (torch.randn(batch.k_bounds[-1], 2, 8, generator=g) for _ in range(2))
                plan = batch.plan()
                planned_kinds |= {kind for kind in ("groups", "banded", "unseen") if getattr(plan, kind)}
                out, lse = _planned(q, k, v, plan, batch, 8**-0.5)
                ref_out, ref_lse = _math_varlen(q, k, v, batch, 8**-0.5)
                torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert planned_kinds == {"groups", "banded", "unseen"} or window.chunk, planned_kinds
