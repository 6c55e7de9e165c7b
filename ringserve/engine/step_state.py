"""A runner's persistent step state: every running sequence's block tables (one per KV
group, engine/kv_groups.py), kept on the device.

Rank 0's scheduler gives each running sequence a row (`Scheduler.take_row`); each step it
sends only the blocks a row gained since the runners last saw it (`StepInput.table_updates`),
and every rank applies them in place. So a step costs host work for its new tokens and
blocks, never for a sequence's cached context.

Under context parallelism a rank's table holds only its share: the local ids of the blocks
it holds of the row's sequence, in logical order (the CP layout sends each rank its own).
"""

from __future__ import annotations

import torch


class BlockTables:
    """[groups, max_rows + 1, max_blocks] int32 on the device, one table per KV group
    (kv_groups.py); the last row belongs to padded batch rows and points only at the KV
    cache's scratch block. Its shape never changes, so CUDA graphs capture it."""

    def __init__(self, num_groups: int, max_rows: int, max_blocks: int, pad_block: int, device: torch.device):
        self.pad_row = max_rows
        self.pad_block = pad_block
        self.device = torch.device(device)
        self.tables = torch.zeros(num_groups, max_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.tables[:, self.pad_row] = pad_block

    def apply(self, updates: list[tuple[int, int, int, list[int]]]) -> None:
        """updates: (group, row, first column, block ids) -> written in place, one device
        copy. A released entry (negative: a windowed group's prefix-cache hit starts with
        them) points at the scratch block, though no attention reads it."""
        if not updates:
            return
        groups, rows, cols, blocks = [], [], [], []
        for group, row, col, new in updates:
            groups += [group] * len(new)
            rows += [row] * len(new)
            cols += range(col, col + len(new))
            blocks += new
        index = torch.tensor([groups, rows, cols, blocks], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        blocks_d = index[3].masked_fill(index[3] < 0, self.pad_block)
        self.tables[index[0], index[1], index[2]] = blocks_d.to(torch.int32)

    def key_slots(self, rows: list[int], counts: list[int], block_size: int) -> torch.Tensor:
        """[groups, sum(counts)] int64 on the device: per KV group, the slots of each row's
        first counts[i] keys, packed row after row (under CP: every key this rank holds of
        each sequence, in position order; a windowed group's released entries give slots
        no query of the step sees). Host work O(rows); the per-key index is made on the device."""
        total = sum(counts)
        host = torch.tensor([rows, counts], dtype=torch.int64).to(self.device, non_blocking=True)
        row_d, count_d = host[0], host[1]
        first = torch.cumsum(count_d, 0) - count_d  # [S] where each row's keys start
        key_row = row_d.repeat_interleave(count_d, output_size=total)  # [K]
        index = torch.arange(total, device=self.device) - first.repeat_interleave(count_d, output_size=total)
        blocks = self.tables[:, key_row, index // block_size].long()  # [G, K]
        return blocks * block_size + index % block_size


def fill_pending_tokens(ids: torch.Tensor, pending: list[tuple[int, int]], sampled: torch.Tensor) -> None:
    """ids [T] int64 on the device: put the previous step's sampled ids (sampled [S']) where
    the host had placeholders, pending = [(index in ids, row of sampled)]. No host sync."""
    index = torch.tensor(pending, dtype=torch.int64).to(ids.device, non_blocking=True)  # [P, 2]
    ids.index_copy_(0, index[:, 0], sampled.index_select(0, index[:, 1]))
