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

_MAX_PARTS = 8  # parts one kernel launch merges; more are merged in rounds


def merge_partials(outs, lses):
    """outs: list of [T, NH, D]; lses: list of [T, NH] float32. Returns (out, lse)."""
    if triton is not None and outs[0].is_cuda:
        return _merge_triton(outs, lses)
    return _merge_torch(outs, lses)


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
        part_ptrs,  # [S] int64: addresses of the parts' outputs, each [R, D] contiguous
        lse_ptr,  # [S, R] float32
        out_ptr,  # [R, D]
        merged_lse_ptr,  # [R] float32
        num_parts,
        num_rows,
        head_dim,
        OUT_DTYPE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < num_rows
        offsets = rows[:, None] * head_dim + cols[None, :]
        in_tile = row_ok[:, None] & (cols[None, :] < head_dim)
        m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
        for s in range(num_parts):
            m = tl.maximum(m, tl.load(lse_ptr + s * num_rows + rows, mask=row_ok, other=float("-inf")))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_ROWS], tl.float32)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for s in range(num_parts):
            w = tl.exp(tl.load(lse_ptr + s * num_rows + rows, mask=row_ok, other=float("-inf")) - m_safe)
            part = tl.load(part_ptrs + s).to(tl.pointer_type(OUT_DTYPE))
            o = tl.load(part + offsets, mask=in_tile & (w > 0)[:, None], other=0.0)
            acc += w[:, None] * o.to(tl.float32)
            total += w
        acc = acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
        tl.store(out_ptr + offsets, acc.to(OUT_DTYPE), mask=in_tile)
        tl.store(merged_lse_ptr + rows, m_safe + tl.log(total), mask=row_ok)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _merge_triton(outs, lses):
    while len(outs) > _MAX_PARTS:  # merge the first parts into one, keep going
        head = _merge_triton(outs[:_MAX_PARTS], lses[:_MAX_PARTS])
        outs, lses = [head[0], *outs[_MAX_PARTS:]], [head[1], *lses[_MAX_PARTS:]]
    outs = [o.contiguous() for o in outs]
    tokens, heads, head_dim = outs[0].shape
    num_rows = tokens * heads
    lse = torch.stack(lses)  # [S, T, NH] contiguous
    out = torch.empty_like(outs[0])
    merged_lse = torch.empty(tokens, heads, dtype=torch.float32, device=out.device)
    if num_rows == 0:
        return out, merged_lse
    addresses = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64).to(
        out.device, non_blocking=True
    )
    block_rows = 16
    _merge_kernel[(triton.cdiv(num_rows, block_rows),)](
        addresses,
        lse,
        out,
        merged_lse,
        len(outs),
        num_rows,
        head_dim,
        OUT_DTYPE=_TL_DTYPES[out.dtype],
        BLOCK_ROWS=block_rows,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    # The parts are read through raw addresses; freeing them after this returns is safe, as
    # the caching allocator hands their memory only to work queued after this kernel.
    return out, merged_lse
