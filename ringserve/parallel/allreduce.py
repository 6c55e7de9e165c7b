"""The tensor-parallel sum, by one of several algorithms chosen per message size.

- torch: the process group's all_reduce (NCCL on CUDA, gloo on CPU).
- one_shot (flat): every rank reads all peers' inputs and reduces locally; fewest steps,
  best for small (decode) messages.
- two_shot (tree): reduce-scatter by direct reads (rank r sums slice r of every peer), then
  all-gather; a ring's bytes in a constant number of steps, for mid-size messages.
- auto: one_shot / two_shot / torch by message size, with thresholds per world size from
  `ringserve bench allreduce` (stored), else defaults from published figures.

On CUDA one_shot and two_shot run on PyTorch symmetric memory (peer-visible buffers over
NVLink; never NVLink multicast). On CPU they run as their collective equivalents
(all-gather then a local sum; all-to-all of slices, a local sum, then all-gather), so the
dispatch and the arithmetic are tested without a GPU. Every rank sums in rank order, so
all ranks get bit-identical results.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ringserve.config.names import ALLREDUCE_BACKENDS
from ringserve.measurements import load_measurement, save_measurement
from ringserve.parallel.comm import all_gather_stacked

logger = logging.getLogger(__name__)

# Published defaults (direct-access allreduce beats NCCL below ~256 KB at 8 ranks; the band
# widens with fewer ranks); measured values replace them.
DEFAULT_THRESHOLDS = {
    2: {"one_shot_max_bytes": 1 << 20, "two_shot_max_bytes": 16 << 20},
    4: {"one_shot_max_bytes": 512 << 10, "two_shot_max_bytes": 8 << 20},
    8: {"one_shot_max_bytes": 256 << 10, "two_shot_max_bytes": 4 << 20},
}
_SYMM_BUFFER_BYTES = 64 << 20


def load_thresholds(device_type: str, world_size: int) -> dict:
    """Measured thresholds for this device type and world size, else the defaults."""
    measured = load_measurement("allreduce_thresholds", device_type, str(world_size))
    if measured:
        return measured
    nearest = min(DEFAULT_THRESHOLDS, key=lambda w: abs(w - world_size))
    return DEFAULT_THRESHOLDS[nearest]


def save_thresholds(device_type: str, world_size: int, thresholds: dict) -> str:
    return save_measurement("allreduce_thresholds", thresholds, device_type, str(world_size))


def backend_for(nbytes: int, thresholds: dict) -> str:
    """auto's algorithm for a message of nbytes: three contiguous size bands, one_shot up to
    one_shot_max_bytes, two_shot up to two_shot_max_bytes, torch above."""
    if nbytes <= thresholds["one_shot_max_bytes"]:
        return "one_shot"
    if nbytes <= thresholds["two_shot_max_bytes"]:
        return "two_shot"
    return "torch"


class AllReduce:
    """x -> sum of x over `group`, by the configured algorithm."""

    def __init__(self, group, backend: str = "auto", device: torch.device | None = None, thresholds=None):
        if backend not in ALLREDUCE_BACKENDS:
            raise ValueError(
                f"unknown allreduce backend {backend!r}; choose one of {', '.join(ALLREDUCE_BACKENDS)}"
            )
        self.group = group
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.backend = backend
        self.device = device or torch.device("cpu")
        self.thresholds = thresholds or load_thresholds(self.device.type, self.world_size)
        self.symm_buffer = None
        if self.world_size > 1 and self.device.type == "cuda" and backend != "torch":
            self._init_symmetric_memory()

    def _init_symmetric_memory(self) -> None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(_SYMM_BUFFER_BYTES // 2, dtype=torch.bfloat16, device=self.device)
            symm_mem.rendezvous(buffer, self.group.group_name)
            self.symm_buffer = buffer
        except Exception as e:  # no P2P access, old driver, no symmetric-memory support
            logger.warning(
                "symmetric memory is unavailable (%s: %s); allreduce falls back to NCCL",
                type(e).__name__,
                e,
            )
            self.backend = "torch"

    def choose(self, nbytes: int) -> str:
        """The algorithm for a message of `nbytes` bytes."""
        if self.backend != "auto":
            return self.backend
        return backend_for(nbytes, self.thresholds)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        algo = self.choose(x.numel() * x.element_size())
        if algo == "torch":
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
            return x
        if self.symm_buffer is not None and self._fits_symmetric(x):
            return self._symmetric(x, algo)
        return self._one_shot(x) if algo == "one_shot" else self._two_shot(x)

    # Collective equivalents (CPU, or CUDA tensors the symmetric buffer cannot take) -------

    def _one_shot(self, x):
        return all_gather_stacked(x, self.group).sum(dim=0, dtype=x.dtype)

    def _two_shot(self, x):
        n = self.world_size
        flat = x.contiguous().view(-1)
        chunk = -(-flat.numel() // n)
        if chunk * n != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(chunk * n - flat.numel())])
        # Shot 1: rank r receives slice r of every peer and sums them.
        slices = torch.empty_like(flat)
        dist.all_to_all_single(slices, flat, group=self.group)
        mine = slices.view(n, chunk).sum(dim=0, dtype=x.dtype)
        # Shot 2: everyone gathers the reduced slices.
        out = all_gather_stacked(mine, self.group).view(-1)
        return out[: x.numel()].view(x.shape)

    # Symmetric memory (CUDA) -------------------------------------------------------------

    def _fits_symmetric(self, x) -> bool:
        return x.dtype == self.symm_buffer.dtype and x.numel() <= self.symm_buffer.numel()

    def _symmetric(self, x, algo: str):
        n = x.numel()
        buffer = self.symm_buffer[:n]
        buffer.copy_(x.view(-1))
        name = self.group.group_name
        if algo == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", name).view(x.shape)
        torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", name)
        return buffer.view(x.shape).clone()
