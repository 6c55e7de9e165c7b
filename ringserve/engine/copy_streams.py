"""A step's host <-> device copies on side streams, off the device's critical path.

A decode step's inputs are a few hundred bytes. Copied on the compute stream, from pageable
memory, each one sits between two steps' kernels as a memcpy: ~10 us of the device idling
at batch 1 (a profile at 34d2393, BENCHMARKS.md). With async scheduling the host prepares
step N+1 while step N runs, so its inputs can be on the device long before N ends: they
are copied from pinned memory on an upload stream as soon as the host has them, and the
compute stream only waits for that copy (long done). Likewise the sampled tokens go to the
host on a download stream, so the next step's kernels need not queue behind that memcpy.
The two directions have a stream each: an upload must never wait behind a download that
waits for the end of the step that is running.
"""

from __future__ import annotations

import torch


class Uploads:
    """Host tensors to the device, ordered before the compute stream's next kernels."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        """The values of host (a CPU tensor) on the device; the host does not wait."""
        if self.stream is None:
            return host.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        # Pinned: the copy is a DMA the host need not stage (the host allocator keeps the
        # buffer until the copy is done).
        pinned = host.pin_memory()
        with torch.cuda.stream(self.stream):
            dev = pinned.to(self.device, non_blocking=True)
        compute.wait_stream(self.stream)
        dev.record_stream(compute)  # its memory is freed only after the compute stream's use
        return dev


def download(
    tokens: torch.Tensor, stream: torch.cuda.Stream | None
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying tokens (on the device) to pinned host memory on `stream`, after what
    the compute stream has queued so far: (the host tensor, an event recorded when it is
    filled). A CPU tensor is its own copy (no event)."""
    if not tokens.is_cuda:
        return tokens, None
    compute = torch.cuda.current_stream(tokens.device)
    stream = stream or compute
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    tokens.record_stream(stream)
    return host, ready
