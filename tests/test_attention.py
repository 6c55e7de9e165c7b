"""The local attention op and the log-sum-exp merge, against PyTorch's SDPA."""

import torch
import torch.nn.functional as F

from ringserve.attention import VarlenBatch, attention_with_lse, merge_partials


def reference(q, k, v, q_pos, k_pos):
    """One sequence through torch's own SDPA (GQA expanded), plus the LSE by definition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = q_pos[:, None] >= k_pos[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1).transpose(0, 1)
    return out, lse


def packed(lengths_q, lengths_k, nh=6, nkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), nh, d, generator=g)
    k = torch.randn(sum(lengths_k), nkv, d, generator=g)
    v = torch.randn(sum(lengths_k), nkv, d, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q_pos = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lengths_q, lengths_k)])
    k_pos = torch.cat([torch.arange(lk) for lk in lengths_k])
    batch = VarlenBatch(cu_q, cu_k, max(lengths_q), max(lengths_k), q_pos, k_pos)
    return q, k, v, batch


def test_varlen_matches_sdpa_per_sequence():
    lengths_q, lengths_k = [5, 1, 17, 3], [5, 30, 40, 3]  # prefill, decode, chunk after a prefix
    q, k, v, batch = packed(lengths_q, lengths_k)
    out, lse = attention_with_lse(q, k, v, batch, scale=16**-0.5)
    cq, ck = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    for i in range(len(lengths_q)):
        ref_out, ref_lse = reference(
            q[cq[i] : cq[i + 1]],
            k[ck[i] : ck[i + 1]],
            v[ck[i] : ck[i + 1]],
            batch.q_positions[cq[i] : cq[i + 1]],
            batch.k_positions[ck[i] : ck[i + 1]],
        )
        torch.testing.assert_close(out[cq[i] : cq[i + 1]], ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[cq[i] : cq[i + 1]], ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_of_random_partials_equals_full_attention():
    q, k, v, batch = packed([24], [64], seed=1)
    full, full_lse = attention_with_lse(q, k, v, batch, scale=16**-0.5)
    # Split the keys into random disjoint, non-contiguous subsets (as ring blocks are).
    owner = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))
    outs, lses = [], []
    for part in range(4):
        idx = (owner == part).nonzero().flatten()
        sub = VarlenBatch(
            batch.cu_seqlens_q,
            torch.tensor([0, len(idx)], dtype=torch.int32),
            24,
            len(idx),
            batch.q_positions,
            batch.k_positions[idx],
            causal_suffix=False,
        )
        o, lse = attention_with_lse(q, k[idx], v[idx], sub, scale=16**-0.5)
        outs.append(o)
        lses.append(lse)
    out, lse = merge_partials(outs, lses)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-5)


def test_merge_guards_parts_with_no_visible_key():
    q, k, v, batch = packed([8], [8], seed=3)
    # Keys placed after every query: nothing visible.
    hidden = VarlenBatch(
        batch.cu_seqlens_q,
        batch.cu_seqlens_k,
        8,
        8,
        batch.q_positions,
        batch.k_positions + 100,
        causal_suffix=False,
    )
    o_none, lse_none = attention_with_lse(q, k, v, hidden, scale=0.25)
    assert torch.isinf(lse_none).all() and (o_none == 0).all()
    o, lse = attention_with_lse(q, k, v, batch, scale=0.25)
    out, merged = merge_partials([o_none, o], [lse_none, lse])
    assert not out.isnan().any()
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(merged, lse)
    # All parts empty: zeros and -inf, no NaN.
    out, merged = merge_partials([o_none, o_none], [lse_none, lse_none])
    assert (out == 0).all() and torch.isinf(merged).all()


def test_block_plan_of_ring_layouts_matches_the_math_path():
    """Zigzag chunks, a cached prefix, decode tails and an odd overlap: the run-by-run plan
    (cuDNN blocks on a GPU, the same arithmetic here) equals the position-masked math path."""
    from ringserve.attention import _math_varlen, _segmented

    g = torch.Generator().manual_seed(7)
    # Sequence 0: queries are chunks 1 and 6 of 8 (zigzag), keys a cached prefix plus chunks 1, 2, 5, 6.
    q0 = torch.cat([torch.arange(100, 110), torch.arange(150, 160)])
    k0 = torch.cat([torch.arange(0, 40), torch.arange(100, 120), torch.arange(140, 160)])
    # Sequence 1: one decode token at 77 against a block holding 64..77; sequence 2: a
    # partial overlap (keys start inside the query run).
    q1, k1 = torch.tensor([77]), torch.arange(64, 78)
    q2, k2 = torch.arange(10, 20), torch.arange(15, 25)
    qs, ks = [q0, q1, q2], [k0, k1, k2]
    cu_q = torch.tensor([0, *torch.tensor([len(p) for p in qs]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([len(p) for p in ks]).cumsum(0).tolist()], dtype=torch.int32)
    q_pos, k_pos = torch.cat(qs), torch.cat(ks)
    batch = VarlenBatch(cu_q, cu_k, 20, 80, q_pos, k_pos, False, cu_q.tolist(), cu_k.tolist(), q_pos, k_pos)
    q = torch.randn(len(q_pos), 4, 8, generator=g)
    k = torch.randn(len(k_pos), 2, 8, generator=g)
    v = torch.randn(len(k_pos), 2, 8, generator=g)
    out, lse = _segmented(q, k, v, batch, 8**-0.5)
    ref_out, ref_lse = _math_varlen(q, k, v, batch, 8**-0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    masked = [p for p in batch._plan if p[0] == "masked"]
    # Only the odd overlap (keys starting inside the query run) needs a mask; the zigzag
    # chunks, the cached prefix and the decode tail run as unmasked blocks.
    assert len(masked) == 1 and masked[0][1] == len(q0) + 1


def test_decode_shaped_steps_are_recognised():
    def batch(q_pos, k_pos):
        cu_q = torch.tensor([0, *torch.tensor([len(p) for p in q_pos]).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor([len(p) for p in k_pos]).cumsum(0).tolist()], dtype=torch.int32)
        qp, kp = torch.cat(q_pos), torch.cat(k_pos)
        return VarlenBatch(cu_q, cu_k, 1, 1, qp, kp, False, cu_q.tolist(), cu_k.tolist(), qp, kp)

    none = torch.tensor([], dtype=torch.int64)
    # One query per sequence, every key at or before it: the fused kernel's mask is exact.
    assert batch([torch.tensor([9]), torch.tensor([3])], [torch.arange(10), torch.arange(2)]).decode_shaped()
    # A prefill chunk over its own keys, a sequence whose query is on another rank, a query
    # with no key here: the block path.
    assert not batch([torch.arange(4, 8)], [torch.arange(8)]).decode_shaped()
    assert not batch([torch.tensor([9]), none], [torch.arange(10), torch.arange(4)]).decode_shaped()
    assert not batch([torch.tensor([3])], [none]).decode_shaped()
