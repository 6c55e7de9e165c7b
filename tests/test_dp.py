"""Data parallelism on gloo ranks: dense replicas, and MoE layers expert-parallel across the
replicas' data-parallel attention. Every result against the single-rank run (checked against
transformers by the model tests) and transformers' greedy tokens, under uneven load."""

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringserve import LLM, SamplingParams
from ringserve.config import ParallelConfig
from ringserve.engine import engine as engine_module
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.dp_scheduler import DataParallelScheduler
from ringserve.engine.executor import WorkerError
from ringserve.engine.logits_probe import engine_logits
from ringserve.engine.scheduler import Scheduler
from ringserve.engine.sequence import Sequence
from ringserve.model.tiny_models import hf_greedy, hf_model
from ringserve.options import OptionError
from ringserve.server.async_engine import AsyncEngine
from ringserve.server.metrics import Metrics

ENGINE = dict(device="cpu", dtype="float32", block_size=4, timeout_s=60)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# Dense replicas ------------------------------------------------------------------------------

DENSE_PROMPTS = [[7 + i, 40 - i, 3 * i + 1, 99, 5, 200 - i] for i in range(6)]


def _tokens_and_prompt_logprobs(outputs) -> tuple[list, list, list[float]]:
    """Each output's tokens, the token ids its prompt logprobs score, and their values."""
    scored = [[p for p in o.prompt_logprobs or [] if p is not None] for o in outputs]
    return (
        [o.token_ids for o in outputs],
        [[p.token_id for p in s] for s in scored],
        [p.logprob for s in scored for p in s],
    )


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, tp=2)])
def test_dense_replicas_equal_one_rank_and_share_the_requests(layout, tiny_model_dir):
    folder = tiny_model_dir("llama")
    # Requests 0 and 3 (one on each replica) also score their prompts: sampled and scored rows.
    params = [
        SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2 if i % 3 == 0 else None
        )
        for i in range(len(DENSE_PROMPTS))
    ]
    with LLM(folder, **ENGINE) as llm:
        expected = _tokens_and_prompt_logprobs(llm.generate(DENSE_PROMPTS, params))
    with LLM(folder, **ENGINE, **layout) as llm:
        assert llm.engine.parallel.world_size == 2 * layout.get("tp", 1)
        got = _tokens_and_prompt_logprobs(llm.generate(DENSE_PROMPTS, params))
        routed = llm.engine.scheduler.requests_routed
    assert got[:2] == expected[:2]
    assert got[2] == pytest.approx(expected[2], abs=1e-4) and len(got[2]) == 10  # 2 prompts of 6
    assert routed == [3, 3]  # prompts of equal length: each replica takes every other one


# Routing, on rank 0's schedulers alone ---------------------------------------------------------


def _replicas(n, num_blocks=32, block_size=4):
    return DataParallelScheduler([Scheduler(BlockManager(num_blocks, block_size), 64, 8) for _ in range(n)])


def _seq(rid, tokens):
    return Sequence(rid, tokens, greedy(4))


def test_requests_go_to_the_replica_with_the_fewest_tokens():
    dp = _replicas(3)
    dp.add(_seq("long", list(range(40))))  # replica 0: 40 tokens
    dp.add(_seq("a", list(range(10))))  # replica 1: 10
    dp.add(_seq("b", list(range(12))))  # replica 2: 12
    dp.add(_seq("c", list(range(5))))  # replica 1 (10 < 12 < 40): 15
    dp.add(_seq("d", list(range(5))))  # replica 2 (12 < 15): 17
    assert [s.request_id for s in dp.replicas[0].waiting] == ["long"]
    assert [s.request_id for s in dp.replicas[1].waiting] == ["a", "c"]
    assert [s.request_id for s in dp.replicas[2].waiting] == ["b", "d"]
    assert dp.requests_routed == [1, 2, 2]
    # Running tokens count too: once scheduled, replica 0's sequence still weighs 40.
    batch = dp.schedule()
    assert [s.replica for s in batch.seqs] == [0, 1, 1, 2, 2]  # replica after replica
    dp.add(_seq("e", list(range(3))))
    assert dp.replicas[1].waiting[-1].request_id == "e"


def test_the_replica_holding_the_prefix_wins_a_tie():
    dp = _replicas(2)
    prefix = list(range(100, 116))  # four full blocks
    # Replica 1 served a request with this prefix; it finished, its blocks stay cached.
    done = _seq("done", prefix + [1, 2])
    dp.replicas[1].block_manager.allocate(done, done.num_tokens)
    done.num_computed_tokens = done.num_tokens
    dp.replicas[1].block_manager.cache_full_blocks(done)
    dp.replicas[1].block_manager.free(done)
    assert dp.load(0) == dp.load(1) == 0
    dp.add(_seq("same prefix", prefix + [7, 8, 9]))
    assert dp.replicas[1].waiting[0].request_id == "same prefix"
    dp.add(_seq("other", list(range(19))))  # not a tie: replica 0 is the less loaded
    assert dp.replicas[0].waiting[0].request_id == "other"
    dp.finish(dp.replicas[0].waiting[0])
    dp.finish(dp.replicas[1].waiting[0])
    dp.add(_seq("no prefix", list(range(19))))  # a tie, no cached prefix anywhere: replica 0
    assert dp.replicas[0].waiting[0].request_id == "no prefix"


# MoE: experts over the replicas --------------------------------------------------------------

# (request, prompt, max_tokens, the step it arrives at). With 8 tokens per step, "long" is
# prefilled in 5 chunks while "short" decodes on another replica; "late" arrives at a replica
# that was idle (with 4 replicas) or joins "short" (with 2, whose replica then idles while
# "long" decodes on).
REQUESTS = [
    ("long", list(range(3, 40)), 12, 0),
    ("short", [5, 17, 42, 99, 3, 250, 7], 10, 0),
    ("late", [9, 8, 7, 6, 5, 4, 200, 31], 4, 6),
]


def _longest_idle(per_step: list[list[int]], replica: int) -> int:
    """The most consecutive steps in which the replica computed no token (others did)."""
    longest = run = 0
    for tokens in per_step:
        run = run + 1 if tokens[replica] == 0 else 0
        longest = max(longest, run)
    return longest


def _run_uneven(folder, layout, monkeypatch):
    """Step the engine by hand, adding each request at its step; record every sampled row's
    logits (by request and position) and each step's tokens per replica."""
    sampled, per_step = {}, []
    real_sample = engine_module._sample_or_blame

    def recording_sample(logits, seqs, *args):
        for row, seq in zip(logits, seqs):
            sampled[(seq.request_id, seq.num_tokens - 1)] = row.clone()
        return real_sample(logits, seqs, *args)

    monkeypatch.setattr(engine_module, "_sample_or_blame", recording_sample)
    tokens = {}
    with LLM(folder, **ENGINE, max_num_batched_tokens=8, max_prefill_tokens=8, **layout) as llm:
        engine = llm.engine
        real_execute = engine.executor.execute

        def recording_execute(step, *args, **kwargs):
            parts = getattr(step, "replicas", [step])
            per_step.append([sum(len(t) for t in part.token_ids) for part in parts])
            return real_execute(step, *args, **kwargs)

        engine.executor.execute = recording_execute
        step = 0
        while step == 0 or engine.has_unfinished():
            for rid, prompt, n, at in REQUESTS:
                if at == step:
                    engine.add_request(prompt, greedy(n), rid)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            step += 1
        workers = engine.executor.worker
        experts_held = sum(b.experts.gate_proj.shape[0] for b in workers.model.moe_blocks())
        cross_host_bytes = getattr(workers.run_experts, "cross_host_bytes", 0)
    monkeypatch.undo()
    return tokens, sampled, per_step, experts_held, cross_host_bytes


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("mixtral", dict(ep=2)),  # dp=2: each replica one rank, 2 experts each
        ("mixtral", dict(ep=4)),  # dp=4, one expert per rank; a replica idle all along
        ("mixtral", dict(dp=2, tp=2, ep=4)),  # attention TP within each replica, EP over all
        ("mixtral", dict(dp=2, cp=2, ep=4, ranks_per_host=2)),  # two hosts: two-shot
    ],
)
def test_moe_over_replicas_equals_one_rank_and_transformers(arch, layout, tiny_model_dir, monkeypatch):
    folder = tiny_model_dir(arch)
    tokens, sampled, per_step, held, cross_host_bytes = _run_uneven(folder, layout, monkeypatch)
    dp = ParallelConfig(**layout).dp
    assert "dp" in ParallelConfig(**layout).ep_axes
    hf = hf_model(folder)
    with LLM(folder, **ENGINE) as ref:
        all_experts = sum(b.experts.gate_proj.shape[0] for b in ref.engine.executor.worker.model.moe_blocks())
        for rid, prompt, n, _ in REQUESTS:
            assert tokens[rid] == hf_greedy(hf, prompt, n), rid
            full = prompt + tokens[rid]
            expected = engine_logits(ref.engine, full[:-1], prefill=len(prompt))  # [len - 1, V]
            for position in range(len(prompt) - 1, len(full) - 1):
                torch.testing.assert_close(sampled[(rid, position)], expected[position], rtol=1e-4, atol=1e-4)
    assert held == all_experts // layout["ep"]
    # Uneven load: a step where one replica prefills a chunk while another decodes, and
    # every step of "long"'s chunked prefill gives "short" its decode token (it never waits
    # behind the prefill for more than the one step they share).
    prefilling = [s for s in per_step if s[0] > 1]
    assert len(prefilling) >= 4 and all(s[1] == 1 for s in prefilling[1:])
    # Some replica sat idle for several steps while another one ran.
    assert max(_longest_idle(per_step, r) for r in range(dp)) >= 3
    if dp == 4:  # the fourth replica never had a request: it joined every step idle
        assert all(s[3] == 0 for s in per_step)
    if layout.get("ranks_per_host"):
        assert cross_host_bytes > 0  # the EP group spans the two hosts: two-shot


@pytest.mark.parametrize("arch", ["mixtral", "llama4", "gpt_oss"])  # every family's MoE block
def test_an_idle_replica_does_not_hang_the_world(arch, tiny_model_dir):
    """One request on two replicas: the other replica has nothing to do in any step, and still
    joins every MoE layer's all-to-all."""
    folder = tiny_model_dir(arch)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    with LLM(folder, **ENGINE, ep=2) as llm:
        started = time.monotonic()
        (out,) = llm.generate([prompt], greedy(5))
        # Had replica 1 left replica 0 waiting in a collective, the step would fail at the timeout.
        assert time.monotonic() - started < ENGINE["timeout_s"]
        assert llm.engine.scheduler.requests_routed == [1, 0]
    assert out.token_ids == hf_greedy(hf_model(folder), prompt, 5)


def test_a_killed_rank_ends_the_whole_world_naming_it(tiny_model_dir):
    llm = LLM(tiny_model_dir("mixtral"), **ENGINE, ep=4)
    victim = llm.engine.executor.procs[2]  # rank 3: replica 3
    stream = llm.generate_stream([list(range(3, 40)), [5, 6, 7]], greedy(50))
    next(stream)
    os.kill(victim.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 3 \(pid {victim.pid}\) was killed by SIGKILL"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 20
    assert not any(p.is_alive() for p in llm.engine.executor.procs)
    llm.close()


# Errors before anything starts ---------------------------------------------------------------


def test_layouts_that_cannot_work_are_refused_before_starting(tiny_model_dir, monkeypatch):
    started = time.monotonic()
    with pytest.raises(
        OptionError, match=r"ep=3 is no product of the mesh's axes dp=1, cp=1, tp=2.*2 \(tp\)"
    ):
        LLM(tiny_model_dir("mixtral"), device="cpu", tp=2, ep=3)
    with pytest.raises(OptionError, match=r"ep=4 is no product.*dp=3, cp=1, tp=1.*3 \(dp\)"):
        LLM(tiny_model_dir("mixtral"), device="cpu", dp=3, ep=4)
    with pytest.raises(ValueError, match="ep=8 needs a mixture-of-experts model.*has 4 experts"):
        LLM(tiny_model_dir("mixtral"), device="cpu", ep=8)  # dp=8
    # Without torchrun every rank needs a GPU of this host.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"dp x cp x tp = 2 x 1 x 2 = 4 ranks need as many GPUs.*has 2"):
        LLM(tiny_model_dir("llama"), device="cuda", dp=2, tp=2)
    assert time.monotonic() - started < 10  # no process was started, no weight read


def test_ep_alone_means_as_many_replicas():
    assert (ParallelConfig(ep=4).dp, ParallelConfig(ep=4).ep_axes) == (4, ("dp",))
    assert ParallelConfig(tp=2, ep=4).ep_axes == ("dp", "tp")  # dp=2
    assert ParallelConfig(tp=2, ep=2).dp == 1  # ep over tp, as before
    assert ParallelConfig(tp=2, cp=2, ep=4).ep_axes == ("cp", "tp")
    assert ParallelConfig(dp=2, cp=2, ep=4).ep_axes == ("dp", "cp")
    assert ParallelConfig(dp=2, tp=2, cp=2, ep=8).ep_axes == ("dp", "cp", "tp")


def test_metrics_carry_each_replicas_label():
    def replica(running, waiting, free, preemptions):
        blocks = SimpleNamespace(num_free_blocks=free, num_blocks=8)
        return SimpleNamespace(
            running=[0] * running, waiting=[0] * waiting, block_manager=blocks, num_preemptions=preemptions
        )

    engine = SimpleNamespace(replicas=[replica(3, 1, 2, 0), replica(0, 0, 8, 2)], cp_steps={}, drafter=None)
    metrics = Metrics("m")
    AsyncEngine(engine, metrics=metrics)._update_gauges({})
    values = {
        (s.name, s.labels["engine"]): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
        if "engine" in s.labels
    }
    assert values[("vllm:num_requests_running", "0")] == 3 and values[("vllm:num_requests_running", "1")] == 0
    assert values[("vllm:num_requests_waiting", "0")] == 1
    assert (
        values[("vllm:kv_cache_usage_perc", "0")] == 0.75 and values[("vllm:kv_cache_usage_perc", "1")] == 0
    )
    assert (
        values[("vllm:num_preemptions_total", "0")] == 0 and values[("vllm:num_preemptions_total", "1")] == 2
    )
