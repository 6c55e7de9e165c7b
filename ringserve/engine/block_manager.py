"""KV-cache blocks: allocation, reference counts, and the prefix cache.

A full block is named by a hash of its tokens and of the block before it, so equal
prefixes map to equal hashes. Blocks nobody uses but that hold a hashed prefix stay
cached until memory runs short, then the least recently freed is reused first.

Under context parallelism each of the N ranks has its own pool of blocks; where a block,
and so each token, lives is the layout's to say (parallel/cp_layout.py): it places new
blocks, and tells the ranks what each step changes.

When every layer attends through a window (sliding windows, attention chunks), a block
that lies wholly before the lookback of a sequence's next token can never be read again:
it is released as the sequence advances (its table entry becomes RELEASED), so a long
sequence holds about lookback / block_size blocks, not context / block_size. A model with
any full-attention layer keeps every block (those layers read them all).
"""

from __future__ import annotations

from collections import OrderedDict

from ringserve.engine.sequence import Sequence
from ringserve.parallel.cp_layout import CPLayout

RELEASED = -1  # a block_table entry whose block no query of the sequence can see any more


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_ranks: int = 1,
        lookback: int | None = None,
        release_outside_window: bool = False,
    ):
        """num_blocks: blocks in all; num_ranks pools of num_blocks // num_ranks each.
        lookback: ModelConfig.local_lookback (the ring counts keys before windows by it);
        release_outside_window: every layer is windowed, so blocks before the lookback of a
        sequence's next token are released (ModelConfig.all_layers_local)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.release_lookback = lookback if release_outside_window else None
        self.layout = CPLayout(num_ranks, num_blocks // num_ranks, block_size, lookback)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        # Per rank, blocks with no user, reused from the front: never-hashed ones first,
        # then cached ones from the least recently freed.
        self.free_blocks: list[OrderedDict[int, None]] = [
            OrderedDict((b, None) for b in self.layout.pool(r)) for r in range(num_ranks)
        ]

    @property
    def num_free_blocks(self) -> int:
        return sum(len(pool) for pool in self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the sequence's first `num_blocks` full blocks, extended incrementally."""
        hashes, size = seq.block_hashes, self.block_size
        tokens = seq.token_ids if len(hashes) < num_blocks else None
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * size : (i + 1) * size]))))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least the last token is left to compute, since its logits are needed.
        """
        assert not seq.block_table
        for h in self._hashes(seq, self.num_cached_prefix_blocks(seq)):
            block = self.cached[h]
            self._take(block)
            seq.block_table.append(block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_prefix_cached_tokens = seq.num_computed_tokens

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many of the sequence's leading full blocks the prefix cache holds (nothing is
        taken); at most all but the block of its last token, whose logits are needed."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            if h not in self.cached:
                break
            count += 1
        return count

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_blocks[self.layout.rank_of(block)][block]
        self.ref_count[block] += 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Add blocks so that `num_new_tokens` more tokens fit; False (no change) if too few."""
        needed = self.blocks_needed(seq, num_new_tokens)
        ranks = self.layout.place(seq.request_id, len(seq.block_table), needed)
        for r in set(ranks):
            if ranks.count(r) > len(self.free_blocks[r]):
                return False
        for r in ranks:
            block, _ = self.free_blocks[r].popitem(last=False)
            if self.block_hash[block] is not None:  # evict its cached prefix
                del self.cached[self.block_hash[block]]
                self.block_hash[block] = None
            self.ref_count[block] = 1
            seq.block_table.append(block)
        return True

    def _drop(self, block: int) -> None:
        """One user less; a block with none goes back to its rank's pool (hashed ones stay
        findable until reused, after the never-hashed ones)."""
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            pool = self.free_blocks[self.layout.rank_of(block)]
            pool[block] = None
            if self.block_hash[block] is None:
                pool.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; hashed ones stay findable until reused."""
        for block in reversed(seq.block_table):
            if block != RELEASED:
                self._drop(block)
        self.layout.release(seq.request_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence) -> None:
        """Every layer windowed: release the blocks wholly before the first position the
        sequence's next token (at num_computed_tokens) may see, lookback keys back. Called
        once its computed blocks were offered to the prefix cache, so a released block
        that holds a hashed prefix stays findable until it is reused."""
        if self.release_lookback is None:
            return
        end = max(0, seq.num_computed_tokens - self.release_lookback) // self.block_size
        for i in range(seq.num_released_blocks, min(end, len(seq.block_table))):
            self._drop(seq.block_table[i])
            seq.block_table[i] = RELEASED
        seq.num_released_blocks = max(seq.num_released_blocks, end)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of the sequence's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            # Skip a released block, one already named, or content another sequence computed first.
            if block != RELEASED and self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
        seq.num_registered_blocks = full
