"""One step of every data-parallel replica: rank 0 builds it, each rank runs its replica's
part, and the replicas' logits come back to rank 0.

Rank 0 schedules every replica and builds the step (DataParallelScheduler.step_input, in
engine/dp_scheduler.py), then sends one `DataParallelStep` to all ranks; each rank runs the
StepInput of its own replica on its own runner (rows and blocks are the replica's). The
replica leaders (cp_rank 0, tp_rank 0, which hold their replica's full logits) gather them
to rank 0 over their dp group, where they are put in the order the engine reads: every
replica's sampled rows, replica after replica, then every replica's scored (prompt
logprobs) rows.

When the EP groups span replicas (ParallelConfig.ep_spans_dp), every MoE layer's dispatch
and combine needs every rank: a replica with nothing scheduled still joins each of them,
with no tokens of its own (`join_expert_layers`), so the others never wait in a collective
for it. Otherwise an idle replica's ranks skip the step (its leader still joins the gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.model.decoder import Transformer
from ringserve.worker.step_input import StepInput


@dataclass
class DataParallelStep:
    """replicas[r]: what replica r computes this step (no rows: nothing)."""

    replicas: list[StepInput]

    # The step as one StepInput of the whole batch, for the engine (sampling, prompt logprobs).

    @property
    def token_ids(self) -> list[list[int]]:
        return [t for s in self.replicas for t in s.token_ids]

    @property
    def starts(self) -> list[int]:
        return [start for s in self.replicas for start in s.starts]

    @property
    def sample(self) -> list[bool]:
        return [x for s in self.replicas for x in s.sample]

    @property
    def scored(self) -> list[tuple[int, int, int]]:
        """(index in the whole batch, first, count) of each replica's scored rows."""
        scored, offset = [], 0
        for s in self.replicas:
            scored += [(i + offset, first, count) for i, first, count in s.scored]
            offset += len(s.rows)
        return scored

    @property
    def pending(self) -> list[tuple[int, int]]:
        return []  # tokens pending on the device need one rank (async scheduling)

    @property
    def drafts(self) -> list[tuple[int, int]]:
        """(index in the whole batch, d) of each replica's drafted sequences."""
        drafts, offset = [], 0
        for s in self.replicas:
            drafts += [(i + offset, d) for i, d in s.drafts]
            offset += len(s.rows)
        return drafts

    def logit_counts(self, all_logits: bool) -> list[tuple[int, int, int]]:
        """Per replica, its (sampled, scored, draft) rows (StepInput.logit_rows), or with
        all_logits every new token's row (and none of the others)."""
        if all_logits:
            return [(sum(len(t) for t in s.token_ids), 0, 0) for s in self.replicas]
        return [
            (sum(s.sample), sum(count for _, _, count in s.scored), sum(d for _, d in s.drafts))
            for s in self.replicas
        ]

    def assemble(self, per_replica: list[torch.Tensor], all_logits: bool) -> torch.Tensor:
        """Each replica's logits (padded rows after its own) -> the whole step's, in the
        engine's order: [S_0 .. S_n-1, R_0 .. R_n-1, D_0 .. D_n-1, V]."""
        counts = self.logit_counts(all_logits)
        parts: list[list[torch.Tensor]] = [[], [], []]
        for x, sizes in zip(per_replica, counts):
            first = 0
            for kind, size in enumerate(sizes):
                parts[kind].append(x[first : first + size])
                first += size
        return torch.cat([rows for part in parts for rows in part])


@torch.inference_mode()
def join_expert_layers(model: Transformer, run_experts) -> None:
    """An idle replica's part in a lockstep step: every MoE layer's dispatch and combine, in
    layer order, with no tokens of its own (x [0, H], expert ids and weights [0, k])."""
    c, weight = model.config, model.lm_head.weight
    x = weight.new_empty(0, c.hidden_size)
    expert_ids = torch.empty(0, c.num_experts_per_tok, dtype=torch.int64, device=weight.device)
    weights = weight.new_empty(0, c.num_experts_per_tok)
    for block in model.moe_blocks():
        run_experts(block.experts, x, expert_ids, weights)


def run_replica_step(worker, step: DataParallelStep, all_logits: bool) -> torch.Tensor | None:
    """This rank's part of a data-parallel step: its replica's forward, then (replica leaders)
    the gather of logits to rank 0. Returns the whole step's logits on rank 0, else None."""
    groups = worker.groups
    mine = step.replicas[groups.dp_rank]
    logits = None
    if mine.rows:
        logits = worker.runner.forward(mine, all_logits)
    elif groups.mesh.parallel.ep_spans_dp:
        join_expert_layers(worker.model, worker.run_experts)
    if not groups.replica_leader:
        return None
    capture = worker.model.hidden_capture  # an EAGLE-3 head's input: every replica's to rank 0
    if capture is not None:
        capture.gather_replicas([sum(len(t) for t in s.token_ids) for s in step.replicas], groups.dp_group)
    longest = max(sum(counts) for counts in step.logit_counts(all_logits))
    if logits is not None and logits.shape[0] == longest:
        padded = logits.contiguous()
    else:  # [longest, V]: this replica's rows first; the rest is never read
        padded = torch.empty(
            longest, worker.model.config.vocab_size, dtype=torch.float32, device=worker.device
        )
        if logits is not None:
            padded[: logits.shape[0]] = logits
    if longest == 0:  # nothing sampled or scored anywhere (prefill chunks): nothing to gather
        return padded if groups.rank == 0 else None
    gathered = [torch.empty_like(padded) for _ in range(groups.dp_size)] if groups.rank == 0 else None
    dist.gather(padded, gathered, dst=0, group=groups.dp_group)
    return step.assemble(gathered, all_logits) if groups.rank == 0 else None
