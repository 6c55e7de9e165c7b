"""Attention under a sliding window or attention chunks (`config.AttentionWindow`), for
batches whose sequences' keys are consecutive positions and whose queries are the last of
them (`VarlenBatch.causal_suffix`: fresh prompts, and the pages a paged step gathers).

Two exact rewrites keep the fast kernels and never compute over invisible keys:

- chunks: a query sees only its own chunk, so each (sequence, chunk) is a sequence of its
  own with plain causal attention (keys of chunks before the first query's are dropped);
- a sliding window W: queries in tiles, each tile against the keys its first query can
  see up to its last query (at most tile + W - 1 keys), with the band masked: work
  O(tokens x W), never O(tokens^2). On a GPU in half precision one flash varlen call with
  its own window (window_size_left = W - 1) does the same.
"""

from __future__ import annotations

import torch

from ringserve.config import AttentionWindow

_TILE = 256  # queries per masked tile of a sliding window (keys: tile + W - 1 at most)


def chunk_pieces(q_bounds, k_bounds, offsets, chunk: int | None):
    """Cut each sequence (queries q_bounds[i]:q_bounds[i+1], keys k_bounds[i]:k_bounds[i+1]
    at positions offsets[i]..) at chunk boundaries: the pieces' (q_bounds, k_bounds, offsets),
    each piece again keys at consecutive positions with its queries the last of them.

    Keys of chunks before the sequence's first query form one piece with no query, so
    the pieces still pack the keys contiguously and that prefix costs nothing."""
    if chunk is None:
        return list(q_bounds), list(k_bounds), list(offsets)
    qb, kb, offs = [q_bounds[0]], [k_bounds[0]], []
    for i, first_key in enumerate(offsets):
        q0, q1, k0, k1 = q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]
        if q1 == q0 or k1 == k0:  # nothing to cut: the sequence keeps its place
            qb.append(q1)
            kb.append(k1)
            offs.append(first_key)
            continue
        end = first_key + k1 - k0  # one past the last key's position
        first_query = end - (q1 - q0)
        start = max(first_key, first_query // chunk * chunk)  # the first query's chunk
        if start > first_key:  # keys no query here sees: a piece with no query
            qb.append(q0)
            kb.append(k0 + start - first_key)
            offs.append(first_key)
        while start < end:
            stop = min(end, (start // chunk + 1) * chunk)
            qb.append(q0 + max(0, stop - first_query))
            kb.append(k0 + stop - first_key)
            offs.append(start)
            start = stop
    return qb, kb, offs


def sliding_tiles(q, k, v, q_bounds, k_bounds, offsets, scale: float, window: AttentionWindow):
    """The sliding-window rewrite above: each sequence's queries in tiles, each against its band."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for i, first_key in enumerate(offsets):
        q0, q1, k0, k1 = q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            out[q0:q1], lse[q0:q1] = 0, float("-inf")
            continue
        first_query = first_key + (k1 - k0) - (q1 - q0)  # position of row q0
        for a in range(q0, q1, _TILE):
            b = min(q1, a + _TILE)
            p_first, p_last = first_query + a - q0, first_query + b - 1 - q0
            lo = max(first_key, window.first_visible(p_first))
            keys = slice(k0 + lo - first_key, k0 + p_last + 1 - first_key)
            q_pos = torch.arange(p_first, p_last + 1, device=q.device)
            k_pos = torch.arange(lo, p_last + 1, device=q.device)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (
                k_pos[None, :] >= window.first_visible(q_pos)[:, None]
            )
            out[a:b], lse[a:b] = masked_block(q[a:b], k[keys], v[keys], visible, scale)
    return out, lse


def masked_block(q, k, v, visible: torch.Tensor, scale: float):
    """q [Lq, NH, D] against k/v [Lk, NKV, D] where visible [Lq, Lk] (bool, on any device:
    a host mask is copied without a sync) says which keys each query sees -> (out, lse
    [Lq, NH] float32); a query that sees none gets 0 and -inf."""
    unseen = ~visible.any(1)
    out, lse = _masked_block(q, k, v, visible.to(q.device, non_blocking=True), scale)
    if bool(unseen.any()):  # no sync when the mask is on the host
        unseen = unseen.to(q.device, non_blocking=True)
        out[unseen], lse[unseen] = 0, float("-inf")
    return out, lse


def _masked_block(q, k, v, visible: torch.Tensor, scale: float):
    bias = torch.zeros(
        visible.shape, dtype=torch.float32 if q.dtype == torch.float32 else q.dtype, device=q.device
    )
    bias.masked_fill_(~visible, float("-inf"))
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
    if not q.is_cuda:
        # The CPU flash kernel takes an additive mask and fewer KV heads (GQA) as they are.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qs, ks, vs, 0.0, False, attn_mask=bias, scale=scale
        )[:2]
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    # Elsewhere: explicit float32 scores ([NH, Lq, Lk]), KV heads repeated for their groups.
    group = q.shape[1] // k.shape[1]
    scores = (qs[0].float() @ ks[0].float().repeat_interleave(group, 0).transpose(1, 2)) * scale
    scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)  # [NH, Lq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = probs @ vs[0].float().repeat_interleave(group, 0)
    return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1)
