"""The paged KV cache tensors (the attention that reads and writes them: forward_context.py).

Layout per layer: k and v [(num_blocks + 1) * block_size, NKV, D]; token t of a sequence
lives in slot block_table[t // block_size] * block_size + t % block_size. The extra last
block is never handed out: padded rows of a CUDA-graph batch write their KV there.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks  # the scratch block of padded rows
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
