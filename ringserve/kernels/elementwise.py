"""Fused element-wise kernels of the decoder layer: RMSNorm (with the residual add) and RoPE.

Decode is launch-bound: the torch forms below take several kernels and float32
temporaries each (cast, square, mean, rsqrt, scale, cast, multiply; cat and neg for the
rotation). On CUDA one Triton launch reads its inputs once and writes its outputs once.
The torch forms are the reference (Hugging Face's arithmetic, step by step) and run
elsewhere; the Triton ones reproduce their roundings (sum, normalised value, products
rounded to the input dtype where HF rounds them), accumulating in float32.
"""

from __future__ import annotations

import torch

from ringserve.kernels.kv_quant import TL_FP8_MAX as FP8_MAX
from ringserve.kernels.kv_quant import quantize_kv
from ringserve.kernels.pdl import launch_options

try:
    import triton
    import triton.language as tl

    from ringserve.kernels.pdl import wait_for_previous
except ImportError:  # CPU builds of torch come without Triton
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., C]; any strides but the last). pdl: launched
    with programmatic dependent launch where the GPU has it (ringserve.kernels.pdl), here and below."""
    if _use_triton(x):
        return _rms_norm_triton(x, None, weight, eps, pdl)[0]
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True):
    """(rms_norm(x + residual), x + residual) for x, residual [T, C]; the sum is rounded to
    x's dtype before it is normalised, as in HF's `hidden = residual + hidden; norm(hidden)`."""
    if _use_triton(x):
        return _rms_norm_triton(x, residual, weight, eps, pdl)
    total = residual + x
    return _rms_norm_torch(total, weight, eps), total


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF RoPE (rotate_half convention) of q [T, NH, D] and k [T, NKV, D]; cos, sin [T, 1, D]
    in q's dtype, their two halves equal. Returns new contiguous (q, k)."""
    if _use_triton(q):
        return _rotary_triton(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots, pdl: bool = True, kv_scales=None):
    """rotary_qk(q, k, cos, sin), and the rotated k with v stored to the cache at slots (as
    store_kv, kv_scales too): on CUDA one launch for the layer's RoPE and KV write. Returns
    (q, k) rotated."""
    if _use_triton(q):
        return _rotary_triton(q, k, cos, sin, (v, k_cache, v_cache, slots, kv_scales), pdl)
    q, k = rotary_qk(q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slots, kv_scales)
    return q, k


def grouped_mm_usable(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether experts of this shape run as PyTorch's grouped matmul (private, no public
    equivalent yet), reading their token counts on the device: bfloat16 on an sm90+ GPU,
    hidden and intermediate sizes 16-aligned. Elsewhere they run one by one, the counts read
    on the host (a sync, which no CUDA graph can hold)."""
    return (
        hasattr(torch, "_grouped_mm")
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] >= 9
        and hidden % 16 == 0
        and intermediate % 16 == 0
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate columns, then up) -> [T, I]: HF's
    `act_fn(gate_proj(x)) * up_proj(x)`, each result rounded to the input dtype."""
    if _use_triton(gate_up):
        return _silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # In place into silu's output: one [T, I] temporary fewer per layer.
    return torch.nn.functional.silu(gate).mul_(up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up [T, 2I] -> [T, I]: HF's
    `gelu_pytorch_tanh` MLP (Gemma). Torch ops on every device (no fused kernel yet)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def unit_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim of x: normalised in float32, times (1 + weight) in
    float32, rounded to x's dtype once at the end (Llama's rounds before the weight).
    Torch ops on every device (no fused kernel yet)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def store_kv(k, v, k_cache, v_cache, slots, kv_scales=None) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for k, v [T, NKV, D] (each token's
    heads contiguous; v may be a view into the fused qkv output), caches [S, NKV, D].
    kv_scales: (k_scale, v_scale) [NKV] float32 of an FP8 cache, which stores k / k_scale
    and v / v_scale in e4m3 (kernels/kv_quant.py)."""
    if _use_triton(k):
        return _store_kv_triton(k, v, k_cache, v_cache, slots, kv_scales)
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales[0]), quantize_kv(v, kv_scales[1])
    k_cache[slots] = k
    v_cache[slots] = v


# ---- torch references (HF's code) ----


def _rms_norm_torch(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


# ---- Triton ----


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _rms_norm_triton(x, residual, weight, eps, pdl=True):
    """x [T, C] or [T, heads, C], read in place at its strides (q_norm reads the heads
    straight out of the fused qkv output); residual [T, C]. Outputs are contiguous."""
    shape, cols = x.shape, x.shape[-1]
    if x.dim() not in (2, 3):
        x = x.reshape(-1, cols)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Row r of x is (r // inner, r % inner) at strides (stride_outer, stride_inner).
    inner = x.shape[1] if x.dim() == 3 else 1
    stride_inner = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    if has_residual:
        residual = residual.reshape(-1, cols)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        total = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        residual, total = x, out  # not read: HAS_RESIDUAL is off
    rows = out.numel() // max(cols, 1)
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(cols)
    launch = launch_options(x, pdl)
    _rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        out,
        total,
        inner,
        x.stride(0),
        stride_inner,
        residual.stride(0),
        cols,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        PDL=bool(launch),
        num_warps=_num_warps(block),
        **launch,
    )
    return out, total


def _rotary_triton(q, k, cos, sin, store=None, pdl=True):
    """store: (v, k_cache, v_cache, slots) to also write the rotated k and v to the cache."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    kv_scales = None
    if store is not None:
        v, k_cache, v_cache, slots, kv_scales = store
        if v.stride(2) != 1 or v.stride(1) != head_dim:
            v = v.contiguous()
    else:  # not written: STORE is off
        v, k_cache, v_cache, slots = k, k_out, k_out, cos
    k_scale, v_scale = kv_scales if kv_scales is not None else (cos, cos)  # read only if QUANT
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_q, block_k = triton.next_power_of_2(num_q), triton.next_power_of_2(num_k)
    launch = launch_options(q, pdl)
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q_out, k_out, v, k_cache, v_cache, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), v.stride(0),
        k_cache.stride(0), v_cache.stride(0), num_q, num_k, half,
        STORE=store is not None, QUANT=kv_scales is not None, BLOCK_Q=block_q, BLOCK_K=block_k,
        BLOCK_D=block_d, BLOCK_V=triton.next_power_of_2(2 * block_d), PDL=bool(launch),
        num_warps=_num_warps(max(block_q, block_k) * block_d), **launch,
    )  # fmt: skip
    return q_out, k_out


def _silu_mul_triton(gate_up):
    tokens, width = gate_up.shape
    half = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(tokens, half, dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(half, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), half, BLOCK=block, num_warps=4
    )
    return out


def _store_kv_triton(k, v, k_cache, v_cache, slots, kv_scales=None):
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    k_scale, v_scale = kv_scales if kv_scales is not None else (k, v)  # read only if QUANT
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, k_scale, v_scale, k.stride(0), v.stride(0), k_cache.stride(0),
        v_cache.stride(0), heads, head_dim, QUANT=kv_scales is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_num_warps(block_h * block_d),
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, half, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * stride_x + half + cols, mask=ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # silu, rounded as F.silu rounds
        tl.store(
            out_ptr + t * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=ok
        )

    @triton.jit
    def _to_cache(x, scale_ptr, head, head_ok, cache_ptr, QUANT: tl.constexpr):
        """x [BLOCK_H, ...] (rows: KV heads) as a cache stores it: as is, or (QUANT) e4m3 of
        x / its head's scale, saturated (kernels/kv_quant.quantize_kv)."""
        if QUANT:
            scale = tl.load(scale_ptr + head, mask=head_ok, other=1.0)
            x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -FP8_MAX, FP8_MAX)
        return x.to(cache_ptr.dtype.element_ty)

    # slots [G, T]: KV group g's row starts 16-byte aligned only where g * T is even, so no
    # variant is compiled for it (one per parity of a step's token count otherwise).
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr, v_scale_ptr, stride_k, stride_v,
        stride_kc, stride_vc, heads, head_dim, QUANT: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per new token: its K and V rows (all heads) to its cache slot.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        h_ok = h < heads
        cols = h[:, None] * head_dim + tl.arange(0, BLOCK_D)[None, :]
        ok = h_ok[:, None] & (tl.arange(0, BLOCK_D) < head_dim)[None, :]
        k = _to_cache(tl.load(k_ptr + t * stride_k + cols, mask=ok), k_scale_ptr, h, h_ok, k_cache_ptr, QUANT)
        tl.store(k_cache_ptr + slot * stride_kc + cols, k, mask=ok)
        v = _to_cache(tl.load(v_ptr + t * stride_v + cols, mask=ok), v_scale_ptr, h, h_ok, v_cache_ptr, QUANT)
        tl.store(v_cache_ptr + slot * stride_vc + cols, v, mask=ok)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # row r = (r // inner, r % inner) at those strides, C contiguous
        res_ptr,  # [rows, C] at res_stride
        w_ptr,  # [C]
        out_ptr,  # [rows, C] contiguous
        total_ptr,  # [rows, C] contiguous: x + residual
        inner,
        stride_outer,
        stride_inner,
        res_stride,
        cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)  # 64-bit: rows * C passes 2^31 in long prefills
        c = tl.arange(0, BLOCK)
        ok = c < cols
        x = tl.load(
            x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner + c, mask=ok, other=0.0
        )
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + c, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(total_ptr.dtype.element_ty)  # HF adds in x's dtype
            tl.store(total_ptr + row * cols + c, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / cols + eps)
        normed = (xf * rstd).to(out_ptr.dtype.element_ty)  # HF casts back before the weight
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
        tl.store(
            out_ptr + row * cols + c,
            (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=ok,
        )

    @triton.jit
    def _rotate_heads(
        src, head_stride, dst, num_heads, half, cos, sin, d, d_ok, dst2, dst2_scale, BLOCK_H: tl.constexpr,
        TO_DST2: tl.constexpr, QUANT: tl.constexpr,
    ):  # fmt: skip
        """One token's heads [H, 2 * half] -> dst contiguous (and dst2 with TO_DST2: a cache
        slot, in e4m3 of x / dst2_scale[head] with QUANT). HF: x * cos + rotate_half(x) *
        sin, each product and the sum rounded to x's dtype."""
        h = tl.arange(0, BLOCK_H)
        ok = (h < num_heads)[:, None] & d_ok[None, :]
        src_off = h[:, None] * head_stride + d[None, :]
        x1 = tl.load(src + src_off, mask=ok, other=0.0)
        x2 = tl.load(src + src_off + half, mask=ok, other=0.0)
        dt = x1.dtype
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        c, s = cos[None, :], sin[None, :]
        # rotate_half(x) = (-x2, x1): first half x1 c - x2 s, second half x2 c + x1 s
        lo = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
        hi = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
        dst_off = h[:, None] * (2 * half) + d[None, :]
        tl.store(dst + dst_off, lo.to(dt), mask=ok)
        tl.store(dst + dst_off + half, hi.to(dt), mask=ok)
        if TO_DST2:
            h_ok = h < num_heads
            tl.store(dst2 + dst_off, _to_cache(lo.to(dt), dst2_scale, h, h_ok, dst2, QUANT), mask=ok)
            tl.store(dst2 + dst_off + half, _to_cache(hi.to(dt), dst2_scale, h, h_ok, dst2, QUANT), mask=ok)

    @triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # as _store_kv_kernel's
    def _rotary_kernel(
        q_ptr,  # [T, NH, D], last dim contiguous (a view of the fused qkv output is fine)
        k_ptr,  # [T, NKV, D]
        cos_ptr,  # [T, D] (both halves equal: only the first is read)
        sin_ptr,
        q_out,  # [T, NH, D] contiguous
        k_out,  # [T, NKV, D] contiguous
        v_ptr,  # STORE: [T, NKV, D], each token's heads contiguous
        k_cache,  # STORE: [S, NKV, D], each slot's heads contiguous
        v_cache,
        slots_ptr,  # STORE: [T] each token's cache slot
        k_scale_ptr,  # QUANT: [NKV] float32, an FP8 cache's scales (kernels/kv_quant.py)
        v_scale_ptr,
        q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_stride_t, sin_stride_t, v_stride_t,
        k_cache_stride, v_cache_stride, num_q, num_k, half,
        STORE: tl.constexpr, QUANT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        wait_for_previous(PDL)
        t = tl.program_id(0).to(tl.int64)  # one token: all its q and k heads (and its v)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < half
        cos = tl.load(cos_ptr + t * cos_stride_t + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * sin_stride_t + d, mask=d_ok, other=0.0).to(tl.float32)
        row = num_k * 2 * half
        slot = t
        if STORE:
            slot = tl.load(slots_ptr + t).to(tl.int64)
        _rotate_heads(
            q_ptr + t * q_stride_t, q_stride_h, q_out + t * num_q * 2 * half, num_q, half, cos, sin, d, d_ok,
            q_out, k_scale_ptr, BLOCK_Q, False, False,
        )  # fmt: skip
        _rotate_heads(
            k_ptr + t * k_stride_t, k_stride_h, k_out + t * row, num_k, half, cos, sin, d, d_ok,
            k_cache + slot * k_cache_stride, k_scale_ptr, BLOCK_K, STORE, QUANT,
        )  # fmt: skip
        if STORE:  # v [NKV, D] as is, each head's D contiguous
            h = tl.arange(0, BLOCK_K)
            h_ok = h < num_k
            dv = tl.arange(0, BLOCK_V)
            c = h[:, None] * (2 * half) + dv[None, :]
            ok = h_ok[:, None] & (dv < 2 * half)[None, :]
            x = _to_cache(tl.load(v_ptr + t * v_stride_t + c, mask=ok), v_scale_ptr, h, h_ok, v_cache, QUANT)
            tl.store(v_cache + slot * v_cache_stride + c, x, mask=ok)
