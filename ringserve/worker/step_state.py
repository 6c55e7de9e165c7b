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

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None


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


def fill_pending_tokens(ids: torch.Tensor, pending: torch.Tensor, sampled: torch.Tensor) -> None:
    """ids [T] int64 on the device: put the previous step's sampled ids (sampled [S']) where
    the host had placeholders, pending [P, 2] int64 on the device = (index in ids, row of
    sampled) per placeholder (StepInput.pending). No host sync."""
    ids.index_copy_(0, pending[:, 0], sampled.index_select(0, pending[:, 1]))


def token_slots(
    tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[G, T] int64 cache slot of each new token (rows, positions [T] on the device) in each
    KV group, from the block tables [G, rows, blocks]."""
    blocks = tables[:, rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


def decode_step_tensors(
    inputs: torch.Tensor, tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a decode step's kernels read, from its inputs [4, B] int64 on the device (token
    ids, positions, block-table rows, lengths; DecodeGraphs.inputs) and the block tables
    [G, rows, blocks] int32: (rows [B] int32, lengths [B] int32, slots [G, B] int64: where
    each new token's K/V goes in each KV group). On CUDA one kernel (the torch form is
    eight, ~2 us each at the start of every decode step); the same values either way."""
    if triton is None or not inputs.is_cuda:
        positions, rows, lens = inputs[1], inputs[2], inputs[3]
        return rows.to(torch.int32), lens.to(torch.int32), token_slots(tables, rows, positions, block_size)
    return _decode_step_triton(inputs, tables, block_size)


def _decode_step_triton(inputs: torch.Tensor, tables: torch.Tensor, block_size: int):
    b = inputs.shape[1]
    rows = torch.empty(b, dtype=torch.int32, device=inputs.device)
    lens = torch.empty_like(rows)
    slots = torch.empty(tables.shape[0], b, dtype=torch.int64, device=inputs.device)
    _decode_step_kernel[(1,)](
        inputs, tables, rows, lens, slots, b, inputs.stride(0), tables.stride(0), tables.stride(1),
        GROUPS=tables.shape[0], BLOCK_SIZE=block_size, BLOCK=max(16, triton.next_power_of_2(b)),
    )  # fmt: skip
    return rows, lens, slots


if triton is not None:

    @triton.jit
    def _decode_step_kernel(
        inputs_ptr, tables_ptr, rows_ptr, lens_ptr, slots_ptr, B, stride_input, stride_group, stride_row,
        GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.arange(0, BLOCK)
        ok = i < B
        position = tl.load(inputs_ptr + stride_input + i, mask=ok, other=0)
        row = tl.load(inputs_ptr + 2 * stride_input + i, mask=ok, other=0)
        length = tl.load(inputs_ptr + 3 * stride_input + i, mask=ok, other=0)
        tl.store(rows_ptr + i, row.to(tl.int32), mask=ok)
        tl.store(lens_ptr + i, length.to(tl.int32), mask=ok)
        for g in tl.static_range(GROUPS):
            entry = tables_ptr + g * stride_group + row * stride_row + position // BLOCK_SIZE
            block = tl.load(entry, mask=ok, other=0).to(tl.int64)
            tl.store(slots_ptr + g * B + i, block * BLOCK_SIZE + position % BLOCK_SIZE, mask=ok)
