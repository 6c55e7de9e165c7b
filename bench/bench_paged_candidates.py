"""Paged decode attention: the three candidates of issue 10 (item 1), measured side by side on
the engine's own KV-cache layout, so that the kernel is picked on figures.

  PYTHONPATH=. python bench/bench_paged_candidates.py                # one GPU: table, $OUT/paged_candidates.json
  PYTHONPATH=. python bench/bench_paged_candidates.py --quick        # four shapes, fewer repetitions
  PYTHONPATH=. python bench/bench_paged_candidates.py --device cpu   # smoke run: tiny shapes on the CPU
  (TRITON_INTERPRET=1 with --device cpu runs our Triton kernel in Triton's interpreter)

Candidates, each reading the same cache through the same block tables:
- ours: `ringserve.attention.paged.paged_attention`, called as the engine's eager decode step
  calls it (split-KV count from `decode_splits`); returns the LSE.
- flex: `torch.compile(flex_attention)` over the whole cache seen as one sequence of slots,
  with a BlockMask whose KV blocks are each sequence's pages (its block-table row), GQA by
  `enable_gqa`, LSE through `return_aux` (not on the CPU: compiled flex has no LSE there).
- cudnn: cuDNN's SDPA through the cudnn frontend's graph API with paged K/V tables
  (`paged_attention_k_table` / `_v_table`, padding mask with per-sequence lengths); the
  LSE is its softmax "stats" (natural log), asked for with `generate_stats`.
- cudnn_hnd: the same on a copy of the cache in [pages, NKV, block_size, D] order (the layout
  of cuDNN's samples), made once and not timed: not the engine's layout, but it says whether
  cuDNN needs (or gains from) a change of it.

Layout (ringserve/worker/kv_cache.py): per layer k and v [(num_blocks + 1) * block_size, NKV, D], token
t of a sequence in slot table[t // block_size] * block_size + t % block_size; block size the
engine's default. One cache, sized for the largest case, serves every case; each case draws
its blocks from it in random order (a sequence's pages are scattered, as in a long-running
engine). Decode shapes: Llama-3-8B heads (32 query, 8 KV, head_dim 128), one query per
sequence, bf16.

Per case, every candidate's output and LSE are checked against a float32 reference computed
on a gathered copy of each context; a candidate outside bf16 tolerance is reported wrong
and not timed. A ragged case (lengths across page boundaries, untimed) checks the partial
last pages. Times: `us` is the median device time of one call (CUDA events, L2 flushed and
the GPU kept busy before each call so that host overhead stays outside); `loop_us` is the
time per call of back-to-back calls, host overhead included (what an eager engine pays;
CUDA graphs remove it). TB/s = KV bytes read / `us`.

Each candidate runs in its own process: one that crashes, hangs or poisons the CUDA context
leaves the others' figures, and its error is in the table and the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this tree's ringserve, whatever is installed

from ringserve.options import EngineOptions  # noqa: E402
from ringserve.worker.kv_cache import KVCache  # noqa: E402
from ringserve.worker.kv_groups import KVGroups  # noqa: E402

CANDIDATES = ("ours", "flex", "cudnn", "cudnn_hnd")
# bf16 output against float32: |err| <= ATOL + RTOL * |ref| (bf16 keeps 8 bits of mantissa);
# LSE (float32 in every candidate) within LSE_ATOL.
ATOL, RTOL, LSE_ATOL = 1e-2, 1.6e-2, 1e-2
L2_FLUSH_BYTES = 256 << 20  # written before each timed call: the H200's L2 is 60 MB
BUSY_CYCLES = 2_000_000  # ~1 ms of torch.cuda._sleep before each timed call
CHILD_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


GPU_HEADS = Heads(32, 8, 128)  # Llama-3-8B
CPU_HEADS = Heads(8, 2, 64)  # same GQA group of 4, tiny


@dataclasses.dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]  # keys of each sequence (its query is the last of them)
    timed: bool = True

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def context(self) -> str:
        lo, hi = min(self.seq_lens), max(self.seq_lens)
        return str(hi) if lo == hi else f"{lo}..{hi}"


def uniform(batch: int, context: int) -> Case:
    return Case((context,) * batch)


# The ragged check comes first: it is small, and a wrong candidate shows before the long cases.
# Its batch of 8 is that of the last case: compiled flex specialises on shapes, not lengths,
# so the two share one compile.
GPU_CASES = [
    Case((1, 15, 16, 17, 33, 1000, 2048, 4097), timed=False),
    uniform(1, 1024),
    uniform(1, 32768),
    uniform(1, 131072),
    uniform(16, 1024),
    uniform(64, 1024),
    uniform(8, 32768),
]
GPU_QUICK_CASES = [GPU_CASES[0], uniform(1, 1024), uniform(1, 131072), uniform(64, 1024)]
CPU_CASES = [Case((1, 15, 16, 17, 40), timed=False), uniform(1, 64), uniform(4, 48)]


@dataclasses.dataclass
class Inputs:
    """One case on the shared cache: q [B, NH, D]; k_cache, v_cache [slots, NKV, D]; tables
    [B, max_pages] int32 (zero past a sequence's pages, as the engine's); seq_lens [B] int32."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    host_lens: list[int]
    block_size: int
    scale: float
    heads: Heads

    @property
    def batch(self) -> int:
        return len(self.host_lens)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V every candidate must read."""
        h = self.heads
        return 2 * sum(self.host_lens) * h.num_kv_heads * h.head_dim * self.k_cache.element_size()


def pages(n: int, block_size: int) -> int:
    return -(-n // block_size)


def make_cache(cases, heads: Heads, block_size: int, dtype, device) -> KVCache:
    """The engine's cache class, one layer, big enough for the largest case; random K/V."""
    num_blocks = max(sum(pages(n, block_size) for n in c.seq_lens) for c in cases)
    cache = KVCache(
        KVGroups.one_group(1), num_blocks, block_size, heads.num_kv_heads, heads.head_dim, dtype, device
    )
    g = torch.Generator(device=device).manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    return cache


def case_inputs(case: Case, index: int, cache: KVCache, heads: Heads) -> Inputs:
    """Seeded by the case's index: every candidate's process sees the same tables and queries."""
    bs, device = cache.block_size, cache.k.device
    g = torch.Generator().manual_seed(1000 + index)
    counts = [pages(n, bs) for n in case.seq_lens]
    perm = torch.randperm(cache.num_blocks, generator=g)  # never the scratch block
    tables = torch.zeros(case.batch, max(counts), dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = perm[used : used + count].to(torch.int32)
        used += count
    q = torch.randn(case.batch, heads.num_heads, heads.head_dim, generator=g).to(cache.k.dtype)
    return Inputs(
        q=q.to(device),
        k_cache=cache.k[0],
        v_cache=cache.v[0],
        tables=tables.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        host_lens=list(case.seq_lens),
        block_size=bs,
        scale=heads.head_dim**-0.5,
        heads=heads,
    )


def reference(inp: Inputs):
    """(out [B, NH, D], lse [B, NH]) in float32 from each context gathered out of the cache
    by hand: query head h reads KV head h // (NH / NKV)."""
    h, bs = inp.heads, inp.block_size
    group = h.num_heads // h.num_kv_heads
    outs, lses = [], []
    for row, n in enumerate(inp.host_lens):
        page_ids = inp.tables[row, : pages(n, bs)].long()
        slots = (page_ids[:, None] * bs + torch.arange(bs, device=page_ids.device)).flatten()[:n]
        k = inp.k_cache[slots].float()  # [n, NKV, D]
        v = inp.v_cache[slots].float()
        q = inp.q[row].float().view(h.num_kv_heads, group, h.head_dim)
        scores = torch.einsum("hgd,nhd->hgn", q, k) * inp.scale
        lse = torch.logsumexp(scores, dim=-1)  # [NKV, G]
        out = torch.einsum("hgn,nhd->hgd", torch.exp(scores - lse[..., None]), v)
        outs.append(out.reshape(h.num_heads, h.head_dim))
        lses.append(lse.reshape(h.num_heads))
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------- candidates
# Each factory runs once per process and returns make(inp) -> (run, notes): run() -> (out
# [B, NH, D], lse [B, NH] or None). Setup (compiling, graph building) belongs to make.


def ours_factory(device: torch.device):
    from ringserve.attention import paged as pa

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0

    def make(inp: Inputs):
        b, h = inp.batch, inp.heads
        # As ModelRunner._prepare_local for a decode step: one query tile per sequence,
        # split-KV only on CUDA.
        splits = 1
        if device.type == "cuda":
            splits = pa.decode_splits(b, h.num_kv_heads, max(inp.host_lens), num_sms)
        rows = list(range(b))

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        batch = pa.PagedBatch(
            seq_rows=i32(rows),
            cu_q=i32(list(range(b + 1))),
            seq_lens=inp.seq_lens,
            tile_seq=i32(rows),
            tile_q0=i32([0] * b),
            queries_per_tile=pa.tile_queries(h.num_heads, h.num_kv_heads, decode=True),
            num_splits=splits,
            host_cu_q=list(range(b + 1)),
            host_seq_lens=list(inp.host_lens),
            host_seq_rows=rows,
        )

        def run():
            return pa.paged_attention(
                inp.q, inp.k_cache, inp.v_cache, inp.tables, batch, inp.block_size, inp.scale
            )

        path = (
            "triton"
            if pa.triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
            else "reference (gathers)"
        )
        return run, f"splits={splits} {path}"

    return make


def flex_factory(device: torch.device):
    from torch.nn.attention import flex_attention as fa

    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(torch._dynamo.config, name):  # one compile per batch size; keep them all
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    compiled = torch.compile(fa.flex_attention, dynamic=False)
    want_lse = device.type == "cuda"  # compiled flex on the CPU returns no LSE

    def make(inp: Inputs):
        block_mask = paged_block_mask(fa, inp)
        q = inp.q.unsqueeze(2)  # [B, NH, 1, D]
        # The cache as one batch row of slots: [1, NKV, slots, D], a view (no copy).
        k = inp.k_cache.permute(1, 0, 2).unsqueeze(0)
        v = inp.v_cache.permute(1, 0, 2).unsqueeze(0)
        kwargs = {"block_mask": block_mask, "scale": inp.scale, "enable_gqa": True}
        if want_lse:
            if hasattr(fa, "AuxRequest"):
                kwargs["return_aux"] = fa.AuxRequest(lse=True)
            else:
                kwargs["return_lse"] = True
        b, nh = inp.batch, inp.heads.num_heads

        def runner(kernel_options):
            def run():
                result = compiled(q, k, v, kernel_options=kernel_options, **kwargs)
                if not want_lse:
                    return result.reshape(b, nh, -1), None
                out, aux = result
                lse = aux.lse if hasattr(aux, "lse") else aux  # AuxOutput or the legacy tensor
                return out.reshape(b, nh, -1), lse.reshape(b, nh)

            return run

        notes = "lse" if want_lse else "no lse on cpu (compiled flex)"
        run = runner(None)
        try:
            run()  # compiles flex's decoding kernel (one query per sequence)
            return run, notes
        except Exception as e:  # the general flex kernel, as vLLM's flex backend runs it
            print(
                f"  flex: the decoding kernel failed ({describe(e)}); forcing the general kernel", flush=True
            )
            run = runner({"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": inp.block_size})
            run()
            return run, f"{notes}; general kernel (decoding kernel failed: {describe(e)})"

    return make


def paged_block_mask(fa, inp: Inputs):
    """A BlockMask over the cache's physical slots whose KV blocks are each sequence's pages.

    Every page is listed as a partial block (kv_num_blocks / kv_indices), none as full: flex
    decoding then splits each sequence's own pages over its split-KV programs (its full-block
    path splits the whole cache length instead, leaving most programs idle on a large
    cache). The mask_mod only has to cut the last page at the sequence's length: a slot is
    visible unless it lies in the last page at or past the length.
    """
    bs, b = inp.block_size, inp.batch
    slots = inp.k_cache.shape[0]
    device = inp.tables.device
    counts = (inp.seq_lens + bs - 1) // bs  # [B] pages of each sequence
    # kv_indices as wide as the cache has pages: BlockMask derives its transposed (q-block)
    # index from a dense [.., num_cols] map with num_cols = this width, so every physical page
    # id must fit in it (a narrower table would index out of bounds).
    width = slots // bs
    kv_indices = torch.zeros(b, 1, 1, width, dtype=torch.int32, device=device)
    kv_indices[:, 0, 0, : inp.tables.shape[1]] = inp.tables
    kv_num_blocks = counts.view(b, 1, 1).to(torch.int32)
    rows = torch.arange(b, device=device)
    last_page = inp.tables[rows, (counts - 1).long()]  # [B] physical id of the last page
    last_len = inp.seq_lens - (counts - 1) * bs  # [B] keys in the last page, 1..bs

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx // bs != last_page[batch]) | (kv_idx % bs < last_len[batch])

    return fa.BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=(128, bs), mask_mod=mask_mod, seq_lengths=(1, slots)
    )


def cudnn_factory(device: torch.device, layout: str = "engine"):
    """layout "engine": the containers are views of the engine's cache; "hnd": of a copy of it
    in [pages, NKV, block_size, D] order (cuDNN's samples' layout), made once, untimed; it
    shows what a change of the engine's layout would buy or whether cuDNN needs one."""
    if device.type != "cuda":
        raise RuntimeError("cuDNN needs a CUDA device")
    import cudnn

    handle = cudnn.create_handle()
    notes = f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}"
    copies = {}  # the HND copy of the shared cache, by its data_ptr

    def make(inp: Inputs):
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        pages_kv = engine_pages(inp) if layout == "engine" else hnd_pages(inp, copies)
        try:
            return cudnn_decode(cudnn, handle, inp, pages_kv, with_stats=True), notes
        except Exception as e:  # no stats (LSE) with paged caches: time it anyway, say so
            print(f"  cudnn: the graph with stats failed, building it without: {describe(e)}", flush=True)
            run = cudnn_decode(cudnn, handle, inp, pages_kv, with_stats=False)
            return run, f"{notes}; with stats: {describe(e)}"

    return make


def engine_pages(inp: Inputs):
    """The cache's pages as cuDNN containers [pages, NKV, block_size, D]: strided views of
    the engine's [slots, NKV, D] (no copy)."""
    h = inp.heads
    shape = (-1, inp.block_size, h.num_kv_heads, h.head_dim)
    return inp.k_cache.view(shape).permute(0, 2, 1, 3), inp.v_cache.view(shape).permute(0, 2, 1, 3)


def hnd_pages(inp: Inputs, copies: dict):
    key = inp.k_cache.data_ptr()
    if key not in copies:
        copies[key] = tuple(t.contiguous() for t in engine_pages(inp))
    return copies[key]


def cudnn_decode(cudnn, handle, inp: Inputs, pages_kv, with_stats: bool):
    """Build the paged decode graph for this case over pages_kv (K and V containers
    [pages, NKV, block_size, D]); returns run() -> (out, lse or None)."""
    b, h, bs = inp.batch, inp.heads, inp.block_size
    nh, d = h.num_heads, h.head_dim
    width = inp.tables.shape[1]
    io_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[inp.q.dtype]
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    # cuDNN's dims are always [batch, heads, seq, dim]; strides say where things are:
    # q [B, NH, D] is [B, NH, 1, D].
    k_pages, v_pages = pages_kv
    table = inp.tables.view(b, 1, width, 1)
    seq_len_q = torch.ones(b, 1, 1, 1, dtype=torch.int32, device=inp.q.device)
    seq_len_kv = inp.seq_lens.view(b, 1, 1, 1)
    q_t = graph.tensor(name="q", dim=[b, nh, 1, d], stride=[nh * d, d, nh * d, 1], data_type=io_type)
    k_t = graph.tensor(
        name="container_k", dim=list(k_pages.shape), stride=list(k_pages.stride()), data_type=io_type
    )
    v_t = graph.tensor(
        name="container_v", dim=list(v_pages.shape), stride=list(v_pages.stride()), data_type=io_type
    )
    int32 = cudnn.data_type.INT32
    tk_t = graph.tensor(
        name="page_table_k", dim=[b, 1, width, 1], stride=[width, width, 1, 1], data_type=int32
    )
    tv_t = graph.tensor(
        name="page_table_v", dim=[b, 1, width, 1], stride=[width, width, 1, 1], data_type=int32
    )
    sq_t = graph.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
    skv_t = graph.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
    kwargs = dict(
        name="paged_decode",
        q=q_t,
        k=k_t,
        v=v_t,
        attn_scale=inp.scale,
        use_padding_mask=True,
        seq_len_q=sq_t,
        seq_len_kv=skv_t,
        paged_attention_k_table=tk_t,
        paged_attention_v_table=tv_t,
        paged_attention_max_seq_len_kv=width * bs,
    )
    try:
        o_t, stats_t = graph.sdpa(generate_stats=with_stats, **kwargs)
    except TypeError:  # frontends before generate_stats took is_inference
        o_t, stats_t = graph.sdpa(is_inference=not with_stats, **kwargs)
    o_t.set_output(True).set_dim([b, nh, 1, d]).set_stride([nh * d, d, nh * d, 1])
    out = torch.empty_like(inp.q)
    pack = {
        q_t: inp.q,
        k_t: k_pages,
        v_t: v_pages,
        tk_t: table,
        tv_t: table,
        sq_t: seq_len_q,
        skv_t: seq_len_kv,
        o_t: out,
    }
    lse = None
    if with_stats:
        stats_t.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        stats_t.set_dim([b, nh, 1, 1]).set_stride([nh, 1, nh, 1])
        lse = torch.empty(b, nh, dtype=torch.float32, device=inp.q.device)
        pack[stats_t] = lse
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=inp.q.device)

    def run():
        graph.execute(pack, workspace, handle=handle)
        return out, lse

    return run


FACTORIES = {
    "ours": ours_factory,
    "flex": flex_factory,
    "cudnn": cudnn_factory,
    "cudnn_hnd": functools.partial(cudnn_factory, layout="hnd"),
}


# ---------------------------------------------------------------- checking and timing


def check(out, lse, ref_out, ref_lse) -> dict:
    err = (out.float() - ref_out).abs()
    result = {
        "ok": bool((err <= ATOL + RTOL * ref_out.abs()).all()),
        "max_abs_err": err.max().item(),
        "lse": "none",
    }
    if lse is not None:
        lse_err = (lse.float().reshape(ref_lse.shape) - ref_lse).abs().max().item()
        result["lse_max_abs_err"] = lse_err
        result["lse"] = "ok" if lse_err <= LSE_ATOL else "wrong"
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_time_us(run, device: torch.device, reps: int) -> float:
    """Median time of one call: on CUDA between events, after an L2 flush and ~1 ms of
    busy GPU, so that the host has enqueued the call before the GPU reaches it."""
    for _ in range(3):
        run()
    sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    sleep = getattr(torch.cuda, "_sleep", None)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        flush.zero_()
        if sleep is not None:
            sleep(BUSY_CYCLES)
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) * 1000 for start, end in events)


def loop_time_us(run, device: torch.device, calls: int) -> float:
    """Per call of back-to-back calls, host overhead included."""
    run()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        run()
    sync(device)
    return (time.perf_counter() - start) * 1e6 / calls


# ---------------------------------------------------------------- one candidate (child process)


def run_candidate(name: str, args, emit) -> None:
    """Every case for one candidate; emit(row) as each case finishes."""
    device = torch.device(args.device)
    heads, cases = setup(args)
    base = {"candidate": name}
    try:
        make = FACTORIES[name](device)
    except Exception as e:  # not installed, no GPU: one line per case, then done
        for index, case in enumerate(cases):
            emit({**case_row(index, case), **base, "error": describe(e)})
        traceback.print_exc()
        return
    cache = make_cache(cases, heads, args.block_size, dtype_of(args), device)
    reps = 5 if device.type == "cpu" else 20 if args.quick else 100
    for index, case in enumerate(cases):
        row = {**case_row(index, case), **base}
        try:
            with torch.no_grad():
                inp = case_inputs(case, index, cache, heads)
                ref_out, ref_lse = reference(inp)
                start = time.perf_counter()
                run, notes = make(inp)
                out, lse = run()  # the first call compiles (flex) or builds (cudnn)
                sync(device)
                row["setup_s"] = round(time.perf_counter() - start, 2)
                row["notes"] = notes
                row.update(check(out, lse, ref_out, ref_lse))
                if row["ok"] and case.timed:
                    us = device_time_us(run, device, reps)
                    row["us"] = us
                    row["tbps"] = inp.kv_bytes / (us * 1e-6) / 1e12
                    row["loop_us"] = loop_time_us(run, device, reps)
        except Exception as e:
            row["error"] = describe(e)
            traceback.print_exc()
        print(f"  {format_row(row)}", flush=True)
        emit(row)


def describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def case_row(index: int, case: Case) -> dict:
    return {
        "case": index,
        "batch": case.batch,
        "context": case.context,
        "seq_lens": list(case.seq_lens),
        "timed": case.timed,
    }


def setup(args):
    if args.device == "cpu":
        return CPU_HEADS, CPU_CASES
    return GPU_HEADS, GPU_QUICK_CASES if args.quick else GPU_CASES


def dtype_of(args) -> torch.dtype:
    name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return getattr(torch, name)


# ---------------------------------------------------------------- parent: one process per candidate


def run_isolated(name: str, args) -> list[dict]:
    """Run one candidate in a child process; rows it did not report (crash, timeout) come
    back as errors."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        rows_path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--rows-to", rows_path, "--candidates", name]
    cmd += ["--device", args.device, "--block-size", str(args.block_size)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    print(f"== {name}", flush=True)
    try:
        rc = subprocess.run(cmd, timeout=CHILD_TIMEOUT_S).returncode
        failure = f"process exited with {rc}" if rc else ""
    except subprocess.TimeoutExpired:
        failure = f"process killed after {CHILD_TIMEOUT_S} s"
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.unlink(rows_path)
    done = {r["case"] for r in rows}
    for index, case in enumerate(setup(args)[1]):
        if index not in done:
            rows.append({**case_row(index, case), "candidate": name, "error": failure or "no result"})
    return rows


def format_row(row: dict) -> str:
    def num(key, fmt):
        return format(row[key], fmt) if key in row else format("-", f">{fmt.split('.')[0]}")

    status = row.get("error") or ("ok" if row.get("ok") else "WRONG")
    if row.get("ok") and not row.get("timed"):
        status = "ok (check only)"
    return (
        f"{row['batch']:5d} {row['context']:>11s} {row['candidate']:>9s} {num('us', '9.1f')} "
        f"{num('loop_us', '9.1f')} {num('tbps', '6.2f')} {num('max_abs_err', '9.2e')} "
        f"{row.get('lse', '-'):>5s}  {status}  {row.get('notes', '')}"
    )


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'batch':>5s} {'context':>11s} {'cand':>9s} {'us':>9s} {'loop_us':>9s} {'TB/s':>6s} {'max_err':>9s} {'lse':>5s}  status"
    )
    order = {c: i for i, c in enumerate(CANDIDATES)}
    for row in sorted(rows, key=lambda r: (r["case"], order.get(r["candidate"], len(order)))):
        print(format_row(row))
    for (batch, context), best in fastest(rows).items():
        print(
            f"fastest correct at batch {batch}, context {context}: {best['candidate']} ({best['us']:.1f} us)"
        )


def fastest(rows: list[dict]) -> dict:
    best = {}
    for row in rows:
        if row.get("ok") and "us" in row:
            key = (row["batch"], row["context"])
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    return best


def environment(args) -> dict:
    info = {"torch": torch.__version__, "device": args.device, "block_size": args.block_size}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["torch_cudnn"] = torch.backends.cudnn.version()
    info["commit"] = os.environ.get("RINGSERVE_COMMIT", "") or git_commit()
    info["date"] = time.strftime("%Y-%m-%d")
    return info


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    except OSError:
        return ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--quick", action="store_true", help="the ragged check and three shapes, fewer repetitions"
    )
    p.add_argument(
        "--candidates", default=",".join(CANDIDATES), help="comma-separated: " + ",".join(CANDIDATES)
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineOptions.__dataclass_fields__["block_size"].default,
        help="tokens per KV-cache page (default: the engine's)",
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/paged_candidates.json)")
    p.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)  # child mode: JSON lines
    args = p.parse_args(argv)
    args.candidates = [c for c in args.candidates.split(",") if c]
    unknown = set(args.candidates) - set(CANDIDATES)
    if unknown:
        p.error(f"unknown candidates {sorted(unknown)}; choose from {','.join(CANDIDATES)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    if args.rows_to:
        with open(args.rows_to, "a") as f:

            def emit(row):
                f.write(json.dumps(row) + "\n")
                f.flush()

            for name in args.candidates:
                run_candidate(name, args, emit)
        return
    start = time.perf_counter()
    rows = []
    for name in args.candidates:
        rows += run_isolated(name, args)
    print_table(rows)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "paged_candidates.json")
    result = {
        "environment": environment(args),
        "tolerance": {"atol": ATOL, "rtol": RTOL, "lse_atol": LSE_ATOL},
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
        "fastest": {f"{b}x{c}": r["candidate"] for (b, c), r in fastest(rows).items()},
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
