"""Where every token lives under context parallelism: the one home of the block -> rank/slot
arithmetic, kept by the driver next to the block manager and extended step by step.

Each of the N CP ranks has its own pool of blocks_per_rank KV-cache blocks; block id b lives
on rank b // blocks_per_rank as that rank's local block b % blocks_per_rank, so token t of a
sequence lives on the rank of block_table[t // block_size], in local slot
local_block * block_size + t % block_size. A logical block (block_size consecutive
positions) sits whole on one rank, so blocks stay prefix-cacheable.

Every rank keeps, per row of the runners' step state, the local blocks it holds of that
row's sequence, in logical order (a device block table of its share). Each step the layout
sends only what changed (`CPStep`): each rank's new local blocks, how many keys each rank
held of each sequence before the step, and where the step's new tokens go (one run per
logical block they touch). So a step costs O(sequences x ranks + new tokens + new blocks)
on the host, whatever the cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.config import first_visible_block


def place_blocks(offset: int, first_block: int, num_new: int, num_ranks: int) -> list[int]:
    """The rank of each of a step's new logical blocks first_block .. first_block + num_new - 1.

    Many new blocks (a prefill): cut into 2N chunks, rank i taking chunks i and 2N-1-i, so
    every ring step costs every rank about the same causal work; each rank gets the same
    number of blocks, give or take one. A few (decode): round robin by block index, shifted
    by the sequence's offset, so sequences decoding together land on different ranks and no
    rank fills first.
    """
    if num_ranks == 1:
        return [0] * num_new
    if num_new < 2 * num_ranks:
        return [(offset + first_block + i) % num_ranks for i in range(num_new)]
    sizes = [0] * (2 * num_ranks)  # blocks per chunk
    for rank in range(num_ranks):
        total = num_new // num_ranks + (1 if rank < num_new % num_ranks else 0)
        sizes[rank], sizes[2 * num_ranks - 1 - rank] = total // 2, total - total // 2
    ranks = []
    for chunk, size in enumerate(sizes):
        ranks += [chunk if chunk < num_ranks else 2 * num_ranks - 1 - chunk] * size
    return ranks


@dataclass
class CPStep:
    """What a step changes under context parallelism; every rank reads the whole of it.

    Sequences are indexed by their place in the step (StepInput's order).
    """

    # Per rank: (KV group, row, first local column, local block ids) the row's share gained.
    table_updates: list[list[tuple[int, int, int, list[int]]]]
    # [rank][sequence]: keys of the sequence the rank held before this step.
    cached_keys: list[list[int]]
    # The step's new tokens in packed order, one run per logical block touched:
    # (sequence, rank, first position, tokens, first local slot in each KV group...).
    runs: list[tuple[int, ...]]
    # Models with local attention (windows, chunks): per sequence, (first logical block a
    # windowed layer's query of this step may see, the rank of each block from there to the
    # end of its table), so the ring can count the keys before each query's window. At most
    # lookback / block_size + new blocks per sequence; empty without local attention.
    recent_blocks: list[tuple[int, list[int]]] = field(default_factory=list)
    block_size: int = 0
    num_groups: int = 1  # KV groups (engine/kv_groups.py): each run has a slot per group

    @property
    def num_host_elements(self) -> int:
        """Elements of the message: what the driver built for the step."""
        updates = sum(3 + len(blocks) for per_rank in self.table_updates for *_, blocks in per_rank)
        recent = sum(1 + len(ranks) for _, ranks in self.recent_blocks)
        runs = sum(len(run) for run in self.runs)
        return updates + sum(len(c) for c in self.cached_keys) + runs + recent


@dataclass
class _RowShare:
    """What the ranks hold of one row's sequence, as the layout has told them."""

    num_ranks: int
    local_blocks: list[int] = field(init=False)  # per rank: blocks sent (its next local column)
    keys: list[int] = field(init=False)  # per rank: keys of positions 0 .. covered - 1
    covered: int = 0

    def __post_init__(self):
        self.local_blocks = [0] * self.num_ranks
        self.keys = [0] * self.num_ranks


class CPLayout:
    def __init__(self, num_ranks: int, blocks_per_rank: int, block_size: int, lookback: int | None = None):
        """lookback: the most keys before its own position a query of a windowed layer sees
        (ModelConfig.local_lookback; None: no local attention)."""
        self.num_ranks = num_ranks
        self.blocks_per_rank = blocks_per_rank
        self.block_size = block_size
        self.lookback = lookback
        self._offsets: dict[str, int] = {}  # request -> decode round-robin offset, while it holds blocks
        self._next_offset = 0
        self._rows: dict[int, _RowShare] = {}

    # Blocks -------------------------------------------------------------------------------

    def rank_of(self, block: int) -> int:
        return block // self.blocks_per_rank

    def local_block(self, block: int) -> int:
        return block % self.blocks_per_rank

    def pool(self, rank: int) -> range:
        """The block ids of one rank's pool."""
        return range(rank * self.blocks_per_rank, (rank + 1) * self.blocks_per_rank)

    def where(self, block_table: list[int], position: int) -> tuple[int, int]:
        """(rank, local slot) of the token at `position` of a sequence with this block table."""
        block = block_table[position // self.block_size]
        return self.rank_of(block), self.local_block(block) * self.block_size + position % self.block_size

    def where_in_groups(self, block_tables: list[list[int]], position: int) -> tuple[int, list[int]]:
        """(rank, local slot in each KV group) of the token at `position`: a logical block
        lies on the same rank in every group (each group's table places it alike)."""
        rank, slots = -1, []
        for table in block_tables:
            rank, slot = self.where(table, position)
            slots.append(slot)
        return rank, slots

    def place(self, request_id: str, first_block: int, num_new: int) -> list[int]:
        """The ranks of a sequence's next `num_new` logical blocks (see place_blocks); each
        sequence takes the next offset the first time it asks after holding no block."""
        if request_id not in self._offsets:
            self._offsets[request_id] = self._next_offset
            self._next_offset = (self._next_offset + 1) % self.num_ranks
        return place_blocks(self._offsets[request_id], first_block, num_new, self.num_ranks)

    def release(self, request_id: str) -> None:
        """The sequence holds no block any more (finished or preempted)."""
        self._offsets.pop(request_id, None)

    # Steps --------------------------------------------------------------------------------

    def step(self, seqs, num_tokens: list[int]) -> CPStep:
        """The step's changes for sequences `seqs` (with rows, block tables covering their new
        tokens, and num_synced_blocks) computing `num_tokens` new tokens each. Marks their
        blocks as sent. Work: O(sequences x ranks + new tokens' blocks + new blocks)."""
        n_ranks, bs = self.num_ranks, self.block_size
        updates: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in range(n_ranks)]
        cached = [[0] * len(seqs) for _ in range(n_ranks)]
        runs, recent = [], []
        for i, (seq, count) in enumerate(zip(seqs, num_tokens)):
            table, start = seq.block_table, seq.num_computed_tokens
            if seq.num_synced_blocks == 0:  # a new row (admitted, or re-admitted after preemption)
                self._rows[seq.row] = _RowShare(n_ranks)
            share = self._rows[seq.row]
            assert len(table) * bs >= start + count, "blocks for the new tokens are allocated first"
            self._send_blocks(share, seq.row, [t[seq.num_synced_blocks :] for t in seq.block_tables], updates)
            seq.num_synced_blocks = len(table)
            # Drafts the last step computed and did not keep (speculative decoding): their
            # positions are not held any more; the next tokens take their slots.
            self._retreat(share, seq.block_tables, start)
            # Tokens cached before the row was taken (a prefix-cache hit): count where they are.
            self._advance(share, seq.block_tables, start, None)
            for r in range(n_ranks):
                cached[r][i] = share.keys[r]
            self._advance(share, seq.block_tables, start + count, (i, runs))
            if self.lookback is not None:
                first = first_visible_block(start, bs, self.lookback)
                recent.append((first, [self.rank_of(b) for b in table[first:]]))
        num_groups = len(seqs[0].block_tables) if seqs else 1
        return CPStep(updates, cached, runs, recent, bs, num_groups)

    def _send_blocks(self, share: _RowShare, row: int, new_blocks: list[list[int]], updates) -> None:
        """new_blocks: per KV group, the row's blocks not sent yet (never released ones:
        release follows the step that sent them). Each rank's column advances once for all
        groups, since a logical block lies on the same rank in each."""
        first_column = list(share.local_blocks)
        for group, blocks in enumerate(new_blocks):
            per_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
            for block in blocks:
                assert block >= 0, "a released block is never sent"
                per_rank[self.rank_of(block)].append(self.local_block(block))
            for r, local in enumerate(per_rank):
                if local:
                    updates[r].append((group, row, first_column[r], local))
                    share.local_blocks[r] = first_column[r] + len(local)

    def _retreat(self, share: _RowShare, tables: list[list[int]], end: int) -> None:
        """Uncount positions end .. covered - 1 (rejected drafts), a block at a time."""
        bs = self.block_size
        while share.covered > end:
            position = max(end, (share.covered - 1) // bs * bs)
            share.keys[self.where(tables[0], position)[0]] -= share.covered - position
            share.covered = position

    def _advance(self, share: _RowShare, tables: list[list[int]], end: int, runs_of) -> None:
        """Count positions covered .. end - 1 as held by their ranks, a block at a time;
        runs_of = (sequence, runs): also record them as the step's new tokens (with their
        first slot in each KV group's table)."""
        bs = self.block_size
        while share.covered < end:
            position = share.covered
            tokens = min(end, (position // bs + 1) * bs) - position
            rank, slots = self.where_in_groups(tables, position)
            share.keys[rank] += tokens
            if runs_of is not None:
                runs_of[1].append((runs_of[0], rank, position, tokens, *slots))
            share.covered += tokens
