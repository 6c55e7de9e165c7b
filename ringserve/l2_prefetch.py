"""A weight brought into the GPU's L2 cache while kernels that leave the memory idle run.

Why: a decode step is a chain of weight reads (the matmuls, near the memory's bandwidth)
and of short kernels that hardly touch memory (RoPE, the KV store, attention over a short
context, its split merge: ~12 us a layer on an H200 for Llama-3-8B at batch 1). While the
latter run, a side stream fetches the next matmul's weight (o_proj's, 32 MiB) into L2, and
the matmul then reads it from there. Measured in bench/bench_decode_chain.py --attention.

The prefetch kernel issues one `prefetch.global.L2::evict_last` per 128-byte line: nothing
comes back to the SM, so a few programs keep the whole range in flight.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

_LINE = 128  # bytes of an L2 line
_LINES_PER_STEP = 512  # lines one program requests per loop step (4 per thread)
_PROGRAMS = 64  # about the multiprocessors decode attention leaves idle at batch 1


def l2_prefetcher(device: torch.device, max_tokens: int) -> L2Prefetcher | None:
    """The device's prefetcher; None off CUDA or without Triton."""
    return L2Prefetcher(device, max_tokens) if device.type == "cuda" and triton is not None else None


class L2Prefetcher:
    """The side stream of one device's prefetches, and where they pay: steps of at most
    `max_tokens` tokens (decode; a prefill's matmuls are compute-bound) and weights that fit
    in half the L2 (the rest holds what the running kernels read)."""

    def __init__(self, device: torch.device, max_tokens: int):
        self.stream = torch.cuda.Stream(device)
        self.max_bytes = torch.cuda.get_device_properties(device).L2_cache_size // 2
        self.max_tokens = max_tokens

    @contextmanager
    def overlapping(self, weight: torch.Tensor, tokens: int):
        """Runs the block on the current stream while weight is fetched into L2 on the side
        stream; the current stream waits for the fetch at the block's end (so a CUDA graph
        being captured joins the side stream back)."""
        if tokens > self.max_tokens or weight.nbytes > self.max_bytes or not weight.is_contiguous():
            yield
            return
        main = torch.cuda.current_stream(weight.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            prefetch_l2(weight)
        yield
        main.wait_stream(self.stream)


def prefetch_l2(weight: torch.Tensor) -> None:
    """Issue prefetches of every line of a contiguous CUDA tensor into L2."""
    flat = weight.view(-1).view(torch.uint8)
    _prefetch_kernel[(_PROGRAMS,)](flat, flat.numel(), LINES=_LINES_PER_STEP, num_warps=4)


if triton is not None:

    @triton.jit
    def _prefetch_kernel(ptr, n_bytes, LINES: tl.constexpr):
        # Program p requests lines p * LINES .., then strides by all programs' lines.
        step = tl.num_programs(0) * LINES * 128
        for start in range(tl.program_id(0) * LINES * 128, n_bytes, step):
            offs = tl.minimum(start + tl.arange(0, LINES) * 128, n_bytes - 1)  # never past the end
            tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptr + offs],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
