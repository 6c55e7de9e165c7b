"""Continuous batching, chunked prefill, prefix caching, preemption, sampling: each checked
against the same request run alone, unchunked, uncached or unpreempted (which the model
tests check against transformers)."""

import pytest

from ringserve import LLM, RequestError, SamplingParams

from helpers import prompts_of_lengths

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def alone(folder, prompts, params=GREEDY, **kw):
    with LLM(folder, device="cpu", dtype="float32", **kw) as llm:
        return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_batch_of_different_lengths_equals_each_alone(llama):
    prompts = prompts_of_lengths([3, 17, 40, 9, 64])
    expected = alone(llama, prompts)
    with LLM(llama, device="cpu", dtype="float32", enable_prefix_caching=False) as llm:
        outs = llm.generate(prompts, GREEDY)
        # All five were prefilled in one packed step, then decoded together.
        assert llm.engine.num_computed_tokens == sum(map(len, prompts)) + 15 * len(prompts)
    assert [o.token_ids for o in outs] == expected


def test_requests_join_and_leave_mid_batch(llama):
    """Requests with different max_tokens finish at different steps; new ones join."""
    prompts = prompts_of_lengths([5, 30, 12, 21], seed=1)
    lengths = [3, 16, 7, 11]
    expected = [
        alone(llama, [p], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))[0]
        for p, m in zip(prompts, lengths)
    ]
    with LLM(llama, device="cpu", dtype="float32") as llm:
        engine = llm.engine
        ids = [
            engine.add_request(prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
            engine.add_request(prompts[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
        ]
        results = {}
        steps = 0
        while engine.has_unfinished():
            if steps == 2:  # join while the first two are decoding
                for p, m in zip(prompts[2:], lengths[2:]):
                    ids.append(
                        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
                    )
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
            steps += 1
    assert [results[i] for i in ids] == expected


def test_chunked_prefill_equals_unchunked(llama):
    prompts = prompts_of_lengths([70, 33, 5])
    expected = alone(llama, prompts)
    with LLM(llama, device="cpu", dtype="float32", max_num_batched_tokens=16, max_prefill_tokens=16) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_prefix_cache_hit_computes_fewer_tokens(llama):
    shared = prompts_of_lengths([50])[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    expected = alone(llama, [second], enable_prefix_caching=False)[0]
    with LLM(llama, device="cpu", dtype="float32", block_size=16) as llm:
        llm.generate([first], GREEDY)
        before = llm.engine.num_computed_tokens
        out = llm.generate([second], GREEDY)[0]
        computed = llm.engine.num_computed_tokens - before
    assert out.token_ids == expected
    assert out.num_cached_tokens == 48  # three full blocks of the shared 50 tokens
    # Only the 4 uncached prompt tokens are prefilled, then 15 decode steps.
    assert computed == len(second) - 48 + 15


def test_whole_prompt_cached_still_computes_last_token(llama):
    prompt = prompts_of_lengths([32])[0]  # exactly two blocks
    with LLM(llama, device="cpu", dtype="float32", block_size=16) as llm:
        a = llm.generate([prompt], GREEDY)[0]
        b = llm.generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids
    assert b.num_cached_tokens == 16  # the last block is recomputed for the last token's logits


def test_preemption_gives_the_same_tokens(llama):
    prompts = prompts_of_lengths([40, 35, 30, 45, 20, 38], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = alone(llama, prompts, params)
    # 20 blocks of 8 tokens: far fewer than the six sequences need together (~6 * 8 blocks).
    with LLM(llama, device="cpu", dtype="float32", block_size=8, num_blocks=20, max_model_len=128) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_preemption_without_prefix_cache(llama):
    prompts = prompts_of_lengths([40, 35, 30, 45], seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = alone(llama, prompts, params)
    with LLM(
        llama,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_blocks=16,
        max_model_len=128,
        enable_prefix_caching=False,
    ) as llm:
        outs = llm.generate(prompts, params)
        assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_fixed_seed_reproduces_sampled_output(llama):
    prompts = prompts_of_lengths([12, 20], seed=4)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    with LLM(llama, device="cpu", dtype="float32") as llm:
        a = llm.generate(prompts[:1], params)[0].token_ids
        # Same seed in a batch with other, differently-sampled requests: same tokens.
        batch = llm.generate(
            [prompts[0], prompts[1], prompts[1]],
            [params, SamplingParams(max_tokens=30, temperature=0.7, seed=9), GREEDY],
        )
        other_seed = llm.generate(
            prompts[:1], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
        )
    assert batch[0].token_ids == a
    assert other_seed[0].token_ids != a
    assert len(set(a)) > 3  # actually sampled, not stuck on one token


def test_per_request_parameters_in_one_batch(llama):
    prompt = prompts_of_lengths([10], seed=5)[0]
    greedy = alone(llama, [prompt])[0]
    with LLM(llama, device="cpu", dtype="float32") as llm:
        outs = llm.generate(
            [prompt, prompt, prompt],
            [
                GREEDY,
                SamplingParams(max_tokens=16, temperature=5.0, top_k=1, ignore_eos=True),
                SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True),
            ],
        )
    assert outs[0].token_ids == greedy
    assert outs[1].token_ids == greedy  # top_k=1 is greedy whatever the temperature
    assert len(outs[2].token_ids) == 4


def test_stop_token_ids_and_eos(llama):
    prompt = prompts_of_lengths([10], seed=6)[0]
    greedy = alone(llama, [prompt])[0]
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    with LLM(llama, device="cpu", dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_at]))[
            0
        ]
        assert out.token_ids == greedy[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_at
        # The same token as EOS ends generation too, unless ignore_eos.
        llm.engine.output_processor.eos_token_ids = {stop_at}
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
        assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == greedy and out.finish_reason == "length"
        # ignore_eos ignores EOS only: a stop token still ends it
        out = llm.generate(
            [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
        )[0]
        assert out.token_ids == greedy[: first + 1] and out.stop_reason == stop_at


def test_prompt_longer_than_context_fails_alone(llama):
    with LLM(llama, device="cpu", dtype="float32", max_model_len=64) as llm:
        engine = llm.engine
        ok = engine.add_request(prompts_of_lengths([10])[0], GREEDY)
        with pytest.raises(RequestError, match="prompt has 64 tokens.*context is 64"):
            engine.add_request(list(range(64)), GREEDY)
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert len(finished[ok].token_ids) == 16
        # generate() checks every prompt first: nothing is queued when one is bad.
        with pytest.raises(RequestError):
            llm.generate([[1, 2, 3], list(range(100))], GREEDY)
        assert not engine.has_unfinished()


def test_generation_stops_at_context_end(llama):
    with LLM(llama, device="cpu", dtype="float32", max_model_len=32) as llm:
        out = llm.generate(
            [list(range(1, 25))], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        )[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_bad_requests(llama):
    with LLM(llama, device="cpu", dtype="float32") as llm:
        with pytest.raises(RequestError, match="empty"):
            llm.generate([[]], GREEDY)
        with pytest.raises(RequestError, match="out of the vocabulary"):
            llm.generate([[1, 2, 100000]], GREEDY)
        with pytest.raises(RequestError, match="no tokenizer"):
            llm.generate(["text for a model without a tokenizer"], GREEDY)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=-1), dict(top_k=-5)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


def test_stream_yields_each_token(llama):
    prompts = prompts_of_lengths([8, 20], seed=7)
    with LLM(llama, device="cpu", dtype="float32") as llm:
        final = llm.generate(prompts, GREEDY)
        seen = {}
        for out in llm.generate_stream(prompts, GREEDY):
            assert len(out.new_token_ids) == 1
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.token_ids == seen[out.request_id]
        assert sorted(seen.values()) == sorted(o.token_ids for o in final)
        # A stream abandoned half way frees its requests.
        stream = llm.generate_stream(prompts, GREEDY)
        next(stream)
        stream.close()
        assert not llm.engine.has_unfinished()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_token_slice_equals_slicing_all_tokens():
    from ringserve.engine.sequence import Sequence

    seq = Sequence("s", [1, 2, 3, 4], SamplingParams())
    seq.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == seq.token_ids[start:end]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_output_holds_the_tokens_so_far_without_copying_the_list(llama, async_scheduling):
    """An output's token_ids is a view of the tokens generated up to it (no per-step copy of
    the whole list, whose cost grew with the output), still right after later steps; the
    finished output holds a plain list."""
    from ringserve.outputs import TokensSoFar

    prompt = prompts_of_lengths([9], seed=5)[0]
    with LLM(llama, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        outputs, streamed = [], []
        while engine.has_unfinished():
            for out in engine.step():
                streamed += out.new_token_ids
                outputs.append((out, list(streamed)))
    assert len(outputs) == 12 and outputs[-1][0].request_id == rid
    for out, so_far in outputs[:-1]:
        assert isinstance(out.token_ids, TokensSoFar)
        assert out.token_ids._ids is outputs[-2][0].token_ids._ids  # the sequence's own list
        assert out.token_ids == so_far and list(out.token_ids) == so_far and len(out.token_ids) == len(so_far)
        assert out.token_ids[-1] == so_far[-1] and out.token_ids[1:3] == so_far[1:3]
    final = outputs[-1][0]
    assert type(final.token_ids) is list and final.token_ids == streamed


def _run_aborting(llm, prompts, params, abort_when):
    """Step the engine over these requests; abort_when(engine, ids) -> a request id to abort
    (once), or None. Returns (tokens streamed per request, the id aborted, tokens streamed
    to it after the abort)."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    streamed = {i: [] for i in ids}
    aborted, after = None, []
    while engine.has_unfinished():
        if aborted is None and (aborted := abort_when(engine, ids)) is not None:
            engine.abort(aborted)
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.request_id == aborted:
                after += out.new_token_ids
    return streamed, aborted, after


@pytest.mark.parametrize("which", ["waiting", "preempted"])
def test_aborting_a_waiting_or_preempted_request(llama, which):
    """A request aborted while it waits (never admitted) or after preemption (back in the
    queue, its blocks freed): nothing streams for it after, every block comes back, and the
    others generate what they generate alone."""
    if which == "waiting":
        prompts = prompts_of_lengths([9, 14, 6], seed=12)
        kw = dict(max_num_seqs=1)

        def abort_when(engine, ids):
            waiting = [s.request_id for s in engine.scheduler.waiting]
            return ids[1] if engine.scheduler.running and ids[1] in waiting else None

    else:
        shared = prompts_of_lengths([32], seed=5)[0]
        prompts = [shared + t for t in prompts_of_lengths([3, 7, 5, 9], seed=6)]
        kw = dict(block_size=8, num_blocks=22, max_num_seqs=4, max_model_len=120)

        def abort_when(engine, ids):
            preempted = [s for s in engine.scheduler.waiting if s.output_token_ids]
            return preempted[0].request_id if preempted else None

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(llama, device="cpu", dtype="float32", **kw) as llm:
        streamed, aborted, after = _run_aborting(llm, prompts, params, abort_when)
        assert aborted is not None, "the request to abort never was " + which
        assert after == [] and not llm.engine.seqs
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
        if which == "preempted":
            assert llm.engine.num_preemptions > 0 and 0 < len(streamed[aborted]) < 24
    others = [(p, streamed[rid]) for p, rid in zip(prompts, streamed) if rid != aborted]
    expected = alone(llama, [p for p, _ in others], params)
    assert [tokens for _, tokens in others] == expected
