"""A runner's persistent step state: every running sequence's block table, kept on the device.

Rank 0's scheduler gives each running sequence a row (`Scheduler.take_row`); each step it
sends only the blocks a row gained since the runners last saw it (`StepInput.table_updates`),
and every rank applies them in place. So a step costs host work for its new tokens and
blocks, never for a sequence's cached context.
"""

from __future__ import annotations

import torch


class BlockTables:
    """[max_rows + 1, max_blocks] int32 on the device; the last row belongs to padded batch
    rows and points only at the KV cache's scratch block."""

    def __init__(self, max_rows: int, max_blocks: int, pad_block: int, device: torch.device):
        self.pad_row = max_rows
        self.device = torch.device(device)
        self.tables = torch.zeros(max_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.tables[self.pad_row] = pad_block
        # Host copy, kept only where the context-parallel layout still reads whole tables.
        self.host: list[list[int]] = [[] for _ in range(max_rows)]
        self.keep_host = False

    def apply(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """updates: (row, first column, block ids) -> written in place, one device copy."""
        if not updates:
            return
        rows, cols, blocks = [], [], []
        for row, col, new in updates:
            rows += [row] * len(new)
            cols += range(col, col + len(new))
            blocks += new
            if self.keep_host:
                self.host[row][col:] = new
        index = torch.tensor([rows, cols, blocks], dtype=torch.int64).to(self.device, non_blocking=True)
        self.tables[index[0], index[1]] = index[2].to(torch.int32)


def fill_pending_tokens(ids: torch.Tensor, pending: list[tuple[int, int]], sampled: torch.Tensor) -> None:
    """ids [T] int64 on the device: put the previous step's sampled ids (sampled [S']) where
    the host had placeholders, pending = [(index in ids, row of sampled)]. No host sync."""
    index = torch.tensor(pending, dtype=torch.int64).to(ids.device, non_blocking=True)  # [P, 2]
    ids.index_copy_(0, index[:, 0], sampled.index_select(0, index[:, 1]))
