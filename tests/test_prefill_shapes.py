"""Prefill attention with no per-shape cost (issue 26): cuDNN, which builds a plan per shape,
is shown only shapes of a bounded set (attention.bounded_shape_block), and long chunks after a
cached prefix gather their keys for it. On a CPU the engine runs PyTorch's CPU flash kernel
instead, so these tests drive the same padding, key pieces and gathering with CPU kernels in
cuDNN's place, against PyTorch's SDPA and against transformers."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ringserve.attention import dense as attention
from ringserve.attention.dense import bounded_lengths, bounded_shape_block, key_pieces, length_above
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.dp_scheduler import DataParallelScheduler
from ringserve.engine.logits_probe import engine_logits
from ringserve.engine.scheduler import Scheduler
from ringserve.engine.sequence import Sequence
from ringserve.llm import LLM
from ringserve.model.tiny_models import hf_model
from ringserve.sampling_params import SamplingParams
from ringserve.worker.runner import ModelRunner

NH, NKV, D = 4, 2, 16


class Recorder:
    """A kernel that records the (Lq, Lk, causal) shapes it is shown; run: what computes."""

    def __init__(self, run):
        self.run = run
        self.shapes = set()

    def __call__(self, q, k, v, causal, scale):
        self.shapes.add((q.shape[0], k.shape[0], causal))
        return self.run(q, k, v, causal, scale)


def zeros_kernel(q, k, v, causal, scale):
    return torch.zeros_like(q), torch.zeros(q.shape[:2])


def sdpa_reference(q, k, v, causal: bool, scale: float):
    """(out, lse) from PyTorch's SDPA (math backend, float64) and the scores' logsumexp."""
    qs, ks, vs = (x.double().transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True)
    ks = ks.repeat_interleave(NH // NKV, dim=1)
    scores = (qs @ ks.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return out[0].transpose(0, 1), torch.logsumexp(scores, -1)[0].transpose(0, 1)


@pytest.mark.parametrize(
    "lq, lk, causal",
    [(2048, 2048, True), (2049, 2049, True), (3001, 3001, True), (2100, 2048, False),
     (2500, 7001, False), (2047, 9000, False), (3000, 2047, False), (5, 6200, False)],
)  # fmt: skip
def test_bounded_shape_block_matches_sdpa(lq, lk, causal):
    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = (
        torch.randn(lq, NH, D, generator=g),
        torch.randn(lk, NKV, D, generator=g),
        torch.randn(lk, NKV, D, generator=g),
    )
    fixed = Recorder(attention._cpu_flash_block)
    out, lse = bounded_shape_block(q, k, v, causal, 0.3, fixed, attention._cpu_flash_block)
    ref_out, ref_lse = sdpa_reference(q, k, v, causal, 0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    for shape_q, shape_k, shape_causal in fixed.shapes:  # only shapes of the bounded set
        assert shape_q == length_above(shape_q) and shape_q >= lq
        assert shape_k == shape_q if shape_causal else shape_k in key_pieces(lk)


def test_cudnn_meets_a_bounded_set_of_shapes_whatever_the_lengths():
    """Fresh prompts of 400 distinct lengths and chunks after 400 distinct prefixes: the
    fixed-shape kernel (cuDNN's place) sees a few dozen shapes, padded by at most 1/16."""
    fixed = Recorder(zeros_kernel)
    rng = random.Random(0)
    lengths = rng.sample(range(2048, 65536), 400)
    for n in lengths:
        q, kv = torch.empty(n, 1, 1), torch.empty(n, 1, 1)
        bounded_shape_block(q, kv, kv, True, 1.0, fixed, zeros_kernel)
    causal = {s for s in fixed.shapes if s[2]}
    assert len(causal) <= len(bounded_lengths(2048, 65536)) <= 16 * 5 + 1
    assert all(n <= length_above(n) <= n * 17 / 16 for n in lengths)
    for chunk in (2048, 3000):
        for prefix in rng.sample(range(1, 130_000), 400):
            q, kv = torch.empty(chunk, 1, 1), torch.empty(prefix, 1, 1)
            bounded_shape_block(q, kv, kv, False, 1.0, fixed, zeros_kernel)
    unmasked = {s for s in fixed.shapes if not s[2]}
    # Each chunk length against the powers of two from 2K to 64K: 2 x 6 shapes.
    assert unmasked == {(length_above(c), 1 << b, False) for c in (2048, 3000) for b in range(11, 17)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_prefill_through_bounded_shapes_and_gathered_chunks_matches_transformers(
    arch, tiny_model_dir, monkeypatch
):
    """The engine with cuDNN's shape rules on the CPU (from 8 tokens on; the CPU flash kernel
    in cuDNN's place, recording its shapes) and long chunks gathering their keys: prompts of
    many distinct lengths (padded from 32 on), whole, chunked and after a cached prefix,
    give transformers' logits. Gemma 3's sliding layers take the gathered path with their windows."""
    monkeypatch.setattr(attention, "CUDNN_MIN_LEN", 8)
    fixed = Recorder(attention._cpu_flash_block)
    gathered_steps = []

    def bounded_dense_block(q, k, v, causal, scale):
        return bounded_shape_block(q, k, v, causal, scale, fixed, attention._cpu_flash_block)

    def gathers(self, q_lens, seq_lens):
        gathered_steps.append(min(q_lens) >= 8)
        return gathered_steps[-1]

    monkeypatch.setattr(attention, "dense_block", bounded_dense_block)
    monkeypatch.setattr(ModelRunner, "gathers_long_chunks", gathers)
    folder = tiny_model_dir(arch)
    model = hf_model(folder)
    g = torch.Generator().manual_seed(3)
    with LLM(folder, device="cpu", dtype="float32", block_size=4) as llm:
        for total, prefill, chunks in [
            (13, 13, []),
            (45, 45, []),
            (60, 33, [19]),
            (75, 41, [9, 13]),
            (70, 8, [35]),
            (100, 19, [67]),
        ]:
            tokens = torch.randint(0, 256, (total,), generator=g).tolist()
            ours = engine_logits(llm.engine, tokens, prefill=prefill, chunks=chunks)
            with torch.no_grad():
                ref = model(torch.tensor([tokens])).logits[0]
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert any(gathered_steps) and not all(gathered_steps)
    assert any(causal for *_, causal in fixed.shapes) and any(not causal for *_, causal in fixed.shapes)
    assert all(q == length_above(q) for q, _, _ in fixed.shapes)


def _binder(kernel):
    """Triton's own binder of a @triton.jit kernel: (args, kwargs) -> (bound, specialization,
    options), where specialization is what its compiled variants are keyed on. Runs on the CPU."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import BaseBackend

    return triton_jit.create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


@pytest.mark.parametrize("name", ["_store_kv_kernel", "_rotary_kernel"])
def test_kv_store_kernels_do_not_specialise_on_the_slots_row(name):
    """slots [G, T] int64: group 1's row starts 16-byte aligned only for even T; the kernels
    that write the cache must key one variant on both (the step's token count varies)."""
    pytest.importorskip("triton")
    from ringserve.kernels import elementwise as kernels

    kernel = getattr(kernels, name)
    binder = _binder(kernel)
    aligned = torch.zeros(64, dtype=torch.int64)

    def specialization(slots):
        args = {
            p: (1 if kernel.params[i].is_constexpr else aligned)
            for i, p in enumerate(kernel.signature.parameters)
        }
        return binder(**{**args, "slots_ptr": slots})[1]

    odd, even = torch.zeros(2, 7, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64)
    assert odd[1].data_ptr() % 16 != 0 and even[1].data_ptr() % 16 == 0
    assert specialization(odd[1]) == specialization(even[1])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_paged_kernel_compiles_one_variant_whatever_the_batch(arch, tiny_model_dir, monkeypatch):
    """Triton compiles a kernel per specialisation of its arguments (values of 1, 16-byte
    alignment of ints and pointers), about a second each on a GPU. Steps of chunks after
    cached prefixes and decode rows, with many batch sizes and lengths, must show the paged
    kernel one specialisation per tile shape (its constexprs), or requests pay compiles.
    Each launch's specialisation is computed by Triton's own binder, here on the CPU; the
    attention itself comes from the reference path."""
    import ringserve.worker.forward_context as fc
    from ringserve.attention import paged as pa

    kernel = pa._paged_kernel
    binder = _binder(kernel)
    variants: dict[tuple, set] = {}

    class Launch:
        def __getitem__(self, grid):
            def record(*args, **kwargs):
                _, specialization, _ = binder(*args, **kwargs)
                constexprs = tuple(str(s) for s in specialization if s[0] == "constexpr")
                variants.setdefault(constexprs, set()).add(tuple(str(s) for s in specialization))

            return record

    def spy(
        q,
        k_cache,
        v_cache,
        block_tables,
        batch,
        block_size,
        scale,
        window=pa.FULL_ATTENTION,
        pdl=True,
        kv_scales=None,
    ):
        pa._paged_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            batch,
            block_size,
            scale,
            window=window,
            pdl=pdl,
            kv_scales=kv_scales,
        )
        return pa.paged_attention_reference(
            q, k_cache, v_cache, block_tables, batch, block_size, scale, window, kv_scales
        )

    monkeypatch.setattr(pa, "_paged_kernel", Launch())
    monkeypatch.setattr(fc, "paged_attention", spy)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (12,), generator=g).tolist()
    with LLM(tiny_model_dir(arch), device="cpu", dtype="float32", block_size=4, max_num_seqs=8) as llm:
        for wave in (1, 2, 3, 5, 7, 4, 6):
            prompts = [
                prefix + torch.randint(0, 256, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 40, (wave,), generator=g)
            ]
            llm.generate(prompts, SamplingParams(max_tokens=int(torch.randint(2, 6, (1,), generator=g))))
    assert len(variants) >= 2  # prefill tiles and decode tiles (and the windowed layers')
    names = list(kernel.signature.parameters)
    for keys in variants.values():
        differing = {names[i] for key in keys for i, part in enumerate(key) if part != next(iter(keys))[i]}
        assert len(keys) == 1, f"arguments specialised differently from launch to launch: {sorted(differing)}"


def _run(scheduler, batch):
    """What the engine does after a step: the computed tokens counted, and a token drawn by
    each sequence whose prompt (and outputs) are all computed."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)


def _scheduler(max_num_batched_tokens=8, max_prefill_tokens=32):
    return Scheduler(BlockManager(200, 4, False, 1, None), max_num_batched_tokens, 4, max_prefill_tokens)


def test_chunks_are_large_while_nothing_decodes_and_bounded_beside_decodes():
    scheduler = _scheduler()
    a = Sequence("a", list(range(70)), SamplingParams(max_tokens=9))
    scheduler.add(a)
    sizes = []
    while a.num_computed_tokens < 70:  # alone: chunks of max_prefill_tokens
        batch = scheduler.schedule()
        sizes.append(batch.num_tokens)
        _run(scheduler, batch)
    assert sizes == [[32], [32], [6]]
    b = Sequence("b", list(range(30)), SamplingParams(max_tokens=9))
    scheduler.add(b)
    sizes = []
    while b.num_computed_tokens < 30:  # beside a decoding sequence: max_num_batched_tokens a step
        batch = scheduler.schedule()
        sizes.append(batch.num_tokens)
        _run(scheduler, batch)
    assert sizes == [[1, 7], [1, 7], [1, 7], [1, 7], [1, 2]]


def test_data_parallel_replicas_keep_the_decode_budget_while_any_decodes():
    replicas = [_scheduler(), _scheduler()]
    dp = DataParallelScheduler(replicas)
    a = Sequence("a", list(range(5)), SamplingParams(max_tokens=9))
    replicas[0].add(a)
    _run(dp, dp.schedule())  # a's prompt: it decodes from now on
    b = Sequence("b", list(range(40)), SamplingParams(max_tokens=9))
    replicas[1].add(b)  # alone on its replica, but the replicas step together
    batch = dp.schedule()
    assert dict(zip((s.request_id for s in batch.seqs), batch.num_tokens)) == {"a": 1, "b": 8}


def test_prompt_logprob_rows_keep_to_the_decode_budget_in_a_large_step():
    """A large prefill step would hold a [rows, vocabulary] float32 matrix for every row that
    scores a prompt token: those rows keep to max_num_batched_tokens a step, other work not."""
    scheduler = _scheduler()  # 8 tokens a step beside decodes, 32 while none
    a, b = (Sequence(name, list(range(20)), SamplingParams(max_tokens=2, prompt_logprobs=1)) for name in "ab")
    c = Sequence("c", list(range(30)), SamplingParams(max_tokens=2))
    for seq in (a, c, b):
        scheduler.add(seq)
    batch = scheduler.schedule()
    # a's 8 scored rows spend the step's scoring budget, c takes the rest, b waits.
    assert dict(zip((s.request_id for s in batch.seqs), batch.num_tokens)) == {"a": 8, "c": 24}
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs += [None] * n
    batch = scheduler.schedule()
    assert dict(zip((s.request_id for s in batch.seqs), batch.num_tokens)) == {"a": 8, "c": 6}


def test_a_large_chunk_shrinks_before_it_preempts():
    """Out of blocks for its large chunk, a prefilling sequence first takes one of
    max_num_batched_tokens, and nobody is preempted."""
    scheduler = Scheduler(BlockManager(12, 4, False, 1, None), 8, 4, 32)
    a = Sequence("a", list(range(60)), SamplingParams(max_tokens=2))
    scheduler.add(a)
    _run(scheduler, scheduler.schedule())  # 32 tokens: 8 of the 12 blocks
    b = Sequence("b", list(range(4)), SamplingParams(max_tokens=2))
    scheduler.add(b)
    batch = scheduler.schedule()  # a's 28 need 7 blocks, 4 are free: a takes 8, b its 4
    assert dict(zip((s.request_id for s in batch.seqs), batch.num_tokens)) == {"a": 8, "b": 4}
    assert scheduler.num_preemptions == 0


def test_eager_logits_take_the_decode_graphs_skinny_variant(monkeypatch):
    """A prefill step's few logits rows (eager) and a decode graph's (captured at start-up)
    must key the skinny LM-head kernel alike, or the first requests of each row count pay a
    compile (~1 s on a GPU; seen on an H100: a bf16-output variant built during the first
    16-prompt burst). Triton's binder, on the CPU, gives each launch's specialisation."""
    from types import SimpleNamespace

    from ringserve.kernels import skinny_matmul as S
    from ringserve.model.decoder import Linear, Transformer

    binder = _binder(S._skinny_kernel)
    seen = {"eager": set(), "graph": set()}
    mode = {}

    class Launch:
        def __getitem__(self, grid):
            def record(*args, **kwargs):
                seen[mode["now"]].add(tuple(str(s) for s in binder(*args, **kwargs)[1]))

            return record

    monkeypatch.setattr(S, "_skinny_kernel", Launch())
    monkeypatch.setattr(S, "skinny_plan", lambda x, weight, gated=False: (64, 128, 3, 64))
    lm_head = Linear(256, 1000, bias=False).to(torch.bfloat16)
    model = SimpleNamespace(lm_head=lm_head, config=SimpleNamespace(final_logit_softcapping=None))
    for rows in (1, 3, 16):
        hidden = torch.randn(rows, 256).to(torch.bfloat16)
        mode["now"] = "eager"
        Transformer.compute_logits(model, hidden)
        mode["now"] = "graph"
        Transformer.compute_logits(model, hidden, out=torch.empty(rows, 1000))
    assert seen["eager"] == seen["graph"] and len(seen["graph"]) == 3  # M == 1, 16, other
