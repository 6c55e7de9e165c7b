"""Continuous batching: which sequences compute how many tokens in the next step.

Each step spends a token budget: running sequences first (a decode token each, or the
next chunk of a long prompt), then waiting ones are admitted while budget and blocks
last. The budget adapts to the work: max_num_batched_tokens while some sequence decodes,
so its next token waits for at most that much prefill, and the larger max_prefill_tokens
while none does, so a long prompt alone (or a burst of new ones) runs in large chunks at
the speed of one step. When blocks run out, the most recently admitted sequence is
preempted: its blocks are freed and it waits to be recomputed (its full blocks usually
survive in the prefix cache, so recomputation is cheap).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ringserve.engine.block_manager import BlockManager
from ringserve.engine.sequence import Sequence, Status
from ringserve.errors import RequestTooLargeError

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    # new tokens computed for each sequence this step, its drafts (seq.draft_token_ids) included
    num_tokens: list[int]

    def __bool__(self):
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_prefill_tokens: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_prefill_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Each running sequence holds a row of the runners' persistent step state (block
        # table, length) from admission to finish or preemption.
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self._release_row(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def take_row(self, seq: Sequence) -> None:
        """Give a sequence a row of the runners' step state; its block table there starts empty."""
        seq.row = self.free_rows.pop()
        seq.num_synced_blocks = 0
        seq.num_admissions += 1

    def _release_row(self, seq: Sequence) -> None:
        self.free_rows.append(seq.row)
        seq.row = None

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s: out of KV-cache blocks", seq.request_id)
        seq.draft_token_ids = []
        self.running.remove(seq)
        self._release_row(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fitting_chunk(self, seq: Sequence, n: int) -> int:
        """Alone, a sequence whose windowed layers release blocks between chunks (a hybrid
        or windowed model; a long preempted one, say) may fit in smaller chunks: the first
        of n / 2, n / 4, .. whose blocks are allocated; 0 when none fits."""
        if not self.block_manager.fits_in_chunks(seq):
            return 0
        while n > 1:
            n //= 2
            if self.block_manager.allocate(seq, n):
                return n
        return 0

    def decoding(self) -> bool:
        """Whether some running sequence has its prompt computed (a token a step from now on;
        one whose last token ends it when read computes nothing more)."""
        return any(seq.num_uncomputed_tokens <= 1 and not seq.ends_when_read for seq in self.running)

    def _chunk(self, seq: Sequence, budget: int, scored: int) -> int:
        """Tokens of seq in this step: its uncomputed ones within the budget, and within
        `scored` (max_num_batched_tokens a step) when every row gives prompt logprobs, whose
        [rows, vocabulary] float32 logits would not fit a large prefill budget's rows."""
        n = min(seq.num_uncomputed_tokens, budget)
        return min(n, scored) if seq.needs_prompt_logits else n

    def schedule(self, decoding: bool | None = None) -> ScheduledBatch:
        """decoding: whether some sequence that steps with this one decodes (data-parallel
        replicas step together); default: decoding()."""
        decoding = self.decoding() if decoding is None else decoding
        budget = self.max_num_batched_tokens if decoding else self.max_prefill_tokens
        batch = ScheduledBatch([], [])
        preempted = False
        scored = self.max_num_batched_tokens  # rows of prompt logprobs left in this step
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if seq.ends_when_read:  # its last token is on the device and ends it: nothing to compute
                continue
            n = self._chunk(seq, budget, scored)
            if n == 0 and seq.needs_prompt_logits:  # this step's prompt-logprob rows are spent
                continue
            if seq.draft_token_ids:  # checked with its last token, as the budget and blocks allow
                del seq.draft_token_ids[budget - n :]
                if not self.block_manager.allocate(seq, n + len(seq.draft_token_ids)):
                    seq.draft_token_ids = []
                n += len(seq.draft_token_ids)
            allocated = self.block_manager.allocate(seq, n)
            if not allocated and n > self.max_num_batched_tokens:
                n = self.max_num_batched_tokens  # a smaller chunk before preempting anyone
                allocated = self.block_manager.allocate(seq, n)
            while not allocated:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                allocated = self.block_manager.allocate(seq, n)
            if seq.status is Status.RUNNING:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
                scored -= n if seq.needs_prompt_logits else 0
        # Admit waiting sequences only when nothing was preempted: otherwise they would
        # take the blocks just freed and the preempted sequence could starve.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Cached tokens have no logits: a request that still wants its prompt's
            # logprobs computes the whole prompt (its blocks still fill the cache).
            if not seq.block_tables and not seq.needs_prompt_logits:
                self.block_manager.match_prefix(seq)
            n = self._chunk(seq, budget, scored)
            if n == 0 and seq.needs_prompt_logits:  # this step's prompt-logprob rows are spent
                break
            if not self.block_manager.allocate(seq, n):
                n = self._fitting_chunk(seq, n) if not self.running and not batch else 0
            if n == 0:
                if not self.running and not batch:
                    # Alone and still too big: even the whole cache cannot hold it. It leaves
                    # the queue (finished), so the next step serves the others.
                    self.waiting.popleft()
                    self.block_manager.free(seq)
                    seq.status = Status.FINISHED
                    raise RequestTooLargeError(
                        f"request {seq.request_id} needs more KV-cache blocks than exist "
                        f"({self.block_manager.num_blocks}); raise --num-blocks or lower --max-model-len",
                        seq.request_id,
                    )
                self.block_manager.free(seq)
                break
            self.waiting.popleft()
            seq.draft_token_ids = []  # drafts go to running sequences only
            seq.status = Status.RUNNING
            self.take_row(seq)
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            scored -= n if seq.needs_prompt_logits else 0
        return batch
