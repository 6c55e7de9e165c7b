"""Async scheduling: the next step is scheduled and launched before the previous step's
tokens are read. Every output must equal the synchronous engine's, token for token, for
whatever ends a request (length, EOS, stop token, stop string, abort) and through
preemption, prefix-cache hits and logprobs; and the overlap must really happen."""

import pytest
import torch

from ringserve import LLM, SamplingParams

from helpers import prompts_of_lengths


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def run(folder, requests, async_scheduling, abort_at=None, **kw):
    """Drive the engine step by step; requests = [(prompt, params)]. abort_at: (step, index).
    Returns each request's final output and the engine's counters."""
    with LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, params) for p, params in requests]
        finals, steps, streamed = {}, 0, {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        while engine.has_unfinished():
            if abort_at is not None and steps == abort_at[0]:
                engine.abort(ids[abort_at[1]])
            for out in engine.step():
                streamed[out.request_id] += out.new_token_ids
                for lp in out.new_logprobs or []:
                    logprobs[out.request_id].append((lp.token_id, round(lp.logprob, 4)))
                if out.finished:
                    finals[out.request_id] = out
            steps += 1
        free_blocks = engine.block_manager.num_free_blocks
        counters = dict(
            ahead=engine.steps_scheduled_ahead,
            computed=engine.num_computed_tokens,
            preemptions=engine.num_preemptions,
            free=free_blocks,
            total=engine.block_manager.num_blocks,
        )
    results = []
    for rid in ids:
        out = finals.get(rid)
        if out is not None:  # the stream carried exactly the final tokens, none past the end
            assert streamed[rid] == out.token_ids
        results.append(
            None
            if out is None
            else (
                out.token_ids,
                out.text,
                out.finish_reason,
                out.stop_reason,
                logprobs[rid],
                out.prompt_logprobs,
            )
        )
    return results, counters


def mixed_requests(eos_token):
    prompts = prompts_of_lengths([5, 30, 12, 21, 9, 40], seed=3)
    return [
        (prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=11, ignore_eos=True)),
        # Ends on a stop token the greedy run reaches mid-way (found below, per model).
        (prompts[4], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[eos_token])),
        (prompts[5], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=3)),
        (prompts[1], SamplingParams(max_tokens=0, prompt_logprobs=2)),  # scores the prompt, no token
    ]


def a_token_greedy_reaches(folder, prompt, step=5):
    with LLM(folder, device="cpu", dtype="float32", async_scheduling=False) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=step + 1, temperature=0, ignore_eos=True))
    return out[0].token_ids[step]


def test_outputs_equal_the_synchronous_engine(llama):
    stop = a_token_greedy_reaches(llama, prompts_of_lengths([5, 30, 12, 21, 9, 40], seed=3)[4])
    requests = mixed_requests(stop)
    sync, _ = run(llama, requests, False)
    overlapped, counters = run(llama, requests, True)
    assert overlapped == sync
    assert sync[4][2] == "stop" and len(sync[4][0]) < 20  # the stop token did end it early
    assert counters["ahead"] > 10  # most decode steps were launched ahead
    assert counters["free"] == counters["total"]  # every block came back


def test_preemption_and_prefix_cache_hits_equal_the_synchronous_engine(llama):
    # Few blocks: running sequences are preempted and recomputed; shared prefixes hit the cache.
    shared = prompts_of_lengths([32], seed=5)[0]
    tails = prompts_of_lengths([3, 7, 5, 9], seed=6)
    requests = [
        (shared + t, SamplingParams(max_tokens=24, temperature=0.7, seed=i, ignore_eos=True))
        for i, t in enumerate(tails)
    ]
    kw = dict(block_size=8, num_blocks=22, max_num_seqs=4, max_model_len=120)
    sync, sync_counters = run(llama, requests, False, **kw)
    overlapped, counters = run(llama, requests, True, **kw)
    assert overlapped == sync
    assert counters["preemptions"] > 0 and sync_counters["preemptions"] > 0
    assert counters["ahead"] > 0
    assert counters["free"] == counters["total"]


def test_no_token_is_computed_past_a_length_limit(llama):
    """A sequence whose pending token reaches max_tokens or max_model_len is not scheduled
    again: the overlapped engine computes exactly the synchronous engine's tokens."""
    prompts = prompts_of_lengths([7, 13, 30], seed=4)
    requests = [
        (p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)) for p, m in zip(prompts, (1, 6, 40))
    ]
    kw = dict(max_model_len=40)  # the third ends on the context, not on max_tokens
    sync, sync_counters = run(llama, requests, False, **kw)
    overlapped, counters = run(llama, requests, True, **kw)
    assert overlapped == sync
    assert [len(r[0]) for r in sync] == [1, 6, 10]
    assert counters["computed"] == sync_counters["computed"]
    assert counters["ahead"] > 0


def test_abort_while_a_step_is_in_flight(llama):
    requests = [
        (p, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))
        for p in prompts_of_lengths([6, 11, 8], seed=9)
    ]
    sync, _ = run(llama, requests, False, abort_at=(5, 1))
    overlapped, counters = run(llama, requests, True, abort_at=(5, 1))
    assert overlapped[1] is None and sync[1] is None
    assert overlapped == sync
    assert counters["free"] == counters["total"]


def test_stop_string_ends_the_text_as_the_synchronous_engine_does(builtin_dir):
    prompt = "The capital of France is"
    with LLM(builtin_dir, device="cpu", dtype="float32", async_scheduling=False) as llm:
        text = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].text
    stop = text.strip().split()[2]  # a word a few tokens in
    params = SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    sync, _ = run(builtin_dir, [(prompt, params)], False)
    overlapped, _ = run(builtin_dir, [(prompt, params)], True)
    assert overlapped == sync
    assert sync[0][2] == "stop" and sync[0][3] == stop and stop not in sync[0][1]


def test_pending_tokens_reach_the_model_from_the_device(llama):
    """The placeholder the host holds must never reach the model: run the runner with a
    step whose token is pending and compare with the real id given on the host; on the
    eager path, and on the decode graphs' (run without capture on the CPU)."""
    from ringserve.worker.graphs import DecodeGraphs
    from ringserve.worker.step_input import StepInput

    with LLM(llama, device="cpu", dtype="float32", enable_prefix_caching=False) as llm:
        runner = llm.engine.executor.worker.runner
        prompt = prompts_of_lengths([10], seed=2)[0]
        table = list(range(2))  # blocks 0 and 1 hold positions 0..31 (block size 16)
        prefill = StepInput([0], [prompt], [0], [True], [(0, 0, 0, table)])  # group 0, row 0
        runner.forward(prefill)
        real = StepInput([0], [[42]], [10], [True], [])
        expected = runner.forward(real).clone()
        pending = StepInput([0], [[-1]], [10], [True], [], pending=[(0, 2)])
        sampled = torch.tensor([7, 8, 42])  # the previous step's ids; row 2 is this sequence's
        got = runner.forward(pending, pending_tokens=sampled)
        runner.graphs = DecodeGraphs(runner, max_batch=4, capture=False)
        got_graphs = runner.forward(pending, pending_tokens=sampled)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(got_graphs, expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_overlaps_steps_only_while_drafting_is_off(llama, method):
    """Speculative decoding with async scheduling and disable_by_batch_size 4: while 4 or more
    sequences run, steps overlap (no drafts); as they finish, drafts are made from the tokens
    read, checked in synchronous steps. The outputs equal the synchronous engine's without
    speculation, and both kinds of step happened."""
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 4}
    if method == "ngram":
        spec.update(method="ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        spec.update(method="draft_model", model=llama)
    prompts = [(p * 3)[:40] for p in prompts_of_lengths([3, 4, 5, 6, 7, 3], seed=8)]
    requests = [
        (p, SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    plain, _ = run(llama, requests, False)
    with LLM(llama, device="cpu", dtype="float32", async_scheduling=True, speculative_config=spec) as llm:
        outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        ahead, stats = llm.engine.steps_scheduled_ahead, llm.engine.spec_stats
    assert [list(o.token_ids) for o in outputs] == [list(r[0]) for r in plain]
    assert ahead > 3 and stats.num_drafts > 3 and stats.num_accepted_tokens > 0, (ahead, stats)


def test_a_drafted_step_in_flight_is_read_before_a_step_without_drafts(llama):
    """Two sequences draft (below disable_by_batch_size 4); three more arrive while a drafted
    step is in flight, so the next step drafts none. It must not run beside the drafted one:
    how many of that step's tokens each sequence keeps is known only once it is read. The
    tokens equal the synchronous engine's without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompts = [(p * 3)[:40] for p in prompts_of_lengths([3, 4, 5, 6, 7], seed=9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _ = run(llama, [(p, params) for p in prompts], False)
    with LLM(
        llama, device="cpu", dtype="float32", async_scheduling=True,
        speculative_config={**spec, "disable_by_batch_size": 4},
    ) as llm:  # fmt: skip
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts[:2]]
        finals, steps = {}, 0
        while engine.has_unfinished():
            if steps == 4:
                assert engine.spec_stats.num_drafts > 0 and engine._inflight.drafts is not None
                ids += [engine.add_request(p, params) for p in prompts[2:]]
            finals.update({out.request_id: out for out in engine.step() if out.finished})
            steps += 1
    assert [list(finals[rid].token_ids) for rid in ids] == [list(r[0]) for r in plain]
