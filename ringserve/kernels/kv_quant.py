"""The FP8 KV cache's number format (`--kv-cache-dtype fp8`): float8 e4m3 with one float32
scale per layer and KV head, for K and for V.

A stored value is round(x / scale) in e4m3 (saturated at +-448), read back as value x scale.
e4m3 keeps 3 mantissa bits wherever a value lies in its normal range (2^-6 .. 448, x scale),
so the scale only has to keep keys and values inside that range: it need not follow each
token. One scale per (layer, KV head) is fixed for the life of the engine, so blocks written
once stay valid for prefix caching, preemption and every rank of a ring, and a kernel
folds it into a constant: keys' scale into the softmax scale, values' into the output.

The kernels (kernels/elementwise.py, kernels/skinny_matmul.py, attention/paged.py) quantise
as they store and dequantise as they load; the torch forms here are the reference and the
CPU path.
"""

from __future__ import annotations

import torch

from ringserve.config.names import KV_CACHE_DTYPES

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
try:  # the same bound as a Triton kernel reads it (a global a kernel reads must be constexpr)
    import triton.language as tl

    TL_FP8_MAX = tl.constexpr(FP8_MAX)
except ImportError:  # CPU builds of torch come without Triton
    TL_FP8_MAX = None


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for --kv-cache-dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, NKV, D] -> e4m3 of x / scale (scale [NKV] float32), saturated at +-448; the
    division in float32, rounded to nearest even once."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V [S, NKV, D] in e4m3, times its scale [NKV] -> dtype."""
    return (x.float() * scale[:, None]).to(dtype)


def gather_kv(k_cache, v_cache, slots: torch.Tensor, scales, dtype: torch.dtype):
    """(k, v) [K, NKV, D] in dtype of the cache rows at slots; scales: (k_scale, v_scale)
    [NKV] float32 of an FP8 cache, else None. A copy of the rows asked for, never a pass
    over the whole cache."""
    return dequantize_pair(k_cache.index_select(0, slots), v_cache.index_select(0, slots), scales, dtype)


def dequantize_pair(k, v, scales, dtype: torch.dtype):
    """(k, v) in dtype: FP8 keys and values times their scales ((k_scale, v_scale) [NKV]);
    with scales None, k and v as they are."""
    if scales is None:
        return k, v
    return dequantize_kv(k, scales[0], dtype), dequantize_kv(v, scales[1], dtype)


def fp8_supported(device: torch.device) -> bool:
    """FP8 runs on a CPU (torch's e4m3, the tests) and on GPUs whose Triton and FP8 matmuls
    take e4m3 (compute capability 8.9 and later: Ada, Hopper, Blackwell)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_device(device: torch.device, what: str) -> None:
    """A ValueError that says so where FP8 (`what`: the option asking for it) cannot run."""
    if not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"{what} needs a GPU of compute capability 8.9 or later (float8 e4m3); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
