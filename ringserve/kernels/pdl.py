"""Programmatic dependent launch (Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still
running: its programs become resident, do what needs nothing from the previous kernel
(compute addresses), then wait in `griddepcontrol.wait` until the previous kernel has
finished and its writes are visible. A decode step is ~300 short
kernels back to back (a few microseconds each), and each one's launch, ramp and first
loads otherwise start only after the previous one has drained.

The rule every PDL kernel keeps: before `wait_for_previous` it writes nothing and reads
nothing that the kernel just before it may write. Kernels further back have finished by
then (that kernel only let this one launch after its own wait), so the step's metadata and
the KV cache of earlier steps may be read early: the paged kernel does
(ringserve.attention.paged). The others call it first thing. (Reading the first weight
tiles before it, into registers or L2, was measured slower: bench/bench_decode_chain.py,
BENCHMARKS.md.)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU builds of torch come without Triton
    triton = None


def launch_options(x: torch.Tensor, pdl: bool) -> dict:
    """Keyword arguments for a Triton launch on x's device: PDL where asked and the GPU
    has it (sm90+); nothing elsewhere (Triton's CPU interpreter takes no such option)."""
    if pdl and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return {"launch_pdl": True}
    return {}


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Wait for the kernel before this one (a no-op when not launched with PDL), then
        let the next one launch: its programs take whatever the multiprocessors have free
        and wait in turn."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
