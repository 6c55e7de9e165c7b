"""Merge partial attention results over disjoint key sets by log-sum-exp.

For parts s with outputs o_s and log-sum-exps l_s of the same queries:
    lse = log(sum_s exp(l_s)),   out = sum_s exp(l_s - lse) * o_s
exactly the attention over the union of the keys. A part that saw no key has l_s = -inf
and weight 0 (its output is never read); a query that saw no key at all gets out 0 and
lse -inf.

On CUDA one Triton kernel reads every part once and writes the result once (the torch
version makes several float32 passes, which at a few thousand tokens per rank costs as much
as the attention itself); elsewhere, or without Triton, plain torch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None


def merge_partials(outs, lses, first_rows=None, num_rows=None):
    """outs: list of [T_s, NH, D]; lses: list of [T_s, NH] float32. Returns (out, lse) for
    num_rows queries, part s holding rows first_rows[s] : first_rows[s] + T_s (default: all
    parts hold every row); rows a part does not hold count as unseen by it."""
    if first_rows is None:
        first_rows, num_rows = [0] * len(outs), outs[0].shape[0]
    if triton is not None and outs[0].is_cuda:
        return _merge_triton(outs, lses, first_rows, num_rows)
    return _merge_torch(*_full_rows(outs, lses, first_rows, num_rows))


def _full_rows(outs, lses, first_rows, num_rows):
    full_outs, full_lses = [], []
    for out, lse, first in zip(outs, lses, first_rows):
        if first == 0 and out.shape[0] == num_rows:
            full_outs.append(out)
            full_lses.append(lse)
            continue
        padded = out.new_zeros(num_rows, *out.shape[1:])
        padded[first : first + out.shape[0]] = out
        padded_lse = lse.new_full((num_rows, lse.shape[1]), float("-inf"))
        padded_lse[first : first + lse.shape[0]] = lse
        full_outs.append(padded)
        full_lses.append(padded_lse)
    return full_outs, full_lses


def _merge_torch(outs, lses):
    lse = torch.stack(lses)  # [S, T, NH]
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # 0 for parts with no visible key
    total = w.sum(dim=0)
    out = sum(wi.unsqueeze(-1) * torch.where(wi.unsqueeze(-1) > 0, o.float(), 0.0) for wi, o in zip(w, outs))
    out = out / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    merged_lse = m_safe + torch.log(total)  # -inf where total == 0
    return out.to(outs[0].dtype), merged_lse


if triton is not None:

    @triton.jit
    def _merge_kernel(
        parts_ptr,  # [4, S] int64: per part, its output's address ([T_s, NH, D] contiguous),
        # its LSE's address ([NH, T_s] contiguous), its first row, its row count
        out_ptr,  # [T, NH, D]
        merged_lse_ptr,  # [T, NH] float32
        num_parts,
        num_tokens,
        num_heads,
        head_dim,
        OUT_DTYPE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # row = token * NH + head
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < num_tokens * num_heads
        token, head = rows // num_heads, rows % num_heads
        col_ok = cols < head_dim
        m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
        for s in range(num_parts):
            lse_part = tl.load(parts_ptr + num_parts + s).to(tl.pointer_type(tl.float32))
            first, count = tl.load(parts_ptr + 2 * num_parts + s), tl.load(parts_ptr + 3 * num_parts + s)
            local = token - first
            held = row_ok & (local >= 0) & (local < count)
            m = tl.maximum(m, tl.load(lse_part + head * count + local, mask=held, other=float("-inf")))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_ROWS], tl.float32)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for s in range(num_parts):
            out_part = tl.load(parts_ptr + s).to(tl.pointer_type(OUT_DTYPE))
            lse_part = tl.load(parts_ptr + num_parts + s).to(tl.pointer_type(tl.float32))
            first, count = tl.load(parts_ptr + 2 * num_parts + s), tl.load(parts_ptr + 3 * num_parts + s)
            local = token - first
            held = row_ok & (local >= 0) & (local < count)
            w = tl.exp(tl.load(lse_part + head * count + local, mask=held, other=float("-inf")) - m_safe)
            offsets = ((local * num_heads + head) * head_dim)[:, None] + cols[None, :]
            o = tl.load(out_part + offsets, mask=(held & (w > 0))[:, None] & col_ok[None, :], other=0.0)
            acc += w[:, None] * o.to(tl.float32)
            total += w
        acc = acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
        out_offsets = (rows * head_dim)[:, None] + cols[None, :]
        tl.store(out_ptr + out_offsets, acc.to(OUT_DTYPE), mask=row_ok[:, None] & col_ok[None, :])
        tl.store(merged_lse_ptr + rows, m_safe + tl.log(total), mask=row_ok)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _merge_triton(outs, lses, first_rows, num_rows):
    outs = [o.contiguous() for o in outs]
    lses = [lse.t().contiguous() for lse in lses]  # [NH, T_s]: cuDNN's and flash's own layout
    _, heads, head_dim = outs[0].shape
    out = outs[0].new_empty(num_rows, heads, head_dim)
    merged_lse = torch.empty(num_rows, heads, dtype=torch.float32, device=out.device)
    if num_rows == 0:
        return out, merged_lse
    table = [
        [o.data_ptr() for o in outs],
        [lse.data_ptr() for lse in lses],
        list(first_rows),
        [o.shape[0] for o in outs],
    ]
    # Through pinned memory: a copy from pageable memory would wait for the queued work.
    parts = torch.tensor(table, dtype=torch.int64).pin_memory().to(out.device, non_blocking=True)
    block_rows = 32
    _merge_kernel[(triton.cdiv(num_rows * heads, block_rows),)](
        parts,
        out,
        merged_lse,
        len(outs),
        num_rows,
        heads,
        head_dim,
        OUT_DTYPE=_TL_DTYPES[out.dtype],
        BLOCK_ROWS=block_rows,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    # The parts are read through raw addresses; freeing them after this returns is safe, as
    # the caching allocator hands their memory only to work queued after this kernel.
    return out, merged_lse
