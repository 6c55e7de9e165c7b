"""Local attention over packed variable-length sequences, returning (output, log-sum-exp).

The log-sum-exp lets partial results over different key blocks be merged exactly
(`merge_partials`), which is what ring attention (context parallelism) is built on.

Shapes: q [Tq, NH, D], k and v [Tk, NKV, D], NH a multiple of NKV (grouped-query
attention); out [Tq, NH, D]; lse [Tq, NH] in float32. Sequence i owns queries
cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys cu_seqlens_k[i]:cu_seqlens_k[i+1]; a query sees
a key of its own sequence whose global position is not after its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VarlenBatch:
    """Where each sequence's queries and keys lie in the packed tensors, and their positions."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    q_positions: torch.Tensor  # [Tq] global token positions
    k_positions: torch.Tensor  # [Tk]
    # True when every sequence's keys are positions 0..Lk-1 and its queries the last Lq of
    # them: the bottom-right causal mask that fused kernels implement without positions.
    causal_suffix: bool = True
    # Host copies of the sequence boundaries (and positions), so planning needs no device sync.
    q_bounds: list[int] | None = None
    k_bounds: list[int] | None = None
    q_positions_host: torch.Tensor | None = None
    k_positions_host: torch.Tensor | None = None
    _plan: list | None = None  # the block plan of _segmented, made once per batch
    _decode_shaped: bool | None = None

    def decode_shaped(self) -> bool:
        """Whether every sequence has one query and some keys, none after it: then the
        bottom-right causal mask of the fused varlen kernel is exactly the mask needed."""
        if self._decode_shaped is None:
            qb, kb = self.q_bounds, self.k_bounds
            qp, kp = self.q_positions_host, self.k_positions_host
            self._decode_shaped = all(
                qb[i + 1] - qb[i] == 1
                and kb[i + 1] > kb[i]
                and int(kp[kb[i] : kb[i + 1]].max()) <= int(qp[qb[i]])
                for i in range(len(qb) - 1)
            )
        return self._decode_shaped


def attention_with_lse(q, k, v, batch: VarlenBatch, scale: float):
    """Causal attention of packed queries over packed keys; returns (out, lse)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and batch.causal_suffix:
        if batch.q_bounds is not None and batch.q_bounds == batch.k_bounds:
            # Whole prompts with no cached prefix: cuDNN's causal kernel is the fastest
            # with LSE on Hopper (about twice the flash kernel at long lengths).
            return _cudnn_per_sequence(q, k, v, batch.q_bounds, scale)
        return _flash_varlen(q, k, v, batch, scale)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and batch.q_positions_host is not None:
        if batch.decode_shaped():  # a ring step of batch-1 decode: one fused varlen call
            return _flash_varlen(q, k, v, batch, scale)
        return _segmented(q, k, v, batch, scale)
    return _math_varlen(q, k, v, batch, scale)


def _runs(positions: torch.Tensor, base: int):
    """Maximal runs of consecutive positions: [(first index, end index, first position)]."""
    if len(positions) == 0:
        return []
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(positions)]
    return [(base + a, base + b, int(positions[a])) for a, b in zip(starts, ends)]


def _plan_blocks(batch: VarlenBatch):
    """For every run of consecutive query positions: the keys every one of its queries sees
    (positions before the run), and the keys on the run's own positions (a causal diagonal).

    Entries: (q_start, q_end, full key indices or None, (k_start, k_end) or None); runs
    whose keys fit neither shape (which the engine's layouts do not make) are ("masked", ...).
    """
    plan = []
    qb, kb = batch.q_bounds, batch.k_bounds
    for i in range(len(qb) - 1):
        q_runs = _runs(batch.q_positions_host[qb[i] : qb[i + 1]], qb[i])
        k_positions = batch.k_positions_host[kb[i] : kb[i + 1]]
        for q0, q1, qp in q_runs:
            q_last = qp + (q1 - q0) - 1
            before = torch.nonzero(k_positions < qp).flatten() + kb[i]
            inside = torch.nonzero((k_positions >= qp) & (k_positions <= q_last)).flatten() + kb[i]
            diagonal = None
            if len(inside):
                k0 = int(inside[0])
                diagonal_positions = batch.k_positions_host[k0 : k0 + (q1 - q0)]
                if len(inside) != q1 - q0 or not torch.equal(
                    diagonal_positions, batch.q_positions_host[q0:q1]
                ):
                    plan.append(("masked", q0, q1, kb[i], kb[i + 1]))
                    continue
                diagonal = (k0, k0 + (q1 - q0))
            full = None
            if len(before):
                first, last = int(before[0]), int(before[-1])
                full = slice(first, last + 1) if last - first + 1 == len(before) else before
            if full is not None or diagonal is not None:
                plan.append((q0, q1, full, diagonal))
    return plan


def _segmented(q, k, v, batch: VarlenBatch, scale: float):
    """Arbitrary positions on CUDA: cuDNN on unmasked blocks, merged by LSE.

    The ring's blocks are whole chunks of positions (zigzag prefill, cached blocks), so a
    run of queries sees at most one fully visible block (its earlier keys, gathered into
    one) and one causal diagonal (its own positions): cuDNN's fastest cases, one or two
    calls a run.
    """
    if batch._plan is None:
        batch._plan = _plan_blocks(batch)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for entry in batch._plan:
        if entry[0] == "masked":
            _, q0, q1, k0, k1 = entry
            sub = VarlenBatch(
                torch.tensor([0, q1 - q0]),
                torch.tensor([0, k1 - k0]),
                q1 - q0,
                k1 - k0,
                batch.q_positions[q0:q1],
                batch.k_positions[k0:k1],
                False,
                [0, q1 - q0],
                [0, k1 - k0],
            )
            out[q0:q1], lse[q0:q1] = _math_varlen(q[q0:q1], k[k0:k1], v[k0:k1], sub, scale)
            continue
        q0, q1, full, diagonal = entry
        parts = []
        if full is not None:
            parts.append(_dense_block(q[q0:q1], k[full], v[full], False, scale))
        if diagonal is not None:
            d0, d1 = diagonal
            parts.append(_dense_block(q[q0:q1], k[d0:d1], v[d0:d1], True, scale))
        if len(parts) == 1:
            out[q0:q1], lse[q0:q1] = parts[0]
        else:
            out[q0:q1], lse[q0:q1] = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    return out, lse


_CUDNN_GQA: bool | None = None  # whether cuDNN takes fewer K/V heads than query heads


def _dense_block(q, k, v, causal: bool, scale: float):
    """One block with no mask, or a causal diagonal: q [Lq, NH, D], k/v [Lk, NKV, D]."""
    global _CUDNN_GQA
    group = q.shape[1] // k.shape[1]
    qs = q.transpose(0, 1).unsqueeze(0)
    if q.is_cuda:
        if _CUDNN_GQA is not False or group == 1:
            try:
                out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qs,
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    None,
                    True,
                    0.0,
                    causal,
                    False,
                    scale=scale,
                )
                if group > 1:
                    _CUDNN_GQA = True
                return out[0].transpose(0, 1), lse[0].reshape(q.shape[1], q.shape[0]).transpose(0, 1)
            except RuntimeError:
                if group == 1:
                    raise
                _CUDNN_GQA = False
    ks = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    vs = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qs, ks, vs, None, True, 0.0, causal, False, scale=scale
        )
    else:  # the same arithmetic in float32, for checks without a GPU
        scores = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vs.float()).to(q.dtype)
    return out[0].transpose(0, 1), lse[0].reshape(q.shape[1], q.shape[0]).transpose(0, 1)


def _cudnn_per_sequence(q, k, v, bounds: list[int], scale: float):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end], lse[start:end] = _dense_block(q[start:end], k[start:end], v[start:end], True, scale)
    return out, lse


def _flash_varlen(q, k, v, batch: VarlenBatch, scale: float):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        batch.cu_seqlens_q,
        batch.cu_seqlens_k,
        batch.max_seqlen_q,
        batch.max_seqlen_k,
        0.0,
        True,  # bottom-right aligned causal mask
        False,
        scale=scale,
    )
    # lse comes as [NH, Tq] for packed input.
    return out, lse.transpose(0, 1)


def _math_varlen(q, k, v, batch: VarlenBatch, scale: float):
    """Reference path for any device and dtype: explicit scores, float32 softmax."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], num_heads, dtype=torch.float32, device=q.device)
    q_bounds = batch.q_bounds or batch.cu_seqlens_q.tolist()
    k_bounds = batch.k_bounds or batch.cu_seqlens_k.tolist()
    for i in range(len(q_bounds) - 1):
        q0, q1, k0, k1 = q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]
        if q1 == q0:
            continue
        # [NKV, G, Lq, D] x [NKV, 1, D, Lk] -> [NKV, G, Lq, Lk]
        qs = q[q0:q1].float().view(q1 - q0, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        ks = k[k0:k1].float().permute(1, 0, 2).unsqueeze(1)
        vs = v[k0:k1].float().permute(1, 0, 2).unsqueeze(1)
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        visible = batch.q_positions[q0:q1, None] >= batch.k_positions[None, k0:k1]
        scores = scores.masked_fill(~visible, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [NKV, G, Lq]; -inf where nothing visible
        probs = torch.exp(scores - seq_lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
        probs = probs.nan_to_num(0.0)
        seq_out = torch.matmul(probs, vs)  # [NKV, G, Lq, D]
        out[q0:q1] = seq_out.permute(2, 0, 1, 3).reshape(q1 - q0, num_heads, head_dim).to(q.dtype)
        lse[q0:q1] = seq_lse.permute(2, 0, 1).reshape(q1 - q0, num_heads)
    return out, lse


def merge_partials(outs, lses):
    """Merge partial attention results over disjoint key sets by log-sum-exp.

    outs: list of [T, NH, D]; lses: list of [T, NH] float32 (-inf where a part saw no key).
    Returns (out [T, NH, D], lse [T, NH]); a query that saw no key at all gets out 0, lse -inf.
    """
    lse = torch.stack(lses)  # [S, T, NH]
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # 0 for parts with no visible key
    total = w.sum(dim=0)
    out = sum(wi.unsqueeze(-1) * o.float() for wi, o in zip(w, outs))
    out = out / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    merged_lse = m_safe + torch.log(total)  # -inf where total == 0
    return out.to(outs[0].dtype), merged_lse
