"""Attention of packed queries over the paged KV cache, read in place through block tables.

The cache is never gathered into a copy of each context: a Triton kernel follows each
sequence's block table on the device. Decode (one query per sequence) splits every
sequence's keys over several programs (split-KV, "flash decoding") so that even batch 1
at a long context keeps the whole GPU streaming; the splits merge by log-sum-exp.

Shapes: q [T, NH, D] (sequence i's queries are q[cu_q[i]:cu_q[i+1]]); k_cache, v_cache
[num_slots, NKV, D], slot = block * block_size + offset; block_tables [R, max_blocks]
int32, one row per running sequence; out [T, NH, D]; lse [T, NH] float32. Sequence i has
seq_lens[i] keys after this step and its queries are the last of them (positions
seq_lens[i] - q_len .. seq_lens[i] - 1): a query sees every key at or before its position.

On a CPU (and as the reference) the same function gathers each sequence's pages and runs
the dense varlen attention.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ringserve.attention.dense import VarlenBatch, attention_with_lse
from ringserve.config import FULL_ATTENTION, AttentionWindow, first_visible_block
from ringserve.kernels.kv_quant import gather_kv
from ringserve.kernels.pdl import launch_options

try:
    import triton
    import triton.language as tl

    from ringserve.kernels.pdl import wait_for_previous
except ImportError:  # CPU builds of torch come without Triton
    triton = None

# Rows (query x head) of one program's score tile: a prefill tile holds this many, a decode
# tile one query's heads of a KV head, padded to the 16 rows tl.dot needs.
_PREFILL_ROWS = 64
_MIN_ROWS = 16
# Keys per loop step and the launch settings, chosen on an H200 (bench/bench_paged.py).
LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 2}


@dataclass
class PagedBatch:
    """Where a step's queries are and which cache rows they read: device tensors, plus the
    launch shape chosen on the host (no device sync)."""

    seq_rows: torch.Tensor  # [B] int32: each sequence's row of the block tables
    cu_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: keys of each sequence after this step
    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each query tile
    tile_q0: torch.Tensor  # [tiles] int32: its first query, counted within the sequence
    queries_per_tile: int
    num_splits: int  # programs sharing one tile's keys (split-KV); 1 for prefill tiles
    # Host copies for the CPU reference path (None on the GPU path).
    host_cu_q: list[int] | None = None
    host_seq_lens: list[int] | None = None
    host_seq_rows: list[int] | None = None
    # Every split holds at most one loop step of keys (fits_one_block, known on the host):
    # the kernel then reads the cached keys before waiting for the previous kernel.
    one_block: bool = False


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_queries(num_heads: int, num_kv_heads: int, decode: bool) -> int:
    """Queries of one sequence per program; a tile's rows are query-major (query x head)."""
    if decode:
        return 1
    return max(1, _PREFILL_ROWS // _next_power_of_2(num_heads // num_kv_heads))


def decode_splits(batch_size: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Split-KV programs per (sequence, KV head), a power of two: about four programs per
    multiprocessor (fewer left the H200 at 3.1 TB/s at 128K, bench/bench_paged.py), but no
    split shorter than 128 keys (its fixed cost would dominate)."""
    want = min(-(-4 * num_sms // (batch_size * num_kv_heads)), -(-max_keys // 128), 64)
    return 1 << (max(1, want).bit_length() - 1)


def fits_one_block(max_seq_len: int, num_splits: int) -> bool:
    """Whether every split of a decode over sequences of at most max_seq_len keys is one
    loop step of the kernel (PagedBatch.one_block)."""
    return max_seq_len <= num_splits * LAUNCH["block_n"]


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    batch: PagedBatch,
    block_size: int,
    scale: float,
    window: AttentionWindow = FULL_ATTENTION,
    pdl: bool = True,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """(out [T, NH, D], lse [T, NH] float32) of every query over its sequence's cached keys
    that its window lets it see; blocks before the first one a sequence's first query sees
    are never read (a windowed layer may have freed them). pdl: the kernels launched with
    programmatic dependent launch where the GPU has it (ringserve.kernels.pdl). kv_scales:
    (k_scale, v_scale) [NKV] float32 of an FP8 cache (kernels/kv_quant.py), dequantised as
    it is read: the keys' scale joins the softmax scale, the values' the output."""
    # Under Triton's CPU interpreter (tests) the kernel runs on the CPU too.
    if triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return _paged_triton(
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
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, batch, block_size, scale, window, kv_scales
    )


def paged_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    batch: PagedBatch,
    block_size,
    scale,
    window=FULL_ATTENTION,
    kv_scales=None,
):
    """Gather each sequence's pages from the first one its queries see (by its block table),
    dequantised where the cache is FP8, and run the dense varlen attention."""
    slots, varlen = gather_plan(block_tables, batch, block_size, window, q.device)
    k, v = gather_kv(k_cache, v_cache, slots, kv_scales, q.dtype)
    return attention_with_lse(q, k, v, varlen, scale, window)


def gather_plan(block_tables, batch: PagedBatch, block_size: int, window: AttentionWindow, device):
    """(slots [K] int64, VarlenBatch): the cache slots of every key the batch's queries may
    see, packed per sequence in position order from the first block its first query sees,
    and the dense varlen batch of the queries over those gathered keys."""
    cu_q = batch.host_cu_q if batch.host_cu_q is not None else batch.cu_q.tolist()
    lens = batch.host_seq_lens if batch.host_seq_lens is not None else batch.seq_lens.tolist()
    rows = batch.host_seq_rows if batch.host_seq_rows is not None else batch.seq_rows.tolist()
    slots, cu_k, firsts = [], [0], []
    offsets = torch.arange(block_size, device=block_tables.device)
    for row, n, a, b in zip(rows, lens, cu_q[:-1], cu_q[1:]):
        first_block = first_visible_block(n - (b - a), block_size, window)
        first = first_block * block_size
        pages = block_tables[row, first_block : -(-n // block_size)].long()
        slots.append((pages[:, None] * block_size + offsets).flatten()[: n - first])
        cu_k.append(cu_k[-1] + n - first)
        firsts.append(first)
    q_positions = torch.cat([torch.arange(n - (b - a), n) for a, b, n in zip(cu_q[:-1], cu_q[1:], lens)])
    k_positions = torch.cat([torch.arange(first, n) for first, n in zip(firsts, lens)])
    varlen = VarlenBatch(
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True),
        max_seqlen_q=max(b - a for a, b in zip(cu_q[:-1], cu_q[1:])),
        max_seqlen_k=max(lens),
        q_positions=q_positions.to(device, non_blocking=True),
        k_positions=k_positions.to(device, non_blocking=True),
        causal_suffix=True,
        q_bounds=list(cu_q),
        k_bounds=cu_k,
        k_offsets=firsts,
    )
    return torch.cat(slots), varlen


def _paged_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    batch: PagedBatch,
    block_size: int,
    scale: float,
    launch=None,
    window: AttentionWindow = FULL_ATTENTION,
    pdl: bool = True,
    kv_scales=None,
):
    """launch: overrides of the kernel's tile and launch settings (bench/bench_paged.py)."""
    # An FP8 cache: twice the keys a loop step, for the bytes in flight of a bf16 step.
    launch = {
        **LAUNCH,
        **({"block_n": 2 * LAUNCH["block_n"]} if kv_scales is not None else {}),
        **(launch or {}),
    }
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    queries_per_tile = batch.queries_per_tile
    group_pad = max(_next_power_of_2(group), _MIN_ROWS // queries_per_tile)
    splits = batch.num_splits
    out = torch.empty_like(q)
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=q.device)
    if splits > 1:
        part_out = torch.empty(splits, tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, tokens, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    grid = (batch.tile_seq.shape[0], num_kv_heads, splits)
    pdl_launch = launch_options(q, pdl)
    k_scale, v_scale = kv_scales if kv_scales is not None else (lse, lse)  # read only if KV_SCALED
    _paged_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        batch.seq_rows,
        batch.cu_q,
        batch.seq_lens,
        batch.tile_seq,
        batch.tile_q0,
        part_out,
        part_lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        window.sliding or 0,
        window.chunk or 0,
        NUM_SPLITS=splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        QUERIES=queries_per_tile,
        BLOCK_N=launch["block_n"],
        PAGE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32,
        INTERPRET=not q.is_cuda,
        HAS_SLIDING=window.sliding is not None,
        HAS_CHUNK=window.chunk is not None,
        LOCAL=not window.is_full,
        ONE_BLOCK=batch.one_block and launch["block_n"] >= LAUNCH["block_n"],
        KV_SCALED=kv_scales is not None,
        PDL=bool(pdl_launch),
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
        **pdl_launch,
    )
    if splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            part_out,
            part_lse,
            out,
            lse,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            SPLITS=splits,
            HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            PDL=bool(pdl_launch),
            **pdl_launch,
        )
    return out, lse


if triton is not None:

    @triton.jit
    def _load_keys(
        n0, lo, hi, row, kv_head, tables_ptr, k_ptr, v_ptr, stride_table, stride_ks, stride_kh, stride_vs,
        stride_vh, d, d_ok, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        """(k, v) [BLOCK_N, D_PAD] of keys n0 .. n0 + BLOCK_N - 1, those in lo .. hi - 1 found
        through the sequence's block table, the others 0."""
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (n >= lo) & (n < hi)
        page = tl.load(tables_ptr + row * stride_table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0
        )
        return k, v

    @triton.jit
    def _attend_keys(
        q, q_pos, first_pos, m_i, l_i, acc, k, v, n0, end, scale_log2,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, LOCAL: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax update of a tile's rows with keys n0 .. n0 + BLOCK_N - 1 (< end),
        k and v from _load_keys (an FP8 cache's values, unscaled: the caller folds the
        scales in); LOCAL: row r sees keys from first_pos[r]."""
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 -> q's dtype is exact
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if LOCAL:
            visible = visible & (n[None, :] >= first_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    # Triton compiles a variant per specialisation of the arguments (~1 s each on an H100),
    # so none may depend on the step: the metadata arrays are slices of one upload
    # (ModelRunner._prepare_local), 16-byte aligned or not by the batch size and tile count,
    # and the split strides are the step's rows x heads (x head_dim; divisible by 16 or not).
    @triton.jit(
        do_not_specialize=["stride_os", "stride_ls"],
        do_not_specialize_on_alignment=[
            "seq_rows_ptr",
            "cu_q_ptr",
            "seq_lens_ptr",
            "tile_seq_ptr",
            "tile_q0_ptr",
        ],
    )
    def _paged_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        k_scale_ptr,  # KV_SCALED: [NKV] float32, an FP8 cache's scales (kernels/kv_quant.py)
        v_scale_ptr,
        tables_ptr,
        seq_rows_ptr,
        cu_q_ptr,
        seq_lens_ptr,
        tile_seq_ptr,
        tile_q0_ptr,
        out_ptr,  # [splits, T, NH, D]: this split's normalised output
        lse_ptr,  # [splits, T, NH]: its natural-log LSE (-inf: no key seen)
        scale_log2,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_table,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        sliding,  # window of the layer: keys p - sliding < k (0: none)
        chunk,  # attention chunk: keys of p's own chunk (0: none)
        NUM_SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        QUERIES: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRET: tl.constexpr,
        HAS_SLIDING: tl.constexpr,
        HAS_CHUNK: tl.constexpr,
        LOCAL: tl.constexpr,
        ONE_BLOCK: tl.constexpr,  # every split holds at most BLOCK_N keys (PagedBatch.one_block)
        KV_SCALED: tl.constexpr = False,  # an FP8 cache: k and v times the KV head's scales
        PDL: tl.constexpr = False,
    ):
        # One program: QUERIES queries of one sequence x the GROUP query heads of one KV
        # head (rows query-major), over one split of the keys they may see.
        # Until wait_for_previous (PDL, ringserve.kernels.pdl) it reads only what kernels before the
        # previous one wrote: the step's metadata and block tables, and (ONE_BLOCK) the keys
        # cached before this step (the previous kernel writes this step's own). These
        # dependent loads then overlap the previous kernel instead of following it. Only a
        # kernel with no loop over the keys gains from the early keys: with the loop compiled
        # in, it measured 14% slower at 128K (bench/bench_decode_chain.py, BENCHMARKS.md).
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(tile_seq_ptr + tile)
        q0 = tl.load(tile_q0_ptr + tile)
        row = tl.load(seq_rows_ptr + seq).to(tl.int64)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len  # keys before this step's: written by earlier steps

        m = tl.arange(0, QUERIES * GROUP_PAD)
        qi = q0 + m // GROUP_PAD
        g = m % GROUP_PAD
        row_ok = (qi < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        q_pos = cached + qi  # each row's global position
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        if KV_SCALED:  # s = q.(k8 x k_scale) = (q.k8) x k_scale: one scale per program
            scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)

        # Keys up to the tile's last query, from the first block its first query sees (a
        # window's earlier blocks are never visited), cut into NUM_SPLITS runs of whole BLOCK_Ns.
        kv_end = cached + tl.minimum(q0 + QUERIES, q_len)
        # The window's first visible position, exact per layer, on the device: the same rule
        # as the host's one definition, AttentionWindow.first_visible / config.first_visible_block.
        first_pos = tl.zeros_like(q_pos)
        kv_start = seq_len * 0
        if HAS_SLIDING:
            first_pos = tl.maximum(first_pos, q_pos - sliding + 1)
            kv_start = tl.maximum(kv_start, cached + q0 - sliding + 1)
        if HAS_CHUNK:
            first_pos = tl.maximum(first_pos, q_pos // chunk * chunk)
            kv_start = tl.maximum(kv_start, (cached + q0) // chunk * chunk)
        kv_start = kv_start // PAGE * PAGE
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = kv_start + split * per_split
        end = tl.minimum(start + per_split, kv_end)

        if ONE_BLOCK:  # the caller knows each split is one BLOCK_N: its cached keys now
            k_first, v_first = _load_keys(
                start, start, tl.minimum(end, cached), row, kv_head, tables_ptr, k_ptr, v_ptr, stride_table,
                stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, BLOCK_N, PAGE,
            )  # fmt: skip

        wait_for_previous(PDL)
        q_offs = (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_SCALED and not IEEE:
            # FP8 pages: the dots in float16, to which e4m3 converts exactly in one instruction
            # (to bfloat16 it takes several, per key); q and p lose nothing that matters there.
            q = q.to(tl.float16)
        m_i = tl.full([QUERIES * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([QUERIES * GROUP_PAD], tl.float32)
        acc = tl.zeros([QUERIES * GROUP_PAD, D_PAD], tl.float32)
        if ONE_BLOCK:  # this step's keys, from the previous kernel, then the one update
            k_new, v_new = _load_keys(
                start, tl.maximum(start, cached), end, row, kv_head, tables_ptr, k_ptr, v_ptr, stride_table,
                stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, BLOCK_N, PAGE,
            )  # fmt: skip
            is_cached = (start + tl.arange(0, BLOCK_N) < cached)[:, None]
            if start < end:
                m_i, l_i, acc = _attend_keys(
                    q, q_pos, first_pos, m_i, l_i, acc, tl.where(is_cached, k_first, k_new),
                    tl.where(is_cached, v_first, v_new), start, end, scale_log2, BLOCK_N, IEEE, LOCAL,
                )  # fmt: skip
        elif INTERPRET:  # Triton's CPU interpreter cannot run a for loop over loaded bounds
            n0 = start
            while n0 < end:
                k, v = _load_keys(
                    n0, n0, end, row, kv_head, tables_ptr, k_ptr, v_ptr, stride_table,
                    stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, BLOCK_N, PAGE,
                )  # fmt: skip
                m_i, l_i, acc = _attend_keys(
                    q, q_pos, first_pos, m_i, l_i, acc, k, v, n0, end, scale_log2, BLOCK_N, IEEE, LOCAL
                )
                n0 += BLOCK_N
        else:
            for n0 in range(start, end, BLOCK_N):
                k, v = _load_keys(
                    n0, n0, end, row, kv_head, tables_ptr, k_ptr, v_ptr, stride_table,
                    stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, BLOCK_N, PAGE,
                )  # fmt: skip
                m_i, l_i, acc = _attend_keys(
                    q, q_pos, first_pos, m_i, l_i, acc, k, v, n0, end, scale_log2, BLOCK_N, IEEE, LOCAL
                )

        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if KV_SCALED:  # sum p (v8 x v_scale) = (sum p v8) x v_scale
            out = out * tl.load(v_scale_ptr + kv_head)
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        rows_t = (q_start + qi).to(tl.int64)
        o_offs = split * stride_os + rows_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + split * stride_ls + rows_t * stride_lt + head, lse, mask=row_ok)

    @triton.jit(do_not_specialize=["stride_ps", "stride_ls"])  # rows x heads (x head_dim), as above
    def _merge_splits_kernel(
        part_out_ptr,
        part_lse_ptr,
        out_ptr,
        lse_ptr,
        stride_ps,
        stride_pt,
        stride_ph,
        stride_ls,
        stride_lt,
        stride_ot,
        stride_oh,
        stride_lse_t,
        SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        # One program per (query, head): the log-sum-exp merge of its split-KV partials.
        wait_for_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D_PAD)
        lses = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h)
        top = tl.max(lses, 0)
        top_use = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lses - top_use)  # 0 for splits that saw no key
        total = tl.sum(w, 0)
        offs = s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :]
        parts = tl.load(part_out_ptr + offs, mask=(w[:, None] > 0) & (d[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
        )
        lse = tl.where(total > 0, top_use + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * stride_lse_t + h, lse)
