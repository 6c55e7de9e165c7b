"""Local attention (sliding windows, attention chunks) and attention sinks at the attention
level, against a dense masked softmax written out here with transformers' mask rules."""

from __future__ import annotations

import pytest
import torch

from ringserve.attention import VarlenBatch, attention_with_lse
from ringserve.config import AttentionWindow
from ringserve.local_attention import chunk_pieces
from ringserve.lse_merge import add_sinks


def dense_reference(q, k, v, q_pos, k_pos, scale, sliding=None, chunk=None, sinks=None):
    """One sequence: q [Lq, NH, D] at q_pos, k/v [Lk, NKV, D] at k_pos; a query at p sees
    k <= p, p - sliding < k (sliding) and k // chunk == p // chunk (chunk), as
    transformers' masking_utils; a sink is one more logit per head with no value.
    -> (out, lse over the keys alone) in float64."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [NH, Lq, Lk]
    qp, kp = q_pos[:, None], k_pos[None, :]
    visible = kp <= qp
    if sliding is not None:
        visible &= kp > qp - sliding
    if chunk is not None:
        visible &= kp // chunk == qp // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [NH, Lq]
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], -1)
        vv = torch.cat([vv, torch.zeros_like(vv[:1])], 0)
    probs = torch.softmax(scores, -1)
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out, lse.transpose(0, 1)


def _suffix_batch(q_lens, k_lens, offsets):
    """Sequences whose keys are positions offsets[i] .. + k_lens[i] - 1, queries the last."""
    cu_q, cu_k = [0], [0]
    for a, b in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    q_pos = torch.cat([torch.arange(o + b - a, o + b) for a, b, o in zip(q_lens, k_lens, offsets)])
    k_pos = torch.cat([torch.arange(o, o + b) for b, o in zip(k_lens, offsets)])
    batch = VarlenBatch(
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        max(q_lens),
        max(k_lens),
        q_pos,
        k_pos,
        True,
        cu_q,
        cu_k,
        k_offsets=list(offsets),
    )
    return batch, q_pos, k_pos


@pytest.mark.parametrize("sliding,chunk", [(5, None), (300, None), (None, 8), (None, 7), (6, 16)], ids=str)
def test_windowed_attention_equals_the_dense_masked_softmax(sliding, chunk):
    """Fresh prompts, a chunk after a cached prefix, decode rows and keys gathered from a
    later block (k_offsets), with prompts spanning several windows or chunks, one spanning
    more than a tile of queries (_TILE)."""
    nh, nkv, d = 4, 2, 8
    q_lens, k_lens, offsets = [40, 9, 1, 300, 1], [40, 30, 23, 300, 5], [0, 0, 0, 0, 12]
    batch, q_pos, k_pos = _suffix_batch(q_lens, k_lens, offsets)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), nh, d, generator=g)
    k = torch.randn(sum(k_lens), nkv, d, generator=g)
    v = torch.randn(sum(k_lens), nkv, d, generator=g)
    window = AttentionWindow(sliding=sliding, chunk=chunk)
    out, lse = attention_with_lse(q, k, v, batch, d**-0.5, window)
    for i in range(len(q_lens)):
        qs, ks = (
            slice(batch.q_bounds[i], batch.q_bounds[i + 1]),
            slice(batch.k_bounds[i], batch.k_bounds[i + 1]),
        )
        ref_out, ref_lse = dense_reference(q[qs], k[ks], v[ks], q_pos[qs], k_pos[ks], d**-0.5, sliding, chunk)
        torch.testing.assert_close(out[qs].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qs].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_chunk_pieces_drop_chunks_before_the_first_query():
    """A chunk of 8 after 21 cached keys: the keys of chunks 0 and 1 form one piece with no
    query; then the first query's chunk (16..23) and the next (24..29)."""
    qb, kb, offs = chunk_pieces([0, 9], [0, 30], [0], 8)
    assert (qb, kb, offs) == ([0, 0, 3, 9], [0, 16, 24, 30], [0, 16, 24])


def test_sinks_join_the_softmax_denominator_only():
    """A sink per head, added after attention (and so after any LSE merge), equals a
    softmax with one more logit of value zero; a row that saw no key stays zero."""
    nh, nkv, d, n = 4, 2, 8, 12
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (nh, nkv, nkv))
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0])
    batch, q_pos, k_pos = _suffix_batch([n], [n], [0])
    for window in (AttentionWindow(), AttentionWindow(sliding=3)):
        out, lse = attention_with_lse(q, k, v, batch, d**-0.5, window)
        ref, _ = dense_reference(q, k, v, q_pos, k_pos, d**-0.5, window.sliding, sinks=sinks)
        torch.testing.assert_close(add_sinks(out, lse, sinks).double(), ref, rtol=1e-5, atol=1e-5)
    unseen = add_sinks(torch.zeros(1, nh, d), torch.full((1, nh), float("-inf")), sinks)
    assert torch.equal(unseen, torch.zeros(1, nh, d))
