"""What a new user can pass to LLM that cannot work: each is refused up front with a message
that names it, and the same LLM goes on generating; a request that still fails inside a
step fails alone (finish_reason "error"), and the others of that step go on."""

import numpy as np
import pytest

from ringserve import LLM, SamplingParams
from ringserve.errors import RequestError

PROMPT = "What is the capital of France?"
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", dtype="float32", max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm):
    return llm.generate([PROMPT], GREEDY)[0].token_ids


BAD_PROMPTS = [
    ([[1.0, 2.0]], r"token ids must be integers; position 0 holds 1.0 \(float\)"),
    ([1.0, 2.0], r"token ids must be integers; position 0 holds 1.0 \(float\)"),
    ([[True, 2]], r"position 0 holds True \(bool\)"),
    ([[1, 10**9]], r"token ids out of the vocabulary \(0..49151\) or not integers: \[1000000000\]"),
    ([[1, -1]], r"out of the vocabulary .*\[-1\]"),
    ([""], r"the prompt is empty"),
    ([[]], r"the prompt is empty"),
    ([None], r"a prompt must be a string or a list of token ids, got NoneType"),
    ({"prompt": "hi"}, r"prompts must be a string, a list of token ids, or a list of either; got dict"),
    ([list(range(100))], r"the prompt has 100 tokens, but the model's context is 64"),
]

BAD_PARAMS = [
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0, got inf"),
    (dict(temperature=-1), r"temperature must be a finite number >= 0, got -1"),
    (dict(temperature="1"), r"temperature must be a finite number >= 0, got '1'"),
    (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
    (dict(top_p=0), r"top_p must be a number in \(0, 1\], got 0"),
    (dict(top_k=2.5), r"top_k must be an integer"),
    (dict(max_tokens=-3), r"max_tokens must be an integer >= 0, got -3"),
    (dict(max_tokens=2.0), r"max_tokens must be an integer >= 0, got 2.0"),
    (dict(max_tokens=True), r"max_tokens must be an integer >= 0, got True"),
    (dict(seed=1.5), r"seed must be an integer, got 1.5"),
    (dict(stop=[3]), r"stop must be a string or a list of strings, got \[3\]"),
    (dict(stop_token_ids=[1.5]), r"stop_token_ids must be a list of integers, got \[1.5\]"),
    (dict(ignore_eos="no"), r"ignore_eos must be True or False, got 'no'"),
    (dict(logprobs=-1), r"logprobs must be an integer >= 0, got -1"),
]


@pytest.mark.parametrize("prompts, error", BAD_PROMPTS)
def test_bad_prompt_is_refused_up_front(llm, expected, prompts, error):
    with pytest.raises(RequestError, match=error):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished()  # nothing was queued
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected


@pytest.mark.parametrize("fields, error", BAD_PARAMS)
def test_bad_sampling_field_is_refused_up_front(fields, error):
    with pytest.raises(RequestError, match=error):
        SamplingParams(**fields)


def test_fields_changed_after_construction_are_checked_when_added(llm, expected):
    for field, value, error in (
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("max_tokens", -1, "max_tokens must be an integer >= 0"),
        ("max_tokens", 10**12, r"max_tokens=1000000000000 can never be reached: the model's context is 64"),
        ("logprobs", 10**9, "logprobs=1000000000 is more than the vocabulary's 49152 tokens"),
    ):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        setattr(params, field, value)
        with pytest.raises(RequestError, match=error):
            llm.generate([PROMPT, PROMPT], [GREEDY, params])  # the good one is not queued either
        assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected


def test_what_still_works(llm, expected):
    # numpy token ids, a tiny temperature (greedy, as vLLM: no overflow to inf), a huge top_k
    # (all tokens), any integer seed, max_tokens past the room left in the context (it
    # stops at the context's end, as vLLM).
    ids = llm.tokenizer.encode(PROMPT)
    assert llm.generate([np.array(ids)], GREEDY)[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids
    assert (
        llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=1e-9, ignore_eos=True))[0].token_ids
        == expected
    )
    for fields in (dict(top_k=10**30), dict(seed=2**80), dict(seed=-5)):
        out = llm.generate(
            [PROMPT], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, **fields)
        )[0]
        assert len(out.token_ids) == 4
    long = list(range(1, 60))
    out = llm.generate([long], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 - len(long) and out.finish_reason == "length"


def test_a_request_failing_inside_a_step_fails_alone(llm, expected):
    # Fields changed after the request was queued slip past every check: this one breaks
    # the batch's sampling, then is found by sampling each row alone.
    bad = SamplingParams(max_tokens=4, temperature=0.5, ignore_eos=True)
    stream = llm.generate_stream([PROMPT, PROMPT], [GREEDY, bad])
    bad.temperature = "hot"
    finals = {o.request_id: o for o in stream if o.finished}
    good_out, bad_out = sorted(finals.values(), key=lambda o: int(o.request_id))
    assert good_out.token_ids == expected and good_out.finish_reason in ("stop", "length")
    assert bad_out.finish_reason == "error" and "TypeError" in bad_out.error and bad_out.token_ids == []
    # One whose detokenizer fails midway fails alone too, with the tokens it had.
    stream = llm.generate_stream([PROMPT, PROMPT], GREEDY)
    first = next(stream)
    detok = llm.engine.output_processor.detokenizers[first.request_id]
    detok.add_token = lambda seq, token: (_ for _ in ()).throw(RuntimeError("broken tokenizer"))
    finals = {o.request_id: o for o in [first, *stream] if o.finished}
    assert finals[first.request_id].finish_reason == "error"
    assert finals[first.request_id].error == "RuntimeError: broken tokenizer"
    other = next(o for rid, o in finals.items() if rid != first.request_id)
    assert other.token_ids == expected
    assert not llm.engine.has_unfinished() and not llm.engine.seqs
    assert (
        llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        or llm.engine.options.enable_prefix_caching
    )
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected


def test_each_prompt_is_checked_once_on_its_way_in(llm, monkeypatch):
    """LLM checks every prompt before queuing any; add_request does not check it again (on
    the engine thread a 1M-token prompt's check costs ~20 ms); a direct add_request does."""
    inputs = llm.engine.input_processor
    calls = []
    check_prompt = inputs.check_prompt
    monkeypatch.setattr(inputs, "check_prompt", lambda ids: calls.append(len(ids)) or check_prompt(ids))
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2))
    assert calls == [3, 2]
    request_id = llm.engine.add_request([6, 7, 8, 9], SamplingParams(max_tokens=1))
    llm.engine.abort(request_id)
    assert calls == [3, 2, 4]
