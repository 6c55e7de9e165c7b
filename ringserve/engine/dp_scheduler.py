"""Data parallelism on rank 0: a scheduler and KV-cache pool per replica, and the router that
gives each new request to one of them.

Each replica (tp x cp ranks along the mesh's dp dimension) serves its own requests with its
own Scheduler, BlockManager (so its own prefix cache) and runner rows. `DataParallelScheduler`
offers the engine the one Scheduler interface over all of them. A step schedules every
replica, each within its own token budget: while any replica decodes, a long prompt is
prefilled in chunks of at most max_num_batched_tokens, so a replica with only decode work
waits at most one such chunk per token when the replicas step together. The step's batch
lists replica 0's sequences first, then replica 1's, and so on; `step_input` makes each
replica's part of it.

Routing, as vLLM's data-parallel load balancing: the replica with the least load, counted in
the tokens of its waiting and running sequences; among equally loaded ones, the one whose
prefix cache holds the longest prefix of the request; then the lowest index.
"""

from __future__ import annotations

from collections.abc import Callable

from ringserve.engine.scheduler import ScheduledBatch, Scheduler
from ringserve.engine.sequence import Sequence
from ringserve.worker.dp_step import DataParallelStep
from ringserve.worker.step_input import StepInput


class DataParallelScheduler:
    def __init__(self, replicas: list[Scheduler]):
        self.replicas = replicas
        self.requests_routed = [0] * len(replicas)  # requests given to each replica so far

    # The per-replica limits (every replica has the same).
    @property
    def max_num_batched_tokens(self) -> int:
        return self.replicas[0].max_num_batched_tokens

    @property
    def max_prefill_tokens(self) -> int:
        return self.replicas[0].max_prefill_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.replicas[0].max_num_seqs

    @property
    def running(self) -> list[Sequence]:
        return [seq for s in self.replicas for seq in s.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for s in self.replicas for seq in s.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.replicas)

    def load(self, replica: int) -> int:
        """Tokens of the replica's waiting and running sequences."""
        s = self.replicas[replica]
        return sum(seq.num_tokens for seq in s.waiting) + sum(seq.num_tokens for seq in s.running)

    def route(self, seq: Sequence) -> int:
        """The replica that should serve a new request (see the module's docstring)."""
        loads = [self.load(r) for r in range(len(self.replicas))]
        least = [r for r, load in enumerate(loads) if load == min(loads)]
        if len(least) == 1:
            return least[0]
        cached = [self.replicas[r].block_manager.num_cached_prefix_blocks(seq) for r in least]
        return least[cached.index(max(cached))]

    def add(self, seq: Sequence) -> None:
        seq.replica = self.route(seq)
        self.requests_routed[seq.replica] += 1
        self.replicas[seq.replica].add(seq)

    def finish(self, seq: Sequence) -> None:
        self.replicas[seq.replica].finish(seq)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.replicas)

    def schedule(self) -> ScheduledBatch:
        """Every replica's next step, replica after replica; each takes the decode budget
        while any replica decodes, as they step together."""
        batch = ScheduledBatch([], [])
        decoding = any(s.decoding() for s in self.replicas)
        for s in self.replicas:
            part = s.schedule(decoding)
            batch.seqs += part.seqs
            batch.num_tokens += part.num_tokens
        return batch

    def step_input(
        self, batch: ScheduledBatch, choose_cp_algo: Callable[[ScheduledBatch], str] | None = None
    ) -> DataParallelStep:
        """The message of a step: each replica's part of the batch (a replica with nothing
        scheduled gets an empty StepInput). choose_cp_algo(part): the ring of a replica's
        part, under context parallelism."""
        parts = [ScheduledBatch([], []) for _ in self.replicas]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            parts[seq.replica].seqs.append(seq)
            parts[seq.replica].num_tokens.append(n)
        steps = []
        for part, scheduler in zip(parts, self.replicas):
            if not part:
                steps.append(StepInput([], [], [], [], []))
                continue
            step = StepInput.from_batch(part, scheduler.block_manager.layout)
            if choose_cp_algo is not None:
                step.cp_algo = choose_cp_algo(part)
            steps.append(step)
        return DataParallelStep(steps)
