"""The CP layout on the driver, checked against the block tables it describes (no ranks run).

The oracle is the definition: block id b lives on rank b // blocks_per_rank as its local
block b % blocks_per_rank, token p of a sequence in its block table[p // block_size], at
local slot local_block * block_size + p % block_size.
"""

import pytest
import torch

from ringserve.engine.block_manager import RELEASED, BlockManager
from ringserve.engine.scheduler import Scheduler
from ringserve.engine.sequence import Sequence, Status
from ringserve.sampling_params import SamplingParams
from ringserve.worker.step_input import StepInput

from helpers import ring_step


def _check_step(step: StepInput, batch, rank_tables, per: int, bs: int, cp: int):
    """The step's CPStep against the sequences' block tables (every KV group's);
    rank_tables[r][(group, row)] plays each rank's step state, updated only from the message."""
    for r, updates in enumerate(step.cp.table_updates):
        for group, row, col, blocks in updates:
            table = rank_tables[r].setdefault((group, row), [])
            assert col <= len(table) or col == 0
            table[col:] = blocks
    expected_tokens = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        start = seq.num_computed_tokens
        # Each logical block's rank, from a group that still holds it (the last group never
        # releases in these tests); a released entry keeps its column on the rank.
        ranks = [b // per for b in seq.block_tables[-1]]
        for g, group_table in enumerate(seq.block_tables):
            for r in range(cp):
                mine = [None if b == RELEASED else b % per for b, rb in zip(group_table, ranks) if rb == r]
                # A rank reads only the blocks it holds of a row (entries past them may be a
                # former occupant's, as in any row's table).
                held = rank_tables[r].get((g, seq.row), [])[: len(mine)]
                assert len(held) == len(mine), (seq, g, r)
                assert all(m is None or m == h for m, h in zip(mine, held)), (seq, g, r)
        for r in range(cp):
            held = sum(1 for p in range(start) if ranks[p // bs] == r)
            assert step.cp.cached_keys[r][i] == held, (seq, r)
        for p in range(start, start + n):
            blocks = [table[p // bs] for table in seq.block_tables]
            assert len({b // per for b in blocks}) == 1  # a logical block on one rank in every group
            expected_tokens.append((i, blocks[0] // per, p, *[(b % per) * bs + p % bs for b in blocks]))
    tokens = [
        (i, rank, position + j, *[slot + j for slot in slots])
        for i, rank, position, count, *slots in step.cp.runs
        for j in range(count)
    ]
    assert tokens == expected_tokens


@pytest.mark.parametrize("group_lookbacks", [(None,), (3, None)], ids=["one group", "hybrid"])
def test_each_step_says_where_every_token_lives(group_lookbacks):
    """The scheduler over 3 ranks with chunked prefill, prefix-cache hits, preemption and
    decode: every step's message lets each rank rebuild exactly its share of every running
    sequence's blocks (in every KV group: a hybrid's windowed group releasing blocks), and
    names each new token's rank and local slot per group and each rank's cached keys; and
    decode blocks go round robin from a per-sequence offset."""
    cp, bs = 3, 2
    num_blocks = cp * 10 * len(group_lookbacks)
    manager = BlockManager(num_blocks, bs, True, cp, 3, group_lookbacks=group_lookbacks)
    per = manager.layout.blocks_per_rank
    scheduler = Scheduler(manager, max_num_batched_tokens=9, max_num_seqs=4)
    shared = list(range(100, 113))
    prompts = [shared + [1, 2], list(range(20)), shared + [7], [5] * 9, shared + [8, 9, 10]]
    seqs = []
    for k, prompt in enumerate(prompts):
        seq = Sequence(str(k), prompt, SamplingParams(max_tokens=12, temperature=0))
        scheduler.add(seq)
        seqs.append(seq)
    rank_tables = [{} for _ in range(cp)]
    single = {seq.request_id: [] for seq in seqs}  # (block index, rank) of blocks placed one at a time
    steps = 0
    while scheduler.has_unfinished():
        running = {seq.request_id: len(seq.block_table) for seq in scheduler.running}
        batch = scheduler.schedule()
        step = StepInput.from_batch(batch, manager.layout)
        assert step.table_updates == []  # under CP the layout speaks for the blocks
        _check_step(step, batch, rank_tables, per, bs, cp)
        for seq in seqs:
            if seq.request_id in running and seq.status is Status.WAITING:  # preempted: a new offset
                single[seq.request_id] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if running.get(seq.request_id, -1) == len(seq.block_table) - 1:
                single[seq.request_id].append((len(seq.block_table) - 1, seq.block_table[-1] // per))
            seq.num_computed_tokens += n
            manager.cache_full_blocks(seq)
            manager.release_outside_window(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(3 + steps % 50)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    scheduler.finish(seq)
        steps += 1
    assert scheduler.num_preemptions > 0
    assert any(seq.num_prefix_cached_tokens > 0 for seq in seqs)
    # Blocks placed one at a time go round robin: rank = (offset + block index) mod N.
    assert sum(len(placed) for placed in single.values()) >= 10
    for placed in single.values():
        assert len({(rank - index) % cp for index, rank in placed}) <= 1, placed


def test_layout_offsets_spread_sequences_and_are_released():
    """Sequences decoding together start their round robin on different ranks; a sequence's
    offset lasts while it holds blocks (layout state, not a process-wide counter)."""
    manager = BlockManager(4 * 8, 4, enable_prefix_caching=False, num_ranks=4)
    layout = manager.layout
    first = [layout.place(str(k), 5, 1)[0] for k in range(3)]
    assert first == [1, 2, 3]  # block 5 from offsets 0, 1, 2
    assert layout.place("0", 6, 1) == [2]  # the same sequence keeps its offset
    layout.release("0")
    assert layout.place("0", 5, 1) == [0]  # then takes the next one in turn (3)


def test_ring_step_counts_match_the_keys_positions():
    """Mixed steps (a whole prompt, chunks after cached prefixes that end inside a block, a
    decode token) over 3 ranks: what each query sees on each rank, made from counts alone,
    equals searching the keys' real positions; the key bounds count each rank's keys."""
    starts, totals = [0, 22, 9, 30], [70, 52, 10, 31]
    step, _, key_positions = ring_step(starts, totals, 4, 3)
    for q_rank in range(3):
        for k_rank in range(3):
            batch = step.varlen(q_rank, k_rank, "cpu")
            seen = []
            for i in range(len(totals)):
                queries = step.positions[(step.owners == q_rank) & (step.seq == i)]
                seen.append(torch.searchsorted(key_positions[i][k_rank], queries, right=True))
                assert batch.k_bounds[i + 1] - batch.k_bounds[i] == len(key_positions[i][k_rank])
            assert torch.equal(batch.seen_keys_host, torch.cat(seen)), (q_rank, k_rank)
    assert sum(step.num_queries(r) for r in range(3)) == sum(t - s for s, t in zip(starts, totals))
