"""One step's work as every rank receives it: plain lists, made by the driver from the
scheduler's batch, read by each rank's ModelRunner (which never imports the scheduler)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ringserve.parallel.cp.layout import CPLayout, CPStep


@dataclass
class StepInput:
    """What every rank needs to run one step: plain lists, cheap to send to other ranks.

    Only what changed travels: a sequence's new tokens, and the blocks its row of the
    runners' block tables gained since the last step (all of them when it takes a row);
    under context parallelism, the CP layout's account of the step instead (`cp`).
    """

    rows: list[int]  # each sequence's row of the runners' step state
    token_ids: list[list[int]]  # each sequence's new tokens
    starts: list[int]  # each sequence's tokens already in the cache (position of its first new token)
    sample: list[bool]  # whether the sequence's last known token is among its new ones
    # (KV group, row, first column, new block ids; RELEASED ones are never read)
    table_updates: list[tuple[int, int, int, list[int]]]
    cp_algo: str = "pass_kv"  # the ring for this step under context parallelism
    cp: CPStep | None = None  # under context parallelism: each rank's blocks and new tokens
    # (sequence index in this step, first, count): new tokens whose logits score the prompt
    # (prompt_logprobs), beyond the sampled ones; empty unless a request asked.
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    # (index among the step's new tokens, row of the previous step's sampled ids): tokens
    # that were sampled on the device and not read by the host yet (async scheduling)
    pending: list[tuple[int, int]] = field(default_factory=list)
    # (sequence index in this step, d): the sequence's last d new tokens are drafts
    # (speculative decoding); the logits of its d rows before the last come back too.
    drafts: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_batch(cls, batch, layout: CPLayout | None = None) -> StepInput:
        """The step's message; marks each sequence's blocks as sent to the runners.
        batch: the scheduler's ScheduledBatch (its sequences, and each one's new-token count).
        layout: the block manager's, which speaks for the blocks when there are CP ranks."""
        rows, token_ids, starts, sample, scored, drafts = [], [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, d = seq.num_computed_tokens, len(seq.draft_token_ids)
            rows.append(seq.row)
            token_ids.append(seq.token_slice(start, start + n - d) + seq.draft_token_ids)
            starts.append(start)
            sample.append(start + n - d == seq.num_tokens)
            if d:
                drafts.append((i, d))
            if seq.prompt_logprobs is not None:
                first, count = seq.prompt_logits_wanted(start, n)
                if count:
                    scored.append((i, first, count))
        if layout is not None and layout.num_ranks > 1:
            cp = layout.step(batch.seqs, batch.num_tokens)
            return cls(rows, token_ids, starts, sample, [], cp=cp, scored=scored, drafts=drafts)
        updates = []
        for seq in batch.seqs:
            if len(seq.block_table) > seq.num_synced_blocks:
                for group, table in enumerate(seq.block_tables):
                    updates.append((group, seq.row, seq.num_synced_blocks, table[seq.num_synced_blocks :]))
                seq.num_synced_blocks = len(seq.block_table)
        return cls(rows, token_ids, starts, sample, updates, scored=scored, drafts=drafts)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, every one sampling: the shape CUDA graphs replay."""
        return all(len(t) == 1 for t in self.token_ids) and all(self.sample) and not self.scored

    @property
    def is_verify(self) -> bool:
        """A decode step whose drafted sequences also check their drafts (speculative
        decoding): each sequence's new tokens are its last one and its drafts. Every new token
        then runs as a decode row of its own (the graphs' shape): the sequence's block table,
        its position, and the keys up to it."""
        drafted = dict(self.drafts)
        return (
            bool(self.drafts)
            and all(len(t) == 1 + drafted.get(i, 0) for i, t in enumerate(self.token_ids))
            and all(self.sample)
            and not self.scored
        )

    def logit_rows(self) -> list[int]:
        """Packed new-token rows whose logits the step returns: the last row of each sampling
        sequence, then the scored rows (in `scored` order), then each drafted sequence's rows
        before its last (in `drafts` order)."""
        ends = list(itertools.accumulate(len(t) for t in self.token_ids))
        rows = [end - 1 for end, sample in zip(ends, self.sample) if sample]
        for i, first, count in self.scored:
            begin = ends[i] - len(self.token_ids[i]) + first
            rows += range(begin, begin + count)
        for i, d in self.drafts:
            rows += range(ends[i] - 1 - d, ends[i] - 1)
        return rows
