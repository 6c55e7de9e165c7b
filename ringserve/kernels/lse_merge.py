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


def merge_partials(outs, lses, first_rows=None, num_rows=None, out_dtype=None):
    """outs: list of [T_s, NH, D]; lses: list of [T_s, NH] float32. Returns (out, lse) for
    num_rows queries, part s holding rows first_rows[s] : first_rows[s] + T_s (default: all
    parts hold every row); rows a part does not hold count as unseen by it. out_dtype:
    the output's (default: the last part's; float32 keeps a running merge exact)."""
    if first_rows is None:
        first_rows, num_rows = [0] * len(outs), outs[0].shape[0]
    if triton is not None and outs[0].is_cuda:
        return _merge_triton(outs, lses, first_rows, num_rows, out_dtype)
    out, lse = _merge_torch(*_full_rows(outs, lses, first_rows, num_rows))
    return out.to(out_dtype or outs[-1].dtype), lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The attention output once each head's sink logit joins the softmax denominator (and
    nothing else: a sink has no value), after every partial is merged.

    out [T, NH, D] and lse [T, NH] (float32) over all the keys, sinks [NH] (the heads this
    rank holds): the sink is one more part with LSE `sink` and output 0, so
    out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink); a query that saw
    no key (lse -inf) gets 0."""
    if sinks is None:
        return out
    weight = torch.sigmoid(lse - sinks.float()[None, :])  # [T, NH]
    return (out.float() * weight[:, :, None]).to(out.dtype)


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


_SLOTS = 8  # parts one kernel launch takes, as arguments; more are merged in rounds

if triton is not None:

    @triton.jit
    def _held(first, count, token, row_ok):
        """Which rows a part holds, and their index within it."""
        local = token - first
        return row_ok & (local >= 0) & (local < count), local

    @triton.jit
    def _part_lse(lse_ptr, first, count, token, head, row_ok):
        held, local = _held(first, count, token, row_ok)
        return tl.load(lse_ptr + head * count + local, mask=held, other=float("-inf"))

    @triton.jit
    def _add_part(
        acc,
        total,
        m_safe,
        out_ptr,
        lse_ptr,
        first,
        count,
        token,
        head,
        row_ok,
        cols,
        col_ok,
        num_heads,
        head_dim,
    ):
        held, local = _held(first, count, token, row_ok)
        w = tl.exp(tl.load(lse_ptr + head * count + local, mask=held, other=float("-inf")) - m_safe)
        offsets = ((local * num_heads + head) * head_dim)[:, None] + cols[None, :]
        o = tl.load(out_ptr + offsets, mask=(held & (w > 0))[:, None] & col_ok[None, :], other=0.0)
        return acc + w[:, None] * o.to(tl.float32), total + w

    @triton.jit(
        do_not_specialize=[
            "f0",
            "f1",
            "f2",
            "f3",
            "f4",
            "f5",
            "f6",
            "f7",
            "c0",
            "c1",
            "c2",
            "c3",
            "c4",
            "c5",
            "c6",
            "c7",
            "num_tokens",
        ]
    )
    def _merge_kernel(
        # Part s: output o_s [c_s, NH, D] contiguous, LSE l_s [NH, c_s] contiguous (cuDNN's and
        # flash's own layout), holding rows f_s : f_s + c_s. Slots past NUM_PARTS are unused.
        o0,
        o1,
        o2,
        o3,
        o4,
        o5,
        o6,
        o7,
        l0,
        l1,
        l2,
        l3,
        l4,
        l5,
        l6,
        l7,
        f0,
        f1,
        f2,
        f3,
        f4,
        f5,
        f6,
        f7,
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        out_ptr,  # [T, NH, D]
        merged_lse_ptr,  # [T, NH] float32
        num_tokens,
        num_heads,
        head_dim,
        NUM_PARTS: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # row = token * NH + head; 64-bit, as a rank's share of a 1M-token prompt passes 2^31 values
        rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < num_tokens * num_heads
        token, head = rows // num_heads, rows % num_heads
        col_ok = cols < head_dim
        # Unrolled over the slots in use (NUM_PARTS is known when compiling).
        m = _part_lse(l0, f0, c0, token, head, row_ok)
        if NUM_PARTS > 1:
            m = tl.maximum(m, _part_lse(l1, f1, c1, token, head, row_ok))
        if NUM_PARTS > 2:
            m = tl.maximum(m, _part_lse(l2, f2, c2, token, head, row_ok))
        if NUM_PARTS > 3:
            m = tl.maximum(m, _part_lse(l3, f3, c3, token, head, row_ok))
        if NUM_PARTS > 4:
            m = tl.maximum(m, _part_lse(l4, f4, c4, token, head, row_ok))
        if NUM_PARTS > 5:
            m = tl.maximum(m, _part_lse(l5, f5, c5, token, head, row_ok))
        if NUM_PARTS > 6:
            m = tl.maximum(m, _part_lse(l6, f6, c6, token, head, row_ok))
        if NUM_PARTS > 7:
            m = tl.maximum(m, _part_lse(l7, f7, c7, token, head, row_ok))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        total = tl.zeros([BLOCK_ROWS], tl.float32)
        acc, total = _add_part(
            acc, total, m_safe, o0, l0, f0, c0, token, head, row_ok, cols, col_ok, num_heads, head_dim
        )
        if NUM_PARTS > 1:
            acc, total = _add_part(
                acc, total, m_safe, o1, l1, f1, c1, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 2:
            acc, total = _add_part(
                acc, total, m_safe, o2, l2, f2, c2, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 3:
            acc, total = _add_part(
                acc, total, m_safe, o3, l3, f3, c3, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 4:
            acc, total = _add_part(
                acc, total, m_safe, o4, l4, f4, c4, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 5:
            acc, total = _add_part(
                acc, total, m_safe, o5, l5, f5, c5, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 6:
            acc, total = _add_part(
                acc, total, m_safe, o6, l6, f6, c6, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        if NUM_PARTS > 7:
            acc, total = _add_part(
                acc, total, m_safe, o7, l7, f7, c7, token, head, row_ok, cols, col_ok, num_heads, head_dim
            )
        acc = acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
        out_offsets = (rows * head_dim)[:, None] + cols[None, :]
        tl.store(
            out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
        )
        tl.store(merged_lse_ptr + rows, m_safe + tl.log(total), mask=row_ok)


def _merge_triton(outs, lses, first_rows, num_rows, out_dtype=None):
    while len(outs) > _SLOTS:  # merge the first parts into one (kept in float32), then the rest
        head_out, head_lse = _merge_triton(
            outs[:_SLOTS], lses[:_SLOTS], first_rows[:_SLOTS], num_rows, torch.float32
        )
        outs, lses = [head_out, *outs[_SLOTS:]], [head_lse, *lses[_SLOTS:]]
        first_rows = [0, *first_rows[_SLOTS:]]
    outs = [o.contiguous() for o in outs]
    lses = [lse.t().contiguous() for lse in lses]  # [NH, T_s]: cuDNN's and flash's own layout
    _, heads, head_dim = outs[0].shape
    out_dtype = out_dtype or outs[-1].dtype  # the parts' dtype (the first may be a float32 round)
    out = torch.empty(num_rows, heads, head_dim, dtype=out_dtype, device=outs[0].device)
    merged_lse = torch.empty(num_rows, heads, dtype=torch.float32, device=out.device)
    if num_rows == 0:
        return out, merged_lse
    unused = _SLOTS - len(outs)
    # Parts go in as kernel arguments: no table to copy to the device, so nothing waits.
    block_rows = 32
    _merge_kernel[(triton.cdiv(num_rows * heads, block_rows),)](
        *outs,
        *[outs[0]] * unused,
        *lses,
        *[lses[0]] * unused,
        *first_rows,
        *[0] * unused,
        *[o.shape[0] for o in outs],
        *[0] * unused,
        out,
        merged_lse,
        num_rows,
        heads,
        head_dim,
        NUM_PARTS=len(outs),
        BLOCK_ROWS=block_rows,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, merged_lse
