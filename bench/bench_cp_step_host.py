"""Host time of one context-parallel decode step, per rank, at a long cached context (CPU).

  python bench/bench_cp_step_host.py [--cp 8] [--context 1048576] [--batch 1] [--steps 10] [--threads 1]

One process plays rank 0 of a CP group (a `fake` process group of --cp ranks: nothing is
sent), with the engine's own block manager, CP layout and ModelRunner over a tiny model's
KV cache. A prompt of --context tokens (split over --batch sequences) is placed and sent to
the runner's step state as its prefill would be; then each decode step is timed from the
driver's StepInput to the ring's attention metadata for every rank (what a rank prepares on
the host before the model runs): median ms per step, and the host-built index elements.
The model itself does not run, so the figure is the step's preparation alone. Where the
checkout gathers a rank's key slots (before pass-Q decode read the cache in place) with
tensor ops meant for the device (BlockTables.key_slots: O(keys on the rank), queued
asynchronously on a GPU), that part is timed alone too, since on a CPU it runs on the host.
--threads: torch's intra-op threads (1 by default: on a small shared box more threads only
contend).

Before/after: the same script runs against an older checkout (PYTHONPATH=that tree), whose
StepInput.from_batch takes no layout.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ringserve.config import ModelConfig
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.engine.sequence import Sequence
from ringserve.model.weights import build_model
from ringserve.sampling_params import SamplingParams
from ringserve.worker.kv_cache import KVCache
from ringserve.worker.kv_groups import KVGroups
from ringserve.worker.runner import ModelRunner
from ringserve.worker.step_input import StepInput

BLOCK = 16


def tiny_config(max_len: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_len,
    )


def step_input(batch: ScheduledBatch, manager: BlockManager) -> StepInput:
    if "layout" in inspect.signature(StepInput.from_batch).parameters:
        return StepInput.from_batch(batch, manager.layout)
    return StepInput.from_batch(batch)  # before the CP layout: every rank reads whole tables


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cp, batch_size = args.cp, args.batch
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    per_seq = args.context // batch_size
    max_len = per_seq + args.steps + 1
    blocks_per_rank = batch_size * (-(-max_len // BLOCK) // cp + 2 * cp)  # room for placement skew
    config = tiny_config(max_len)
    model = build_model(config, torch.device("cpu"), torch.float32)
    kv_cache = KVCache(KVGroups.for_model(config), blocks_per_rank, BLOCK, 2, 16, torch.float32, "cpu")
    runner = ModelRunner(
        model, kv_cache, torch.device("cpu"), None, None, batch_size, max_len, cp_group=dist.group.WORLD
    )
    manager = BlockManager(blocks_per_rank * cp, BLOCK, False, cp)
    seqs = []
    for i in range(batch_size):
        seq = Sequence(str(i), [1] * per_seq, SamplingParams(temperature=0))
        seq.row = i
        assert manager.allocate(seq, per_seq)
        seqs.append(seq)
    # The prefill's blocks reach the runner's step state (its attention is not timed).
    prefill = step_input(ScheduledBatch(seqs, [per_seq] * batch_size), manager)
    runner._apply_table_updates(prefill)
    for seq in seqs:
        seq.num_computed_tokens = per_seq
    times, elements, key_index = [], [], []
    for _ in range(args.steps):
        for seq in seqs:
            seq.output_token_ids.append(1)
            assert manager.allocate(seq, 1)
        before = runner.host_elements
        start = time.perf_counter()
        step = step_input(ScheduledBatch(seqs, [1] * batch_size), manager)
        step.cp_algo = "pass_q"
        ctx = runner.prepare(step)[2]
        ring = ctx.ring
        if getattr(ring, "paged_keys", None) is None:
            # Checkouts that gather a rank's keys: the metadata of every rank's queries
            # against them (a ring that reads in place made its paged batches already).
            for src in range(cp):
                ring._batch(src, ring.rank)
        times.append((time.perf_counter() - start) * 1000)
        elements.append(runner.host_elements - before)
        if getattr(ctx, "local_slots", None) is not None and hasattr(runner.block_tables, "key_slots"):
            my_keys = ring.step.keys[ring.rank].tolist()
            start = time.perf_counter()
            runner.block_tables.key_slots(step.rows, my_keys, BLOCK)
            key_index.append((time.perf_counter() - start) * 1000)
        for seq in seqs:
            seq.num_computed_tokens += 1
    print(
        f"cp={cp} context={args.context} batch={batch_size}: "
        f"{statistics.median(times):.2f} ms per decode step (median of {args.steps}), "
        f"host elements per step {statistics.median(elements):.0f}"
        + (
            f"; of which the device-side key index {statistics.median(key_index):.2f} ms, "
            f"the rest {statistics.median(t - k for t, k in zip(times, key_index)):.2f} ms"
            if key_index
            else ""
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
