"""The local attention op and the log-sum-exp merge, against PyTorch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from ringserve.attention.dense import VarlenBatch, attention_with_lse, dense_block, dense_block_math
from ringserve.kernels.lse_merge import merge_partials


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


def packed(lengths_q, lengths_k, nh=6, nkv=2, d=16, seed=0, host_bounds=False, dtype=torch.float32):
    """Random packed sequences, each's queries the last of its keys. host_bounds: with the
    host copies of the boundaries the engine passes (which the per-sequence paths need)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), nh, d, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), nkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), nkv, d, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q_pos = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lengths_q, lengths_k)])
    k_pos = torch.cat([torch.arange(lk) for lk in lengths_k])
    batch = VarlenBatch(cu_q, cu_k, max(lengths_q), max(lengths_k), q_pos, k_pos)
    if host_bounds:
        batch.q_bounds, batch.k_bounds = cu_q.tolist(), cu_k.tolist()
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


def test_merge_of_parts_holding_some_rows_equals_full_attention():
    """Parts may hold only a run of rows (a ring step where only some queries see the
    keys); the rows a part does not hold count as unseen by it."""
    q, k, v, batch = packed([24], [64], seed=4)
    full, full_lse = attention_with_lse(q, k, v, batch, scale=16**-0.5)

    def part(rows: slice, keys: slice):
        n_keys = keys.stop - keys.start
        sub = VarlenBatch(
            torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
            torch.tensor([0, n_keys], dtype=torch.int32),
            rows.stop - rows.start,
            n_keys,
            batch.q_positions[rows],
            batch.k_positions[keys],
            causal_suffix=False,
        )
        return attention_with_lse(q[rows], k[keys], v[keys], sub, scale=16**-0.5)

    # Every query (positions 40..63) sees keys 0..39; keys 40..63 are split by query rows.
    parts = [
        part(slice(0, 24), slice(0, 40)),
        part(slice(0, 12), slice(40, 64)),
        part(slice(12, 24), slice(40, 64)),
    ]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts], [0, 0, 12], 24)
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


def _positions_batch(q_pos: list, k_pos: list) -> VarlenBatch:
    cu_q = torch.tensor([0, *torch.tensor([len(p) for p in q_pos]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([len(p) for p in k_pos]).cumsum(0).tolist()], dtype=torch.int32)
    qp, kp = torch.cat(q_pos), torch.cat(k_pos)
    return VarlenBatch(
        cu_q,
        cu_k,
        1,
        1,
        qp,
        kp,
        False,
        cu_q.tolist(),
        cu_k.tolist(),
        q_positions_host=qp,
        k_positions_host=kp,
    )


def _planned_equals_math(batch: VarlenBatch, seed: int = 7):
    """The plan's dense blocks (cuDNN on a GPU, the same arithmetic here) against the
    position-masked math path."""
    from ringserve.attention.dense import _math_varlen, _planned

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(batch.q_positions), 4, 8, generator=g)
    k = torch.randn(len(batch.k_positions), 2, 8, generator=g)
    v = torch.randn(len(batch.k_positions), 2, 8, generator=g)
    out, lse = _planned(q, k, v, batch.plan(), batch, 8**-0.5)
    ref_out, ref_lse = _math_varlen(q, k, v, batch, 8**-0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_block_plan_of_irregular_layouts_matches_the_math_path():
    # Sequence 0: queries are chunks 1 and 6 of 8 (zigzag), keys a cached prefix plus
    # chunks 1, 2, 5, 6; sequence 1: one decode token at 77 against a block holding
    # 64..77; sequence 2: keys starting inside the query run; sequence 3: keys out of order.
    batch = _positions_batch(
        [
            torch.cat([torch.arange(100, 110), torch.arange(150, 160)]),
            torch.tensor([77]),
            torch.arange(10, 20),
            torch.arange(5, 9),
        ],
        [
            torch.cat([torch.arange(0, 40), torch.arange(100, 120), torch.arange(140, 160)]),
            torch.arange(64, 78),
            torch.arange(15, 25),
            torch.tensor([6, 2, 8, 0]),
        ],
    )
    _planned_equals_math(batch)
    plan = batch.plan()
    assert plan.masked == [(31, 35, 104, 108)]  # only the unsorted keys need the explicit mask
    # Each zigzag chunk: the cached keys before it unmasked, then its diagonal; the decode
    # token: one block; sequence 2: five queries see nothing, then a diagonal.
    assert [len(g) for g in plan.groups] == [2, 2, 1, 1]
    assert plan.unseen == [(21, 26)]


def test_every_zigzag_ring_step_is_one_call():
    """A prefill split 2N ways: each (query rank, key rank) step is a single dense call, and
    the ring's plan (made from key counts) is the plan of the keys' real positions."""
    from helpers import ring_step

    block, cp = 4, 4
    for tokens in (96, 90):  # 3 blocks a chunk; and a length that is not a multiple of 2N blocks
        step, _, key_positions = ring_step([0], [tokens], block, cp)
        for q_rank in range(cp):
            for k_rank in range(cp):
                batch = step.varlen(q_rank, k_rank, "cpu")
                by_positions = _positions_batch(
                    [step.positions[step.owners == q_rank]], [key_positions[0][k_rank]]
                )
                assert batch.plan() == by_positions.plan(), (q_rank, k_rank)
                _planned_equals_math(by_positions, seed=q_rank * cp + k_rank)
                if tokens == 96:
                    assert sum(len(g) for g in batch.plan().groups) == 1, (q_rank, k_rank)


def test_decode_steps_are_planned_as_one_fused_call():
    none = torch.tensor([], dtype=torch.int64)
    # One query per sequence over all its keys; a sequence whose query is on another rank;
    # a query with no key here: one fused call over the two sequences that have both.
    batch = _positions_batch(
        [torch.tensor([9]), none, torch.tensor([3]), torch.tensor([5])],
        [torch.arange(10), torch.arange(4), none, torch.arange(2, 6)],
    )
    layout = batch.plan().decode
    assert layout.rows == [0, 2] and layout.k_starts == [0, 14] and layout.k_counts == [10, 4]
    # A prefill chunk over its own keys, a query before some of its keys: the block plan.
    assert _positions_batch([torch.arange(4, 8)], [torch.arange(8)]).plan().decode is None
    assert _positions_batch([torch.tensor([3])], [torch.arange(5)]).plan().decode is None


def test_chunks_after_a_cached_prefix_as_dense_blocks():
    """The GPU path for long chunks after a prefix (the prefix unmasked, the chunk's causal
    diagonal, merged by LSE; here the same blocks in float32) equals the varlen reference."""
    from ringserve.attention.dense import dense_per_sequence

    q, k, v, batch = packed([9, 12, 5], [30, 12, 19], seed=5)  # after a prefix, a whole prompt, after one
    out, lse = dense_per_sequence(q, k, v, batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist(), 16**-0.5)
    ref_out, ref_lse = attention_with_lse(q, k, v, batch, scale=16**-0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def float64_reference(q, k, v, lengths_q, lengths_k, scale):
    """Softmax attention in float64 by its definition, per sequence, each sequence's queries
    its last keys' positions (the bottom-right causal mask); GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k):
        qs = q[q0 : q0 + lq].double()
        ks = k[k0 : k0 + lk].double().repeat_interleave(group, 1)
        vs = v[k0 : k0 + lk].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        visible = torch.arange(lk - lq, lk)[:, None] >= torch.arange(lk)[None, :]
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [NH, Lq]
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), vs))
        lses.append(lse.transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses)


CPU_LAYOUTS = {
    # (query lengths, key lengths) per sequence: each sequence's queries are its last keys.
    "whole_prompts": ([37, 5, 130], [37, 5, 130]),
    "chunks_after_a_prefix": ([9, 64, 3], [30, 100, 4]),
    "decode_rows": ([1, 1, 1, 1], [40, 1, 7, 129]),
    "mixed_step": ([1, 17, 1, 23, 2], [50, 17, 3, 60, 2]),
    # past the CPU kernel's query and key tiles, and a chunk longer than its prefix
    "long": ([600, 300], [1300, 330]),
}


@pytest.mark.parametrize("layout", list(CPU_LAYOUTS))
@pytest.mark.parametrize("nh,nkv", [(6, 2), (4, 4), (8, 1)])
def test_cpu_flash_path_matches_math_and_float64(layout, nh, nkv, monkeypatch):
    """The engine's CPU batches (causal suffix, host bounds) go through the CPU flash kernel
    per sequence; it equals the position-masked math path and a float64 softmax."""
    import ringserve.attention.dense as attention

    lengths_q, lengths_k = CPU_LAYOUTS[layout]
    scale = 32**-0.5
    q, k, v, batch = packed(lengths_q, lengths_k, nh=nh, nkv=nkv, d=32, seed=11, host_bounds=True)
    ref_out, ref_lse = attention._math_varlen(q, k, v, batch, scale)

    def not_here(*args):
        raise AssertionError("the CPU fast path fell back to the math path")

    monkeypatch.setattr(attention, "_math_varlen", not_here)
    out, lse = attention.attention_with_lse(q, k, v, batch, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    exact_out, exact_lse = float64_reference(q, k, v, lengths_q, lengths_k, scale)
    torch.testing.assert_close(out.double(), exact_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), exact_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["whole_prompts", "chunks_after_a_prefix", "mixed_step"])
def test_cpu_flash_path_in_bfloat16(layout):
    """bfloat16 inputs: output in bfloat16, LSE in float32, both within bfloat16's rounding
    of the float64 softmax over the same (rounded) inputs."""
    lengths_q, lengths_k = CPU_LAYOUTS[layout]
    q, k, v, batch = packed(lengths_q, lengths_k, d=32, seed=12, host_bounds=True, dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, batch, 32**-0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact_out, exact_lse = float64_reference(q, k, v, lengths_q, lengths_k, 32**-0.5)
    torch.testing.assert_close(out.double(), exact_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), exact_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_block_math_equals_the_flash_kernel(causal):
    """The explicit-score block that float32 takes on a GPU (cuDNN is half precision only)
    equals the CPU flash kernel's block, GQA included."""
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    ref_out, ref_lse = dense_block(q, k, v, causal, 0.25)
    out, lse = dense_block_math(q, k, v, causal, 0.25)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
