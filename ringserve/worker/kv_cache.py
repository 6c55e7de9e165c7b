"""The paged KV cache tensors (the attention that reads and writes them: forward_context.py).

Layout: k and v [group_size, (num_blocks + 1) * block_size, NKV, D], one tensor per layer
of a group (kv_groups.py: layer j of every group uses tensor j; with one group, tensor j
is layer j). Token t of a sequence lives, for the layers of group g, in slot
block_tables[g][t // block_size] * block_size + t % block_size. The extra last block is
never handed out: padded rows of a CUDA-graph batch write their KV there.

An FP8 cache (--kv-cache-dtype fp8, kernels/kv_quant.py) stores k and v as float8 e4m3 and
keeps `scales` [num_layers, 2, NKV] float32: each layer's K and V scale per KV head (this
rank's heads), fixed while the engine runs.
"""

from __future__ import annotations

import torch

from ringserve.kernels.kv_quant import FP8_DTYPE
from ringserve.worker.kv_groups import KVGroups


class KVCache:
    def __init__(self, groups: KVGroups, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        """dtype: the cache's storage dtype; an FP8 one's scales start at 1.0 (vLLM's default
        without calibrated scales) until the worker sets them (worker/kv_calibration.py)."""
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks  # the scratch block of padded rows
        shape = (groups.group_size, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.scales = None
        if dtype == FP8_DTYPE:
            self.scales = torch.ones(len(groups.layer_tensor), 2, num_kv_heads, device=device)

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [num_slots, NKV, D] of one layer (its group's blocks, in its tensor)."""
        tensor = self.groups.layer_tensor[layer]
        return self.k[tensor], self.v[tensor]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [NKV] float32 of one layer of an FP8 cache; None otherwise."""
        if self.scales is None:
            return None
        return self.scales[layer, 0], self.scales[layer, 1]

    @staticmethod
    def bytes_per_block(groups: KVGroups, block_size, num_kv_heads, head_dim, dtype) -> int:
        return (
            2
            * groups.group_size
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
