"""Local attention over packed variable-length sequences, returning (output, log-sum-exp).

The log-sum-exp lets partial results over different key blocks be merged exactly
(`lse_merge.merge_partials`), which is what ring attention (context parallelism) is built on.

Shapes: q [Tq, NH, D], k and v [Tk, NKV, D], NH a multiple of NKV (grouped-query
attention); out [Tq, NH, D]; lse [Tq, NH] in float32. Sequence i owns queries
cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys cu_seqlens_k[i]:cu_seqlens_k[i+1]; a query sees
a key of its own sequence whose global position is not after its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.attention.local import chunk_pieces, masked_block, sliding_tiles
from ringserve.attention.plan import AttentionPlan, Block, plan_attention, plan_seen
from ringserve.config import FULL_ATTENTION, AttentionWindow
from ringserve.kernels.lse_merge import merge_partials


@dataclass
class VarlenBatch:
    """Where each sequence's queries and keys lie in the packed tensors, and their positions."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    q_positions: torch.Tensor  # [Tq] global token positions
    k_positions: torch.Tensor | None  # [Tk]; None where seen_keys says what each query sees
    # True when every sequence's keys are positions 0..Lk-1 and its queries the last Lq of
    # them: the bottom-right causal mask that fused kernels implement without positions.
    causal_suffix: bool = True
    # Host copies of the sequence boundaries (and positions), so planning needs no device sync.
    q_bounds: list[int] | None = None
    k_bounds: list[int] | None = None
    q_positions_host: torch.Tensor | None = None
    k_positions_host: torch.Tensor | None = None
    # Ring steps: how many of its sequence's keys (sorted by position) each query sees,
    # [Tq] int64 on the device and the host; the keys' positions are then never needed.
    seen_keys: torch.Tensor | None = None
    seen_keys_host: torch.Tensor | None = None
    # With a window: how many of those first keys each query does not see (before its
    # window), [Tq] int64 on the device and the host; it sees keys first .. seen - 1.
    first_keys: torch.Tensor | None = None
    first_keys_host: torch.Tensor | None = None
    # causal_suffix batches whose keys do not start at position 0 (pages gathered from the
    # first block a window sees): each sequence's first key position, host ints.
    k_offsets: list[int] | None = None
    _plan: AttentionPlan | None = None  # made once per batch (a ring step's batch serves every layer)

    @property
    def plannable(self) -> bool:
        return self.seen_keys_host is not None or self.q_positions_host is not None

    def plan(self) -> AttentionPlan:
        if self._plan is None:
            if self.seen_keys_host is not None:
                bounds = zip(self.q_bounds[:-1], self.q_bounds[1:])
                bounds = list(bounds)
                seen = [self.seen_keys_host[q0:q1] for q0, q1 in bounds]
                first = None
                if self.first_keys_host is not None:
                    first = [self.first_keys_host[q0:q1] for q0, q1 in bounds]
                self._plan = plan_seen(self.q_bounds, self.k_bounds, seen, first)
            else:
                self._plan = plan_attention(
                    self.q_bounds, self.k_bounds, self.q_positions_host, self.k_positions_host
                )
        return self._plan


def attention_with_lse(q, k, v, batch: VarlenBatch, scale: float, window: AttentionWindow = FULL_ATTENTION):
    """Causal attention of packed queries over packed keys, each query seeing only the keys
    its window lets it (sliding window, attention chunk); returns (out, lse)."""
    if not window.is_full:
        if batch.causal_suffix and batch.q_bounds is not None:
            return windowed_suffix_attention(q, k, v, batch, scale, window)
        if batch.first_keys is None:  # positions, not counts: the explicit mask
            return _math_varlen(q, k, v, batch, scale, window)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and batch.causal_suffix:
        # cuDNN is the fastest kernel with LSE on Hopper (about twice the flash kernel at
        # long lengths), called per sequence where some sequence has CUDNN_MIN_LEN queries
        # or more (long prompts, long chunks after a cached prefix). Batches of short
        # sequences take one flash varlen call: no per-shape plan, and one launch.
        if batch.q_bounds is not None and _long_sequences(batch.q_bounds):
            return dense_per_sequence(q, k, v, batch.q_bounds, batch.k_bounds, scale)
        return _flash_varlen(q, k, v, batch, scale)
    if not q.is_cuda and batch.causal_suffix and batch.q_bounds is not None:
        # PyTorch's flash kernel for the CPU, per sequence (every step the engine runs on a
        # CPU: prompts, chunks, decode rows); it never holds a [Lq, Lk] score matrix.
        return dense_per_sequence(q, k, v, batch.q_bounds, batch.k_bounds, scale)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and batch.plannable:
        return _planned(q, k, v, batch.plan(), batch, scale)
    return _math_varlen(q, k, v, batch, scale)


def attention_rows(q, k, v, batch: VarlenBatch, scale: float):
    """attention_with_lse for one ring step, which may return only the rows that see a key:
    (out [R, NH, D], lse [R, NH], first_row), every other query seeing nothing.

    A zigzag ring step where only the late chunk sees the other rank's keys computes and
    returns just that chunk: no zero-filled rows to write, or to read again when merging.
    """
    # cuDNN blocks on a GPU; on a CPU the same blocks through the CPU flash kernel (so the
    # ring's row runs are exercised by the CPU tests too).
    blocks_here = q.dtype in (torch.float16, torch.bfloat16) if q.is_cuda else True
    if blocks_here and batch.plannable:
        group = batch.plan().single_group()
        if group is not None:
            return (*_attend_group(q, k, v, group, scale), group[0].q0)
    return (*attention_with_lse(q, k, v, batch, scale), 0)


def _attend_group(q, k, v, group, scale: float):
    """(out, lse) of one row group of a plan: its queries over the group's blocks."""
    q0, q1 = group[0].q0, group[0].q1
    parts = [dense_block(q[q0:q1], k[b.k0 : b.k1], v[b.k0 : b.k1], b.causal, scale) for b in group]
    if len(parts) == 1:
        return parts[0]
    return merge_partials([p[0] for p in parts], [p[1] for p in parts])


def _planned(q, k, v, plan: AttentionPlan, batch: VarlenBatch, scale: float):
    """Arbitrary positions (ring steps): the plan's dense blocks, merged by LSE where a row
    group has two; one fused varlen call for a decode step."""
    if plan.decode is not None:
        return _decode_varlen(q, k, v, plan, scale)
    group = plan.single_group()
    if group is not None and (group[0].q0, group[0].q1) == (0, q.shape[0]):  # no copy
        return _attend_group(q, k, v, group, scale)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for q0, q1 in plan.unseen:
        out[q0:q1] = 0
        lse[q0:q1] = float("-inf")
    for group in plan.groups:
        q0, q1 = group[0].q0, group[0].q1
        out[q0:q1], lse[q0:q1] = _attend_group(q, k, v, group, scale)
    for q0, q1, k0, k1, visible in plan.banded:  # a window's band: one masked tile
        out[q0:q1], lse[q0:q1] = masked_block(q[q0:q1], k[k0:k1], v[k0:k1], visible, scale)
    for q0, q1, k0, k1 in plan.masked:  # keys out of order: the explicit mask
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
    return out, lse


def _decode_varlen(q, k, v, plan: AttentionPlan, scale: float):
    """One query per sequence over all its keys: one flash varlen call. Sequences with no
    key here are left out (the kernel needs every sequence to have its one query), their
    keys skipped by seqused_k."""
    layout, index = plan.decode, plan.device_tensors(q.device)
    rows = index["rows"]
    out_kept, lse_kept, *_ = torch.ops.aten._flash_attention_forward(
        q if rows is None else q[rows],
        k,
        v,
        index["cu_q"],
        index["cu_k"],  # with seqused_k, only each sequence's start is read
        1,
        max(layout.k_counts),
        0.0,
        False,  # every key of a kept sequence is visible
        False,
        scale=scale,
        seqused_k=index["k_counts"],
    )
    lse_kept = lse_kept.transpose(0, 1)  # [NH, Tq] for packed input
    if rows is None:
        return out_kept, lse_kept
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    out[rows], lse[rows] = out_kept, lse_kept
    return out, lse


def _long_sequences(q_bounds: list[int]) -> bool:
    """Whether some sequence has queries enough for cuDNN (bounded_shape_block)."""
    return max(b - a for a, b in zip(q_bounds[:-1], q_bounds[1:])) >= CUDNN_MIN_LEN


_CUDNN_GQA: bool | None = None  # whether cuDNN takes fewer K/V heads than query heads

# cuDNN builds an execution plan for every new shape (66-69 ms at each new length on an
# H100 with Llama-3-8B's heads, 41 ms on an H200, then well under 1 ms a call), so it is
# only ever shown shapes of a bounded set (bounded_shape_block): SHAPE_BITS lengths per
# octave, and keys in powers of two. Blocks with fewer than CUDNN_MIN_LEN queries or keys
# take the flash kernel, which has no per-shape cost; below that length cuDNN's lead is
# small (0.115 against 0.180 ms at 2K causal on an H200, bench/bench_prefill_kernels.py).
SHAPE_BITS = 4
CUDNN_MIN_LEN = 2048


def length_above(n: int) -> int:
    """The smallest length of the bounded set that is >= n: 2**SHAPE_BITS lengths per
    octave, so at most 1/16 above n."""
    unit = 1 << max(0, n.bit_length() - 1 - SHAPE_BITS)
    return -(-n // unit) * unit


def bounded_lengths(lo: int, hi: int) -> list[int]:
    """Every length of the bounded set in lo .. hi (the causal shapes to warm up)."""
    lengths, n = [], length_above(lo)
    while n <= hi:
        lengths.append(n)
        n = length_above(n + 1)
    return lengths


def key_pieces(n: int) -> list[int]:
    """Keys of an unmasked block as cuDNN takes them: the powers of two >= CUDNN_MIN_LEN
    that n's binary form holds, largest first (their sum; the rest goes to flash)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1 and 1 << b >= CUDNN_MIN_LEN]


def dense_block(q, k, v, causal: bool, scale: float):
    """One block with no mask, or a causal diagonal (Lq == Lk): q [Lq, NH, D], k/v [Lk, NKV, D]."""
    if not q.is_cuda:
        return _cpu_flash_block(q, k, v, causal, scale)
    if q.dtype not in (torch.float16, torch.bfloat16):
        # cuDNN's SDPA is for half precision: given float32 on an H200 it raised nothing and
        # returned garbage (NaN logits for Llama 4's chunks in float32). Explicit scores.
        return dense_block_math(q, k, v, causal, scale)
    return bounded_shape_block(q, k, v, causal, scale, _cudnn_block, _flash_block)


def bounded_shape_block(q, k, v, causal: bool, scale: float, fixed_shape_kernel, any_shape_kernel):
    """dense_block through fixed_shape_kernel (cuDNN: a plan per shape) shown only shapes
    of a bounded set, any_shape_kernel (flash) for the rest; both (q, k, v, causal, scale)
    -> (out, lse).

    - A causal diagonal is padded at the end to length_above(L): under the top-left causal
      mask no real query sees a padded key, and the padded queries' rows are dropped.
    - An unmasked block pads its queries the same way. Its keys cannot be padded (every
      query would see them): they go in pieces of the powers of two in Lk's binary form
      (key_pieces), the few left over to any_shape_kernel, merged by LSE. A chunk after
      a cached prefix then meets O(log) key shapes, whatever the prefix's length.
    """
    lq, lk = q.shape[0], k.shape[0]
    if min(lq, lk) < CUDNN_MIN_LEN:
        return any_shape_kernel(q, k, v, causal, scale)
    if causal:
        n = length_above(lq)
        out, lse = fixed_shape_kernel(_pad_rows(q, n), _pad_rows(k, n), _pad_rows(v, n), True, scale)
        return out[:lq], lse[:lq]
    padded_q = _pad_rows(q, length_above(lq))
    outs, lses, k0 = [], [], 0
    for piece in key_pieces(lk):
        out, lse = fixed_shape_kernel(padded_q, k[k0 : k0 + piece], v[k0 : k0 + piece], False, scale)
        outs.append(out[:lq])
        lses.append(lse[:lq])
        k0 += piece
    if k0 < lk:
        out, lse = any_shape_kernel(q, k[k0:], v[k0:], False, scale)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return merge_partials(outs, lses, out_dtype=q.dtype)


def warm_up_cudnn(num_heads, num_kv_heads, head_dim, dtype, device, longest_chunk: int, chunks, longest_keys):
    """Build ahead of traffic the cuDNN plans that prefill meets most: every causal length
    of the bounded set up to longest_chunk (whole prompts), and the chunk lengths `chunks`
    against every power-of-two key piece up to longest_keys (chunks after a cached
    prefix). Returns how many shapes were built; other bounded shapes are built once, when
    first met."""
    q = torch.zeros(length_above(longest_chunk), num_heads, head_dim, dtype=dtype, device=device)
    k = torch.zeros(max(q.shape[0], longest_keys), num_kv_heads, head_dim, dtype=dtype, device=device)
    shapes = 0
    for n in bounded_lengths(CUDNN_MIN_LEN, longest_chunk):
        _cudnn_block(q[:n], k[:n], k[:n], True, 1.0)
        shapes += 1
    for n in sorted({length_above(c) for c in chunks if c >= CUDNN_MIN_LEN}):
        piece = CUDNN_MIN_LEN
        while piece <= longest_keys:
            _cudnn_block(q[:n], k[:piece], k[:piece], False, 1.0)
            shapes += 1
            piece *= 2
    return shapes


def _pad_rows(x, n: int):
    """x [L, H, D] with zero rows appended up to n (x itself when L == n)."""
    return x if x.shape[0] == n else torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n - x.shape[0]))


def _cpu_flash_block(q, k, v, causal: bool, scale: float):
    """The CPU flash kernel: tiles of scores in float32 (also for bfloat16 inputs), output
    in q's dtype, LSE float32. It takes NKV < NH heads (query head h reads KV head
    h // group), so GQA needs no copy; its causal flag is top-left aligned, which is what a
    diagonal block (Lq == Lk) needs."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D] views
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qs, ks, vs, 0.0, causal, attn_mask=None, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _flash_block(q, k, v, causal: bool, scale: float):
    """The flash kernel on one sequence ([1, L, H, D], its own layout): no plan, fewer KV
    heads taken as they are; its causal mask is bottom-right aligned, the same as top-left
    for a diagonal (Lq == Lk)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, q.shape[0], k.shape[0], 0.0,
        causal, False, scale=scale,
    )  # fmt: skip
    return out[0], lse[0].transpose(0, 1)  # lse [1, NH, Lq] -> [Lq, NH]


def _cudnn_block(q, k, v, causal: bool, scale: float):
    """cuDNN's SDPA with LSE (top-left causal): the fastest kernel on Hopper at long lengths.
    Inputs are made contiguous: PyTorch keys cuDNN's plans on the strides too, and v of a
    fresh prompt is a view of the fused q/k/v projection, whose stride would be one more
    key of the plan cache (and miss the plans built at start-up)."""
    global _CUDNN_GQA
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D] views
    if _CUDNN_GQA is not False or group == 1:
        try:
            out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qs, ks, vs, None, True, 0.0, causal, False, scale=scale
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
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qs, ks, vs, None, True, 0.0, causal, False, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].reshape(q.shape[1], q.shape[0]).transpose(0, 1)


def dense_block_math(q, k, v, causal: bool, scale: float):
    """dense_block with explicit float32 scores, any device and dtype (causal: top-left aligned)."""
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    return masked_block(q, k, v, visible.tril() if causal else visible, scale)


def dense_per_sequence(q, k, v, q_bounds: list[int], k_bounds: list[int], scale: float):
    """Each sequence's queries are its last keys' positions (causal_suffix), one dense call
    or two per sequence: cuDNN on a GPU, the flash kernel on a CPU. Both causal flags are
    top-left aligned, so a chunk after a cached prefix is two calls: the prefix unmasked,
    then the chunk's own causal diagonal, merged by LSE. A single query (decode) sees all
    its keys: one unmasked call."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for i in range(len(q_bounds) - 1):
        q0, q1, k0, k1 = q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no key (a padded decode row): nothing seen, and no kernel call
            out[q0:q1], lse[q0:q1] = 0, float("-inf")
            continue
        if q1 - q0 == 1:
            group = [Block(q0, q1, k0, k1, False)]
        else:
            prefix = k1 - (q1 - q0)  # where the chunk's own keys start
            group = [Block(q0, q1, prefix, k1, True)]
            if prefix > k0:
                group.insert(0, Block(q0, q1, k0, prefix, False))
        out[q0:q1], lse[q0:q1] = _attend_group(q, k, v, group, scale)
    return out, lse


_cudnn_per_sequence = dense_per_sequence  # its name on the GPU only (bench/bench_ring_calls.py)


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


def flash_varlen_window(q, k, v, q_bounds: list[int], k_bounds: list[int], sliding: int, scale: float):
    """Causal flash varlen attention (bottom-right aligned) where each query sees only its
    last `sliding` keys: the kernel skips the key blocks outside the band."""

    def to_device(bounds):
        return torch.tensor(bounds, dtype=torch.int32).to(q.device, non_blocking=True)

    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        to_device(q_bounds),
        to_device(k_bounds),
        max(b - a for a, b in zip(q_bounds[:-1], q_bounds[1:])),
        max(b - a for a, b in zip(k_bounds[:-1], k_bounds[1:])),
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=sliding - 1,
        window_size_right=0,
    )
    return out, lse.transpose(0, 1)


def windowed_suffix_attention(q, k, v, batch, scale: float, window: AttentionWindow):
    """(out [Tq, NH, D], lse [Tq, NH]) of a causal_suffix VarlenBatch with host bounds, under
    a sliding window or attention chunks: the pieces of local.py, each on a fast kernel."""
    q_bounds, k_bounds, offsets = chunk_pieces(
        batch.q_bounds, batch.k_bounds, batch.k_offsets or [0] * (len(batch.q_bounds) - 1), window.chunk
    )
    if window.sliding is None:  # chunks alone: plain causal attention per piece
        return dense_per_sequence(q, k, v, q_bounds, k_bounds, scale)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_varlen_window(q, k, v, q_bounds, k_bounds, window.sliding, scale)
    return sliding_tiles(q, k, v, q_bounds, k_bounds, offsets, scale, window)


def _math_varlen(q, k, v, batch: VarlenBatch, scale: float, window: AttentionWindow = FULL_ATTENTION):
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
        if batch.seen_keys is not None:  # keys sorted by position: query t sees the first seen[t]
            keys = torch.arange(k1 - k0, device=q.device)
            visible = keys[None, :] < batch.seen_keys[q0:q1, None]
            if batch.first_keys is not None:  # a window: nor before its first key
                visible &= keys[None, :] >= batch.first_keys[q0:q1, None]
        else:
            q_pos, k_pos = batch.q_positions[q0:q1, None], batch.k_positions[None, k0:k1]
            visible = q_pos >= k_pos
            if not window.is_full:
                visible &= k_pos >= window.first_visible(q_pos)
        scores = scores.masked_fill(~visible, float("-inf"))
        seq_lse = torch.logsumexp(scores, dim=-1)  # [NKV, G, Lq]; -inf where nothing visible
        probs = torch.exp(scores - seq_lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
        probs = probs.nan_to_num(0.0)
        seq_out = torch.matmul(probs, vs)  # [NKV, G, Lq, D]
        out[q0:q1] = seq_out.permute(2, 0, 1, 3).reshape(q1 - q0, num_heads, head_dim).to(q.dtype)
        lse[q0:q1] = seq_lse.permute(2, 0, 1).reshape(q1 - q0, num_heads)
    return out, lse
