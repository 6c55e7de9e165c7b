"""KV-cache blocks: allocation, reference counts, and the prefix cache.

A full block is named by a hash of its tokens and of the block before it, so equal
prefixes map to equal hashes. The hash is SHA-256: with Python's hash(), which is
deterministic for tuples of ints, colliding token blocks could be searched offline and sent
to read or poison another user's cached KV (vLLM's CVE-2025-25183). Blocks nobody uses but that hold a hashed prefix stay
cached until memory runs short, then the least recently freed is reused first.

Under context parallelism each of the N ranks has its own pool of blocks; where a block,
and so each token, lives is the layout's to say (parallel/cp/layout.py): it places new
blocks, and tells the ranks what each step changes.

Blocks are accounted per KV group (kv_groups.py: layers with the same lookback): each
group has its own table per sequence (seq.block_tables[g]), all of one length, and takes
its blocks from the one pool. A group of windowed layers (sliding windows, attention
chunks) releases a block once it lies wholly before the lookback of the sequence's next
token: no query can read it again (its table entry becomes RELEASED), so such a group holds
about lookback / block_size blocks of a long sequence, a full group all context / block_size.

A step needs its new blocks in every group. A prefix-cache hit of n blocks needs, in every
full group, the cached blocks 0..n-1, and in every windowed group those the next token can
see (the same hash names a block's tokens in every group; each group caches its own block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ringserve.config import first_visible_block
from ringserve.engine.sequence import Sequence
from ringserve.parallel.cp.layout import CPLayout
from ringserve.worker.kv_groups import min_blocks

RELEASED = -1  # a block_table entry whose block no query of the sequence can see any more


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_ranks: int = 1,
        lookback: int | None = None,
        group_lookbacks: tuple[int | None, ...] = (None,),
    ):
        """num_blocks: blocks in all; num_ranks pools of num_blocks // num_ranks each.
        lookback: ModelConfig.local_lookback (the ring counts keys before windows by it);
        group_lookbacks: per KV group (KVGroups.lookbacks), the lookback by which it
        releases blocks (None: a full group keeps every block)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.group_lookbacks = group_lookbacks
        self.layout = CPLayout(num_ranks, num_blocks // num_ranks, block_size, lookback)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple[int, bytes] | None] = [None] * num_blocks  # (group, hash) it caches
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, hash) -> block
        # Per rank, blocks with no user, reused from the front: never-hashed ones first,
        # then cached ones from the least recently freed.
        self.free_blocks: list[OrderedDict[int, None]] = [
            OrderedDict((b, None) for b in self.layout.pool(r)) for r in range(num_ranks)
        ]

    @property
    def num_groups(self) -> int:
        return len(self.group_lookbacks)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(pool) for pool in self.free_blocks)

    def blocks_held(self, seq: Sequence) -> list[int]:
        """Per group, the blocks the sequence holds (not released)."""
        return [sum(1 for b in table if b != RELEASED) for table in seq.block_tables]

    def fits_in_chunks(self, seq: Sequence) -> bool:
        """Whether the sequence, alone, fits the cache computed a chunk at a time (windowed
        groups release blocks between chunks)."""
        return min_blocks(self.group_lookbacks, seq.num_tokens, self.block_size) <= self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks per group (every group's table grows alike)."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first `num_blocks` full blocks, extended incrementally:
        each new block hashes only its own tokens (and its parent's 32-byte digest)."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = array("q", seq.token_slice(i * size, (i + 1) * size))
            hashes.append(block_hash(hashes[-1] if hashes else b"", tokens))
        return hashes[:num_blocks]

    def _first_held(self, group: int, num_tokens: int) -> int:
        """The first block group `group` still needs once num_tokens tokens are computed
        (its next token at position num_tokens), by the group's lookback."""
        return first_visible_block(num_tokens, self.block_size, self.group_lookbacks[group])

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix
        that every group still holds (a windowed group: the blocks its next token sees).

        At least the last token is left to compute, since its logits are needed.
        """
        assert not seq.block_tables
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        n = self._cached_prefix(hashes)
        # Under CP the layout counts where every cached token lives: a hit holds all its blocks.
        firsts = [
            0 if self.num_ranks > 1 else self._first_held(g, n * self.block_size)
            for g in range(self.num_groups)
        ]
        seq.block_tables = [[RELEASED] * first for first in firsts]
        seq.num_released_blocks = firsts
        for g, (table, first) in enumerate(zip(seq.block_tables, firsts)):
            for h in hashes[first:n]:
                block = self.cached[(g, h)]
                self._take(block)
                table.append(block)
        seq.num_computed_tokens = n * self.block_size
        seq.num_registered_blocks = n
        seq.num_prefix_cached_tokens = seq.num_computed_tokens

    def _same_rank_in_every_group(self, h: bytes) -> bool:
        blocks = [self.cached.get((g, h)) for g in range(self.num_groups)]
        return None not in blocks and len({self.layout.rank_of(b) for b in blocks}) == 1

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many of the sequence's leading full blocks a hit would reuse (nothing is
        taken); at most all but the block of its last token, whose logits are needed."""
        if not self.enable_prefix_caching:
            return 0
        return self._cached_prefix(self._hashes(seq, (seq.num_tokens - 1) // self.block_size))

    def _cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of these hashes the cache holds as a hit needs them."""
        full = [g for g, lookback in enumerate(self.group_lookbacks) if lookback is None]
        if self.num_ranks > 1:
            # Under CP the layout counts where every cached token lives, and a logical block
            # lies on one rank in every group: each group's cached block, all on one rank.
            n = next((i for i, h in enumerate(hashes) if not self._same_rank_in_every_group(h)), len(hashes))
        else:  # the first block a full group misses (a model without windows stops there)
            n = next(
                (i for i, h in enumerate(hashes) if any((g, h) not in self.cached for g in full)), len(hashes)
            )
        found = [[(g, h) in self.cached for h in hashes[:n]] for g in range(self.num_groups)]
        while n > 0 and not all(
            all(found[g][self._first_held(g, n * self.block_size) : n]) for g in range(self.num_groups)
        ):
            n -= 1
        return n

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_blocks[self.layout.rank_of(block)][block]
        self.ref_count[block] += 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Add blocks to every group so that `num_new_tokens` more tokens fit; False (no
        change) if too few."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if not seq.block_tables:
            seq.block_tables = [[] for _ in range(self.num_groups)]
            seq.num_released_blocks = [0] * self.num_groups
        ranks = self.layout.place(seq.request_id, len(seq.block_table), needed)
        for r in set(ranks):
            if ranks.count(r) * self.num_groups > len(self.free_blocks[r]):
                return False
        for table in seq.block_tables:
            for r in ranks:
                block, _ = self.free_blocks[r].popitem(last=False)
                if self.block_key[block] is not None:  # evict its cached prefix
                    del self.cached[self.block_key[block]]
                    self.block_key[block] = None
                self.ref_count[block] = 1
                table.append(block)
        return True

    def _drop(self, block: int) -> None:
        """One user less; a block with none goes back to its rank's pool (hashed ones stay
        findable until reused, after the never-hashed ones)."""
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            pool = self.free_blocks[self.layout.rank_of(block)]
            pool[block] = None
            if self.block_key[block] is None:
                pool.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks in every group; hashed ones stay findable until reused."""
        for table in seq.block_tables:
            for block in reversed(table):
                if block != RELEASED:
                    self._drop(block)
        self.layout.release(seq.request_id)
        seq.block_tables = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_released_blocks = []

    def release_outside_window(self, seq: Sequence) -> None:
        """In each windowed group, release the blocks wholly before the first position the
        sequence's next token (at num_computed_tokens) may see, lookback keys back. Called
        once its computed blocks were offered to the prefix cache, so a released block
        that holds a hashed prefix stays findable until it is reused."""
        for g, table in enumerate(seq.block_tables):
            if self.group_lookbacks[g] is None:
                continue
            end = min(self._first_held(g, seq.num_computed_tokens), len(table))
            for i in range(seq.num_released_blocks[g], end):
                if table[i] != RELEASED:
                    self._drop(table[i])
                    table[i] = RELEASED
            seq.num_released_blocks[g] = max(seq.num_released_blocks[g], end)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register, in every group, the hashes of the sequence's blocks full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.num_registered_blocks, full):
                block, key = table[i], (g, hashes[i])
                # Skip a released block, one already named, or content another sequence computed first.
                if block != RELEASED and self.block_key[block] is None and key not in self.cached:
                    self.block_key[block] = key
                    self.cached[key] = block
        seq.num_registered_blocks = full


def block_hash(parent: bytes, tokens: array) -> bytes:
    """SHA-256 of a block's parent digest (b"" for the first block) and its int64 token ids."""
    return hashlib.sha256(parent + tokens.tobytes()).digest()
