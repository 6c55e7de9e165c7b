"""Context parallelism on gloo ranks: every layout's logits and greedy tokens equal the
single-rank result (which the model tests check against transformers)."""

import os
import subprocess
import sys

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.attention.dense import VarlenBatch, attention_with_lse
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.engine.logits_probe import engine_logits
from ringserve.parallel.cp.layout import place_blocks
from ringserve.parallel.cp.policy import CPCalibration, choose_cp_algo
from ringserve.parallel.cp.ring import PagedKeys, RingAttention
from ringserve.parallel.local_world import run_local_world

from helpers import prompts_of_lengths, ring_inputs, ring_step

BS = 4  # small KV blocks so that short prompts spread over every rank
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


LONG = prompts_of_lengths([101])[0]  # not a multiple of 2N blocks nor tokens for N = 2, 3, 4
VARSEQ = prompts_of_lengths([37, 5, 66, 12], seed=1)


def run(folder, **kw):
    """Greedy tokens of LONG alone and of a varseq batch, and the logits of a prefill + decode."""
    with LLM(folder, device="cpu", dtype="float32", block_size=BS, timeout_s=60, **kw) as llm:
        long = llm.generate([LONG], GREEDY)[0].token_ids
        batch = [o.token_ids for o in llm.generate(VARSEQ, GREEDY)]
        logits = engine_logits(llm.engine, LONG[:60], prefill=50)
    return long, batch, logits


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = run(tiny_model_dir(arch))
        return cache[arch]

    return get


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", dict(cp=2, cp_algo="pass_kv")),
        ("llama", dict(cp=2, cp_algo="pass_q")),
        ("llama", dict(cp=3)),
        ("qwen3", dict(cp=4, cp_algo="pass_kv")),
        ("qwen3", dict(cp=4, cp_algo="pass_q")),
        ("mixtral", dict(tp=2, cp=2)),
        ("qwen2", dict(cp=2)),
        ("gemma3", dict(cp=2, cp_algo="pass_kv")),
        ("gemma3", dict(cp=2, cp_algo="pass_q")),
        # Chunks of 16 (Llama 4) and windows of 8 (gpt-oss, with sinks) over the 101-token ring.
        ("llama4", dict(cp=2, cp_algo="pass_kv")),
        ("gpt_oss", dict(cp=2, cp_algo="pass_q")),
    ],
)
def test_cp_equals_single_rank(arch, layout, tiny_model_dir, reference):
    ref_long, ref_batch, ref_logits = reference(arch)
    long, batch, logits = run(tiny_model_dir(arch), **layout)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert long == ref_long
    assert batch == ref_batch


@pytest.mark.parametrize("algo", ["pass_kv", "pass_q"])
def test_second_turn_reuses_the_sharded_cache(algo, tiny_model_dir):
    folder = tiny_model_dir("llama")
    first = LONG
    with LLM(folder, device="cpu", dtype="float32", block_size=BS) as llm:
        answer = llm.generate([first], GREEDY)[0].token_ids
        second = first + answer + [7, 8, 9, 10, 11]
        expected = llm.generate([second], GREEDY)[0].token_ids
    with LLM(folder, device="cpu", dtype="float32", block_size=BS, cp=2, cp_algo=algo) as llm:
        assert llm.generate([first], GREEDY)[0].token_ids == answer
        before = llm.engine.num_computed_tokens
        out = llm.generate([second], GREEDY)[0]
        computed = llm.engine.num_computed_tokens - before
    assert out.token_ids == expected
    # The cached turn (all full blocks of the first prompt and answer) is not recomputed.
    assert out.num_cached_tokens >= (len(first) + len(answer) - 1) // BS * BS
    assert computed == len(second) - out.num_cached_tokens + len(expected) - 1


def causal_rows(qs, ks, vs, q_positions, scale):
    """Full causal attention over each whole sequence, at the rows of q_positions: [T, NH, D]."""
    want = []
    for x, kk, vv, p in zip(qs, ks, vs, q_positions):
        n = len(x)
        full = VarlenBatch(torch.tensor([0, n]), torch.tensor([0, n]), n, n, torch.arange(n), torch.arange(n))
        want.append(attention_with_lse(x, kk, vv, full, scale)[0][p])
    return torch.cat(want)


def _ring_rank(rank, world_size, algo, max_partial_bytes):
    """One rank's ring attention for two sequences (a whole prompt; 30 new tokens after 22
    cached ones) against full causal attention over every position."""
    import torch.distributed as dist

    block, cp, heads, kv_heads, dim = 4, world_size, 4, 2, 8
    starts, totals = [0, 22], [70, 52]
    step, _, key_positions = ring_step(starts, totals, block, cp)
    qs, ks, vs, q_positions, q, k, v = ring_inputs(step, key_positions, totals, rank, heads, kv_heads, dim)
    ring = RingAttention(dist.group.WORLD, step, algo, dim**-0.5, "cpu")
    ring.max_partial_bytes = max_partial_bytes
    got, _ = ring(q, k, v)
    want = causal_rows(qs, ks, vs, q_positions, dim**-0.5)
    return (got - want).abs().max().item(), step.num_queries(rank)


@pytest.mark.parametrize(
    "algo,max_partial_bytes", [("pass_kv", 512 << 20), ("pass_kv", 0), ("pass_q", 512 << 20)]
)
def test_ring_equals_full_attention(algo, max_partial_bytes):
    """The ring itself (pass-KV merging at the end or as it goes, pass-Q) on 4 gloo ranks."""
    results = run_local_world(_ring_rank, 4, algo, max_partial_bytes, timeout_s=60)
    assert all(err < 1e-5 for err, _ in results), results
    assert sum(n for _, n in results) == 70 + 30 and all(n > 0 for _, n in results)


def _decode_in_place_rank(rank, world_size):
    """One rank's pass-Q decode step (one new token for each of four sequences, the first of
    them held by a single rank) reading its keys in place from a paged cache with scattered blocks,
    against full attention and against the gathered keys."""
    import torch.distributed as dist

    block, heads, kv_heads, dim = 4, 4, 2, 8
    starts, totals = [2, 21, 40, 9], [3, 22, 41, 10]
    step, _, key_positions = ring_step(starts, totals, block, world_size)
    qs, ks, vs, q_positions, q, k, v = ring_inputs(step, key_positions, totals, rank, heads, kv_heads, dim)
    # This rank's cache: each sequence's keys here in blocks taken at random, the rest noise.
    g = torch.Generator().manual_seed(rank)
    held = [len(p[rank]) for p in key_positions]
    num_blocks = sum(-(-n // block) for n in held) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(held), num_blocks, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(num_blocks * block, kv_heads, dim, generator=g) for _ in range(2))
    slots = []
    for s, n in enumerate(held):
        for i in range(-(-n // block)):
            table[s, i] = free.pop()
        slots += [int(table[s, i // block]) * block + i % block for i in range(n)]
    k_cache[slots], v_cache[slots] = k, v
    paged = PagedKeys([0, 1, 2, 3], block, lambda batch, keys: 2)
    ring = RingAttention(dist.group.WORLD, step, "pass_q", dim**-0.5, "cpu", paged)
    assert ring.reads_in_place(FULL_ATTENTION) and not ring.reads_in_place(AttentionWindow(sliding=8))
    assert not RingAttention(dist.group.WORLD, step, "pass_kv", dim**-0.5, "cpu", paged).reads_in_place(
        FULL_ATTENTION
    )
    got, lse = ring.attend_in_place(q, k_cache, v_cache, table)
    gathered, gathered_lse = ring(q, k, v)
    want = causal_rows(qs, ks, vs, q_positions, dim**-0.5)

    def error(a, b):
        return (a - b).abs().max().item() if a.numel() else 0.0

    return [error(got, want), error(lse, gathered_lse), error(got, gathered)], held, len(q)


def check_decode_in_place():
    results = run_local_world(_decode_in_place_rank, 2, timeout_s=60)
    assert all(max(errors) < 1e-5 for errors, _, _ in results), results
    held = [h for _, h, _ in results]  # [rank][sequence] keys held
    assert [sum(h[s] for h in held) for s in range(4)] == [3, 22, 41, 10]
    # The short one lies on one rank, whose other queries visit the other rank without it.
    assert sum(h[0] == 0 for h in held) == 1
    assert sorted(n for *_, n in results) == [1, 3]


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_pass_q_decode_reads_the_paged_cache_in_place(kernel):
    """The gathered reference of paged attention (what a CPU runs), and the Triton kernel
    under its CPU interpreter (what a GPU runs; two splits a query)."""
    if kernel == "reference":
        return check_decode_in_place()
    pytest.importorskip("triton")
    script = (
        "import sys\nsys.path.insert(0, 'tests')\nimport test_cp\n"
        "test_cp.check_decode_in_place()\nprint('ok')"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_pass_q_decode_gathers_no_keys(tiny_model_dir, monkeypatch):
    """Under cp=2 pass-Q a decode step of a full-attention model builds no index of the
    keys a rank holds (so it copies none out of the cache); its prefill does."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(
        tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=BS, cp=2, cp_algo="pass_q"
    ) as llm:
        tables = llm.engine.executor.worker.runner.block_tables
        indexed = []
        key_slots = tables.key_slots
        monkeypatch.setattr(tables, "key_slots", lambda *a: indexed.append(sum(a[1])) or key_slots(*a))
        llm.engine.add_request(LONG[:30], params)
        llm.engine.step()  # the prompt (every query is new: it gathers) and its first token
        assert len(indexed) == 1
        llm.engine.step()
        llm.engine.step()
        assert len(indexed) == 1 and not llm.engine.has_unfinished()


def test_one_token_blocks_place_every_decode_token_round_robin(tiny_model_dir, reference):
    """block_size=1: each new token's KV goes to the next rank, offset per sequence; the
    tokens still equal the single-rank run."""
    _, ref_batch, _ = reference("llama")
    with LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=1, cp=3, timeout_s=60) as llm:
        engine = llm.engine
        seqs = [engine.seqs[engine.add_request(p, GREEDY)] for p in VARSEQ]
        tables = [[] for _ in seqs]  # each sequence's longest block table (freed when it ends)
        while engine.has_unfinished():
            engine.step()
            for table, seq in zip(tables, seqs):
                if len(seq.block_table) > len(table):
                    table[:] = seq.block_table
        ranks = [[engine.block_manager.layout.rank_of(b) for b in table] for table in tables]
    assert [seq.output_token_ids for seq in seqs] == ref_batch
    for seq_ranks, prompt in zip(ranks, VARSEQ):
        decoded = seq_ranks[len(prompt) :]
        assert len(decoded) >= 16
        assert all((b - a) % 3 == 1 for a, b in zip(decoded, decoded[1:])), decoded
    assert len({r[len(p)] for r, p in zip(ranks, VARSEQ)}) > 1  # sequences start on different ranks


def test_each_rank_holds_its_share_of_the_kv(tiny_model_dir):
    prompt = prompts_of_lengths([400], seed=3)[0]
    with LLM(
        tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=BS, cp=4, cp_algo="pass_kv"
    ) as llm:
        engine = llm.engine
        seq_id = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        seq = engine.seqs[seq_id]
        for _ in range(20):
            engine.step()
        blocks = list(seq.block_table)  # 400 prompt + 19 decoded tokens' KV (+ the next one's)
        per_rank = [sum(1 for b in blocks if engine.block_manager.layout.rank_of(b) == r) for r in range(4)]
        # Each rank's cache tensors are a quarter of what one rank would need.
        kv_bytes = engine.executor.worker.kv_cache.nbytes
        while engine.has_unfinished():
            engine.step()
    with LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=BS) as llm:
        single_kv_bytes = llm.engine.executor.worker.kv_cache.nbytes
    assert len(blocks) == -(-(400 + 20) // BS)
    for count in per_rank:  # each rank holds about a quarter of the sequence's KV
        assert abs(count - len(blocks) / 4) <= 3, per_rank
    assert kv_bytes <= single_kv_bytes / 4 * 1.01


def test_prefill_placement_is_load_balanced():
    # 2N chunks, rank i taking chunks i and 2N-1-i: equal causal work on every rank.
    assert place_blocks(0, 0, 8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    ranks = place_blocks(0, 0, 100, 4)
    assert [ranks.count(r) for r in range(4)] == [25, 25, 25, 25]  # chunks of 12 (early) and 13 (late)
    assert ranks == sorted(ranks[:50]) + sorted(ranks[50:], reverse=True)  # zigzag: 0 1 2 3 3 2 1 0
    ranks = place_blocks(0, 0, 103, 4)
    assert [ranks.count(r) for r in range(4)] == [26, 26, 26, 25]
    # decode blocks: round robin, offset by sequence
    assert place_blocks(1, 10, 1, 4) == [3] and place_blocks(2, 10, 1, 4) == [0]


def test_auto_rule_crossover_with_the_papers_figures():
    """800 TFLOP/s, 50 GB/s, CP4, 128K context, 128 query / 8 KV heads, bf16."""
    paper = CPCalibration(attention_flops=800e12, link_bytes_per_s=50e9)
    context = 128 * 1024

    def algo(fraction):
        new = int(context * fraction)
        return choose_cp_algo(new, context - new, 4, 128, 8, 2, paper)

    assert algo(0.005) == "pass_q" and algo(0.01) == "pass_q" and algo(0.02) == "pass_q"
    assert algo(0.05) == "pass_kv" and algo(0.5) == "pass_kv" and algo(1.0) == "pass_kv"
    # The crossover the rule predicts: T/(T+P) = 2*NKV/NH - 4*T*BW/(N*C*e), i.e.
    # x = 0.125 / (1 + 4 * 128K * BW / (N*C*e)) = 2.45% here, below the paper's ~5%.
    crossover = 0.125 / (1 + 4 * context * 50e9 / (4 * 800e12 * 2))
    assert algo(crossover * 0.98) == "pass_q" and algo(crossover * 1.02) == "pass_kv"
    # A full prefill (no cache) is always pass-KV; decode (one new token) pass-Q.
    assert choose_cp_algo(1000, 0, 4, 128, 8, 2, paper) == "pass_kv"
    assert choose_cp_algo(1, context, 4, 128, 8, 2, paper) == "pass_q"


def test_calibration_command_feeds_auto(tmp_path, monkeypatch, capsys):
    from ringserve.cli.main import main

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    assert main(["bench", "cp-calibrate", "--device", "cpu"]) == 0
    assert "ring hop" in capsys.readouterr().out
    measured = CPCalibration.load("cpu")
    assert measured.attention_flops > 1e6 and measured.link_bytes_per_s > 1e6
    assert measured != CPCalibration.load("no-such-device")


def test_cli_generate_with_context_parallelism(capsys):
    from ringserve.cli.main import main

    # The built-in model over two CP ranks: the same answer as on one.
    assert (
        main(
            [
                "generate",
                "What is the capital of France?",
                "--cp",
                "2",
                "--device",
                "cpu",
                "--max-tokens",
                "16",
                "--block-size",
                "4",
            ]
        )
        == 0
    )
    assert "Paris" in capsys.readouterr().out


def test_auto_uses_pass_kv_for_prefill_and_pass_q_for_decode(tiny_model_dir, reference, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("RINGSERVE_CACHE", "/nonexistent")  # the built-in defaults, not a stored calibration
    ref_long = reference("llama")[0]
    with caplog.at_level(logging.DEBUG, logger="ringserve.parallel.cp.policy"):
        with LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=BS, cp=2) as llm:
            assert llm.generate([LONG], GREEDY)[0].token_ids == ref_long
    decisions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cp step")]
    assert decisions[0] == "cp step: 101 new, 0 cached tokens over 2 ranks -> pass_kv"
    assert decisions[1] == "cp step: 1 new, 101 cached tokens over 2 ranks -> pass_q"


@pytest.mark.parametrize("algo", ["pass_kv", "pass_q"])
def test_chunked_prefill_and_preemption_under_cp(algo, tiny_model_dir, reference):
    """Prompts prefilled 18 tokens a step (chunks end inside blocks), and so few blocks
    per rank that sequences are preempted and recomputed: the same tokens."""
    ref_long, ref_batch, _ = reference("llama")
    with LLM(
        tiny_model_dir("llama"),
        device="cpu",
        dtype="float32",
        block_size=BS,
        cp=2,
        cp_algo=algo,
        max_num_batched_tokens=18,
        max_prefill_tokens=18,
        num_blocks=20,
        max_model_len=160,
    ) as llm:
        assert llm.generate([LONG], GREEDY)[0].token_ids == ref_long
        assert [o.token_ids for o in llm.generate(VARSEQ, GREEDY)] == ref_batch
        assert llm.engine.num_preemptions > 0
        assert set(llm.engine.cp_steps) == {algo}  # the forced ring ran every step, prefill too


def test_decode_step_host_work_does_not_grow_with_the_cached_context(tiny_model_dir):
    """Under cp=2 a decode step's host-built elements (the driver's message, rank 0's ring
    metadata and index tensors) are the same after 6 cached tokens as after 302."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=BS, cp=2) as llm:
        engine = llm.engine
        runner = engine.executor.worker.runner
        counts = []
        for length in (6, 302):  # the same place in a block: neither decode step opens one
            for prompt in prompts_of_lengths([length, length + 3], seed=length):
                engine.add_request(prompt, params)
            engine.step()  # both prompts, and their first tokens
            before = runner.host_elements
            assert len(engine.step()) == 2  # one decode step: both second tokens
            counts.append(runner.host_elements - before)
            assert not engine.has_unfinished()
    assert counts[0] == counts[1], counts


def test_prefix_hits_and_preemption_place_decode_over_ranks(tiny_model_dir):
    """Prompts that share a cached prefix spread over 3 ranks (new rows start with blocks
    on every rank), so few blocks that sequences are preempted and placed afresh, and long
    decodes crossing many 2-token blocks: the same tokens as one rank."""
    shared = prompts_of_lengths([23], seed=5)[0]
    prompts = [shared + tail for tail in ([1, 2], [3], [4, 5, 6], [7, 8, 9, 10])]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", block_size=2, timeout_s=60)
    with LLM(tiny_model_dir("llama"), **common) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(
        tiny_model_dir("llama"), cp=3, cp_algo="pass_q", num_blocks=16, max_model_len=64, **common
    ) as llm:
        outs = llm.generate([prompts[0]], params) + llm.generate(prompts[1:], params)
        assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 22 for o in outs[1:])
