"""Paged attention that reads the KV cache in place: the Triton kernel (run on the CPU by
Triton's interpreter) against the reference path that gathers each context, and the
engine's decode-graph padding and step preparation on the CPU."""

import os
import subprocess
import sys

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.attention import paged as pa
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.engine.sequence import Sequence
from ringserve.worker.graphs import DecodeGraphs, decode_buckets
from ringserve.worker.step_input import StepInput

KERNEL_SCRIPT = r"""
import torch
from ringserve.attention import paged as pa
from ringserve.attention.dense import VarlenBatch, _math_varlen
from ringserve.config import AttentionWindow
from ringserve.kernels.kv_quant import quantize_kv

def case(q_lens, seq_lens, nh, nkv, d, splits, bs=4, seed=0, window=AttentionWindow(), one_block=False, fp8=False):
    # fp8: the cache stored as float8 e4m3 with a scale per KV head (kernels/kv_quant.py),
    # read by the kernel and checked against float32 math on the dequantised cache.
    dtype = torch.float32
    tol = 1e-4 if fp8 else 1e-5  # fp8: values to 10, the scales folded in another order
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    k_cache = torch.randn(num_blocks * bs, nkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, nkv, d, generator=g).to(dtype)
    # The last block holds NaN: the table entries of blocks no query of a sequence can see
    # (before its window) point there, so reading any of them would show in the output.
    poison = num_blocks - 1
    k_cache[poison * bs :] = float("nan")
    v_cache[poison * bs :] = float("nan")
    tables = torch.zeros(len(q_lens) + 2, 64, dtype=torch.int32)
    perm, used = torch.randperm(num_blocks - 1, generator=g), 0  # never the poison block
    rows = [len(q_lens) - i for i in range(len(q_lens))]  # rows out of batch order
    for row, n in zip(rows, seq_lens):
        nb = -(-n // bs)
        tables[row, :nb] = perm[used : used + nb].int()
        used += nb
    q = torch.randn(sum(q_lens), nh, d, generator=g).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    decode = all(n == 1 for n in q_lens)
    qpt = pa.tile_queries(nh, nkv, decode)
    tile_seq = [i for i, n in enumerate(q_lens) for _ in range(0, n, qpt)]
    tile_q0 = [q0 for n in q_lens for q0 in range(0, n, qpt)]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    batch = pa.PagedBatch(i32(rows), i32(cu), i32(seq_lens), i32(tile_seq), i32(tile_q0), qpt, splits,
                          cu, list(seq_lens), rows, one_block=one_block)
    assert not one_block or pa.fits_one_block(max(seq_lens), splits)
    visible_tables = tables.clone()
    for row, n, ql in zip(rows, seq_lens, q_lens):
        tables[row, : window.first_visible(n - ql) // bs] = poison
    scales = None
    if fp8:  # heads of different ranges, each with its own scale
        scales = (torch.rand(nkv, generator=g) * 0.1 + 0.001, torch.rand(nkv, generator=g) * 0.1 + 0.001)
        head_range = torch.logspace(-1, 1, nkv)[:, None]
        k_cache = quantize_kv(k_cache * head_range, scales[0])
        v_cache = quantize_kv(v_cache * head_range, scales[1])
    out, lse = pa.paged_attention(q, k_cache, v_cache, tables, batch, bs, d**-0.5, window, kv_scales=scales)
    ref_out, ref_lse = pa.paged_attention_reference(
        q, k_cache, v_cache, tables, batch, bs, d**-0.5, window, kv_scales=scales
    )
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    if fp8:  # the reference's math on the cache dequantised by hand
        k_cache = k_cache.float() * scales[0][:, None]
        v_cache = v_cache.float() * scales[1][:, None]
    tables = visible_tables
    # Reference: each context gathered by hand from the block table, explicit float32 math.
    slots, k_pos, q_pos, cu_k = [], [], [], [0]
    for row, n, ql in zip(rows, seq_lens, q_lens):
        pages = tables[row, : -(-n // bs)].long()
        slots.append((pages[:, None] * bs + torch.arange(bs)).flatten()[:n])
        k_pos.append(torch.arange(n)); q_pos.append(torch.arange(n - ql, n)); cu_k.append(cu_k[-1] + n)
    slots = torch.cat(slots)
    ref = VarlenBatch(i32(cu), i32(cu_k), max(q_lens), max(seq_lens), torch.cat(q_pos), torch.cat(k_pos),
                      True, cu, cu_k)
    ref_out, ref_lse = _math_varlen(q, k_cache[slots], v_cache[slots], ref, d**-0.5, window)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)

# decode over contexts crossing block and split boundaries, split-KV on and off
case([1, 1, 1, 1], [1, 5, 64, 131], nh=4, nkv=2, d=16, splits=1)
case([1, 1, 1, 1], [1, 5, 64, 131], nh=4, nkv=2, d=16, splits=8)  # splits with no key
case([1, 1], [200, 3], nh=8, nkv=1, d=32, splits=4)  # one KV head for 8 query heads
# chunks after a cached prefix, a fresh prompt and decode rows in one batch
case([7, 1, 20, 1], [30, 9, 20, 2], nh=4, nkv=2, d=16, splits=1)
case([70], [150], nh=6, nkv=2, d=24, splits=1)  # several tiles; head_dim not a power of two
case([1, 5], [70, 40], nh=4, nkv=4, d=16, splits=2)
# local attention: the KV loop starts at the first block the tile's first query sees
sliding = AttentionWindow(sliding=9)
case([1, 1, 1], [5, 64, 131], nh=4, nkv=2, d=16, splits=1, window=sliding)
case([1, 1, 1], [5, 64, 131], nh=4, nkv=2, d=16, splits=4, window=sliding)  # splits of the window
case([7, 1, 20, 70], [30, 9, 20, 150], nh=4, nkv=2, d=16, splits=1, window=sliding)
chunked = AttentionWindow(chunk=16)
case([1, 1, 1], [5, 64, 131], nh=4, nkv=2, d=16, splits=2, window=chunked)
case([7, 1, 20, 70], [30, 9, 20, 150], nh=4, nkv=2, d=16, splits=1, window=chunked)
# one loop step per split (PagedBatch.one_block): the cached keys read apart from this step's
case([1, 1, 1, 1], [1, 5, 64, 131], nh=4, nkv=2, d=16, splits=4, one_block=True)
case([1, 1], [128, 3], nh=8, nkv=1, d=32, splits=2, one_block=True)  # a full step each
case([1, 1, 1], [5, 64, 131], nh=4, nkv=2, d=16, splits=8, window=sliding, one_block=True)
case([1, 1, 1], [5, 64, 131], nh=4, nkv=2, d=16, splits=4, window=chunked, one_block=True)
# an FP8 cache: decode with splits, chunks beside decode rows, a window, one loop step per split
case([1, 1, 1, 1], [1, 5, 64, 131], nh=4, nkv=2, d=16, splits=8, fp8=True)
case([7, 1, 20, 1], [30, 9, 20, 2], nh=4, nkv=2, d=16, splits=1, fp8=True)
case([7, 1, 20, 70], [30, 9, 20, 150], nh=4, nkv=2, d=16, splits=1, window=sliding, fp8=True)
case([1, 1, 1], [5, 64, 131], nh=4, nkv=4, d=16, splits=4, one_block=True, fp8=True)
# (bfloat16 is checked on the GPU, bench/gpu_checks.py: the interpreter mangles bf16 stores.)
print("ok")
"""


def test_paged_kernel_reads_the_cache_in_place_like_the_gathered_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


ENGINE_SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import torch
from ringserve.model.tiny_models import hf_model, save_tiny_model
from ringserve.engine.logits_probe import engine_logits
from ringserve.engine.engine import LLMEngine
from ringserve.config import EngineConfig
import tempfile

for arch in ("llama", "qwen3_moe"):
    folder = save_tiny_model(arch, tempfile.mkdtemp())
    engine = LLMEngine(folder, device="cpu", dtype="float32", engine_config=EngineConfig(block_size=4))
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    # 9 prompt tokens, then a chunk of 5 after them, then decode across block boundaries.
    ours = engine_logits(engine, tokens, prefill=9, chunks=[5])
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_engine_through_the_paged_kernel_matches_transformers():
    """The Triton kernel (interpreted) inside the engine: a chunk after a cached prefix and
    decode steps across block boundaries, logits against transformers."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT], env=env, capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def _decode_step(engine, seqs):
    """A decode StepInput for sequences already prefilled through the engine."""
    for seq in seqs:
        assert engine.block_manager.allocate(seq, 1)
    return StepInput.from_batch(ScheduledBatch(seqs, [1] * len(seqs)))


@pytest.fixture
def llama_engine(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=4, max_num_seqs=8) as llm:
        yield llm.engine


def _prefill(engine, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams())
        engine.scheduler.take_row(seq)
        assert engine.block_manager.allocate(seq, n)
        engine.executor.execute(StepInput.from_batch(ScheduledBatch([seq], [n])))
        seq.num_computed_tokens = n
        seq.output_token_ids.append(int(torch.randint(0, 256, (1,), generator=g)))
        seqs.append(seq)
    return seqs


def test_buckets():
    assert decode_buckets(256) == [1, 2, 4, 8] + list(range(16, 256, 16)) + [256]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]


def test_padded_decode_rows_write_nothing_and_leave_real_rows_unchanged(llama_engine):
    """The decode-graph path (static buffers, a bucket of 8 for 3 sequences) run eagerly on
    the CPU: logits equal the unpadded step's, and the cache changes only in the real
    rows' new slots (padded rows write the scratch block alone)."""
    engine = llama_engine
    runner = engine.executor.worker.runner
    cache = runner.kv_cache
    cache.k.zero_()  # the cache is allocated uninitialised: NaN would never compare equal
    cache.v.zero_()
    seqs = _prefill(engine, [5, 11, 8])
    step = _decode_step(engine, seqs)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    expected = runner.forward(step)  # eager, 3 rows
    k_eager = cache.k.clone()
    cache.k.copy_(k_before)
    cache.v.copy_(v_before)
    runner.graphs = DecodeGraphs(runner, max_batch=8, capture=False)
    try:
        got = runner.forward(step)
    finally:
        runner.graphs = None
    assert got.shape == expected.shape == (3, 256)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    bs = cache.block_size
    new_slots = [
        seq.block_table[seq.num_computed_tokens // bs] * bs + seq.num_computed_tokens % bs for seq in seqs
    ]
    changed = (cache.k != k_before).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
    scratch = range(cache.pad_block * bs, (cache.pad_block + 1) * bs)
    assert sorted(s for s in changed if s not in scratch) == sorted(new_slots)
    assert any(s in scratch for s in changed)  # the 5 padded rows wrote there
    torch.testing.assert_close(cache.k[:, : cache.pad_block * bs], k_eager[:, : cache.pad_block * bs])


def test_start_up_warm_up_runs_prefill_tiles_and_writes_only_the_scratch_block(llama_engine, monkeypatch):
    """The start-up step that builds the paged kernel's prefill tiles (a chunk after a cached
    prefix) reaches that kernel with prefill tiles, and changes no slot outside the
    scratch block."""
    import ringserve.worker.forward_context as fc

    engine = llama_engine
    runner = engine.executor.worker.runner
    cache = runner.kv_cache
    cache.k.zero_()
    cache.v.zero_()
    _prefill(engine, [9])
    k_before, v_before = cache.k.clone(), cache.v.clone()
    tiles = []
    real_kernel = fc.paged_attention

    def spy(q, k_cache, v_cache, block_tables, batch, *args, **kwargs):
        tiles.append(batch.queries_per_tile)
        return real_kernel(q, k_cache, v_cache, block_tables, batch, *args, **kwargs)

    monkeypatch.setattr(fc, "paged_attention", spy)
    runner.warm_up_cached_prefill()
    assert tiles and all(t > 1 for t in tiles)  # prefill tiles, in every layer
    scratch = slice(cache.pad_block * cache.block_size, (cache.pad_block + 1) * cache.block_size)
    assert (cache.k[:, scratch] != 0).any()  # it wrote there
    cache.k[:, scratch] = 0
    cache.v[:, scratch] = 0
    torch.testing.assert_close(cache.k, k_before, rtol=0, atol=0)
    torch.testing.assert_close(cache.v, v_before, rtol=0, atol=0)


def test_step_preparation_does_not_grow_with_cached_context(llama_engine):
    """Host work of a decode step is per sequence and new token: the elements built on the
    host are the same after 6 cached tokens as after 300."""
    engine = llama_engine
    runner = engine.executor.worker.runner
    counts = []
    for length in (6, 302):  # the step needs no new block in either case
        seqs = _prefill(engine, [length, length + 3], seed=length)
        step = _decode_step(engine, seqs)
        before = runner.host_elements
        runner.forward(step)
        counts.append(runner.host_elements - before)
        for seq in seqs:
            engine.scheduler.finish(seq)
    assert counts[0] == counts[1], counts


def test_short_context_graph_is_chosen_only_where_every_split_is_one_step(llama_engine):
    """A bucket with split-KV runs its short-context graph (PagedBatch.one_block) while the
    longest sequence fits one loop step per split, and the general graph beyond; a bucket
    without splits has only the general one. (The CPU sizes no splits: set here as a GPU
    engine would.)"""
    graphs = DecodeGraphs(llama_engine.executor.worker.runner, max_batch=8, capture=False)
    graphs.splits.update({1: 4, 2: 1})
    step_keys = pa.LAUNCH["block_n"]
    assert graphs.graph_key(1, 4 * step_keys) == (1, True)
    assert graphs.graph_key(1, 4 * step_keys + 1) == (1, False)
    assert graphs.graph_key(2, 5) == (2, False)
    assert graphs.graph_key(3, 5)[0] == 4


def test_decode_graph_is_chosen_by_the_keys_after_the_step(llama_engine):
    """A decode step's graph is chosen by its longest sequence's keys once the step's token
    is in the cache (start + 1): a sequence whose new token fills the last key of the
    short-context graph still runs it, one past that runs the general graph."""
    from types import SimpleNamespace

    graphs = DecodeGraphs(llama_engine.executor.worker.runner, max_batch=8, capture=False)
    graphs.splits.update({1: 4, 2: 4})
    limit = 4 * pa.LAUNCH["block_n"]  # the most keys the short-context graph reads
    chosen = []

    def forward(b, one_block):
        chosen.append((b, one_block))
        return graphs.logits[:b]

    graphs._forward = forward
    for starts in ([limit - 1], [limit], [limit - 1, 5], [5, limit]):
        step = SimpleNamespace(
            rows=list(range(len(starts))), token_ids=[[1]] * len(starts), starts=starts, pending=[], drafts=[]
        )
        graphs.run(step)
    assert chosen == [(1, True), (1, False), (2, True), (2, False)]
