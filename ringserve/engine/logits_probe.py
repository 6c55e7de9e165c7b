"""The logits of every position of a token sequence through the engine's own step path
(prefill, chunks after a cached prefix, then decode through the paged cache): what the tests
and the GPU checks compare with transformers' logits."""

from __future__ import annotations

import torch

from ringserve.engine.scheduler import ScheduledBatch
from ringserve.engine.sequence import Sequence
from ringserve.sampling_params import SamplingParams
from ringserve.worker.step_input import StepInput


def engine_logits(engine, token_ids: list[int], prefill: int, chunks: list[int] = ()) -> torch.Tensor:
    """Logits [len, V] of every position: `prefill` tokens in one step, then a step per
    chunk (sizes in `chunks`) after that cached prefix, then one token per step through
    the paged cache, as decoding computes them (under CP through the ring the engine picks)."""
    seq = Sequence("probe", token_ids[:prefill], SamplingParams())
    engine.scheduler.take_row(seq)
    rows = []
    steps = [prefill, *chunks] + [1] * (len(token_ids) - prefill - sum(chunks))
    for n in steps:
        seq.prompt_token_ids = token_ids[: seq.num_computed_tokens + n]
        assert engine.block_manager.allocate(seq, n)
        batch = ScheduledBatch([seq], [n])
        step = StepInput.from_batch(batch, engine.block_manager.layout)
        step.cp_algo = engine.cp_policy.choose(batch)  # the engine's ring (a forced one, or auto)
        rows.append(engine.executor.execute(step, all_logits=True))
        seq.num_computed_tokens += n
        engine.block_manager.release_outside_window(seq)
    engine.block_manager.free(seq)
    engine.scheduler.free_rows.append(seq.row)
    return torch.cat(rows)
