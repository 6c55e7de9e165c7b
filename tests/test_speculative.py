"""Speculative decoding with prompt lookup (--speculative-config, engine/speculative.py): the
output is the engine's own without it, token for token, greedy and seeded sampling alike, with
stops, length limits, logprobs, tensor parallelism and the prefix cache; drafts are checked
and kept (the counts say so), and the blocks of rejected drafts are reused."""

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.config.speculative import SpeculativeConfig
from ringserve.engine.speculative import kept_run

from helpers import prompts_of_lengths

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def copying_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, as text that gets copied does: the tiny model's
    greedy continuations repeat too, so prompt lookup finds drafts, kept and not."""
    prompts = []
    for i, phrase in enumerate(prompts_of_lengths([3 + i % 7 for i in range(count)], seed=seed)):
        prompts.append((phrase * (2 + i % 4))[: 5 + (i * 7) % 40])
    return prompts


def _run(folder, prompts, params, **options):
    with LLM(folder, device="cpu", dtype="float32", block_size=4, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.engine.spec_stats


def test_greedy_output_equals_the_engine_without_speculation(tiny_model_dir):
    """100 prompts: the same tokens, drafts kept and rejected along the way."""
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(100)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    spec, stats = _run(folder, prompts, params, speculative_config=NGRAM)
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert stats.num_drafts > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[1] > 0, stats


def test_seeded_sampling_equals_the_engine_without_speculation(tiny_model_dir):
    """Each row of a verified run draws the random numbers of its output position, so seeded
    requests (several per prompt, as n > 1 makes them) sample the same tokens: the output
    distribution is the target's, draw for draw."""
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(8, seed=3)
    params = [
        SamplingParams(max_tokens=20, temperature=t, top_p=p, seed=seed, ignore_eos=True)
        for seed, (t, p) in enumerate([(0.3, 1.0), (0.7, 0.9), (1.0, 1.0)])
    ]
    batch = [p for p in prompts for _ in params]
    plain, _ = _run(folder, batch, params * len(prompts))
    spec, stats = _run(folder, batch, params * len(prompts), speculative_config=NGRAM)
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert stats.num_accepted_tokens > 0


def test_stops_and_length_limits_inside_a_kept_run(builtin_dir):
    """The built-in model copying a passage (long runs of kept drafts): a stop token, a stop
    string or max_tokens that falls inside a run ends the request where it would without
    speculation, text, tokens and reason alike."""
    from ringserve.engine.kv_calibration_text import CALIBRATION_TEXT

    passages = [CALIBRATION_TEXT[i : i + 200] for i in (0, 700)]
    prompts = [[{"role": "user", "content": "Repeat this text exactly:\n\n" + p}] for p in passages]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with LLM(builtin_dir, device="cpu", dtype="float32") as llm:
        plain = llm.chat(prompts, greedy, use_tqdm=False)
        cases = []
        for prompt, out in zip(prompts, plain):
            tokens = list(out.token_ids)
            for cut in (9, 17, 26):
                if tokens[cut] not in tokens[:cut]:
                    cases.append(
                        (prompt, SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[tokens[cut]]))
                    )
                cases.append((prompt, SamplingParams(max_tokens=cut, temperature=0, ignore_eos=True)))
            for word in out.text.split()[4:10:3]:
                cases.append(
                    (prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[word]))
                )
        prompts, params = zip(*cases)
        want = llm.chat(list(prompts), list(params), use_tqdm=False)
    with LLM(builtin_dir, device="cpu", dtype="float32", speculative_config=NGRAM) as llm:
        got = llm.chat(list(prompts), list(params), use_tqdm=False)
        stats = llm.engine.spec_stats
    for a, b in zip(got, want):
        assert (a.text, list(a.token_ids), a.finish_reason, a.stop_reason) == (
            b.text,
            list(b.token_ids),
            b.finish_reason,
            b.stop_reason,
        )
    assert stats.mean_acceptance_length > 2, stats  # copying: long runs kept


def test_logprobs_of_kept_tokens(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompt = copying_prompts(3, seed=1)[2]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    streams = []
    for options in ({}, {"speculative_config": NGRAM}):
        with LLM(folder, device="cpu", dtype="float32", block_size=4, **options) as llm:
            steps = list(llm.generate_stream([prompt], params))
            streams.append(
                ([lp for out in steps for lp in out.new_logprobs or []], list(steps[-1].token_ids))
            )
            if options:
                assert llm.engine.spec_stats.num_accepted_tokens > 0
                assert len(steps) < len(streams[0][0])  # several tokens in an output
    (plain, plain_tokens), (spec, spec_tokens) = streams
    assert spec_tokens == plain_tokens and len(spec) == len(plain) == 20
    for a, b in zip(spec, plain):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_tensor_parallel_verifies_alike(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(10, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    spec, stats = _run(folder, prompts, params, speculative_config=NGRAM, tp=2, timeout_s=60)
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert stats.num_accepted_tokens > 0


def test_rejected_drafts_leave_the_prefix_cache_and_blocks_clean(tiny_model_dir):
    """Rejected drafts' KV stays in blocks the sequence holds but never counts as computed:
    the prefix cache offers only kept tokens' blocks (a later request that hits them continues
    as a fresh engine does), and a sequence holds no more blocks than its tokens and one
    step's drafts need (the rejected ones' slots are written again by the next tokens)."""
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(6, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, speculative_config=NGRAM) as llm:
        engine = llm.engine
        held = []
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
            held += [
                (len(seq.block_table), seq.num_tokens) for seq in engine.scheduler.running if seq.block_tables
            ]
        assert engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens  # some rejected
        assert all(blocks <= -(-(tokens + 4) // 4) for blocks, tokens in held)
        first = llm.generate(prompts, params, use_tqdm=False)
        follow = [list(p) + list(o.token_ids)[:17] for p, o in zip(prompts, first)]
        hits = llm.generate(
            follow, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
        )
        assert all(o.num_cached_tokens >= 16 for o in hits)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=False) as llm:
        fresh = llm.generate(
            follow, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
        )
    assert [list(o.token_ids) for o in hits] == [list(o.token_ids) for o in fresh]


def test_kept_run_is_the_sampled_tokens_up_to_the_first_miss():
    assert kept_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert kept_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert kept_run([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert kept_run([], [3]) == [3]


def test_speculative_config_parses_as_vllm_does():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_max == 5
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    with pytest.raises(ValueError, match="not supported yet"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3})


@pytest.mark.parametrize("cp_algo", ["pass_q", "pass_kv"])
def test_context_parallel_rings_verify_alike(tiny_model_dir, cp_algo):
    """cp=2: a run's new tokens are placed on the ranks as a chunk's are, and the KV of the
    drafts a run did not keep is uncounted from its rank before the next step."""
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(12, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    spec, stats = _run(folder, prompts, params, speculative_config=NGRAM, cp=2, cp_algo=cp_algo, timeout_s=60)
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize(
    "arch,layout",
    [("llama", dict(dp=2)), ("mixtral", dict(ep=2))],  # ep=2: dp=2 replicas, experts over both
)
def test_data_parallel_replicas_verify_alike(tiny_model_dir, arch, layout):
    """Each replica verifies its own sequences' drafts; the replicas' draft rows come back to
    rank 0 in the step's order. With EP over the replicas, a replica's verify rows go
    through the experts with the other replica's tokens."""
    folder = tiny_model_dir(arch)
    prompts = copying_prompts(12, seed=8)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    spec, stats = _run(folder, prompts, params, speculative_config=NGRAM, timeout_s=60, **layout)
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_sampling_positions_key_the_draws():
    """A verified run's row at position i draws what the plain engine draws i tokens later."""
    from ringserve.engine.sampler import SamplingTensors
    from ringserve.engine.sequence import Sequence

    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=7))
    later = Sequence("b", [1, 2, 3], SamplingParams(temperature=1.0, seed=7))
    later.output_token_ids = [9, 9]
    spec = SamplingTensors.from_seqs([seq, seq, seq], "cpu", 256, positions=[0, 1, 2])
    plain = SamplingTensors.from_seqs([later], "cpu", 256)
    assert torch.equal(spec.key[2:], plain.key) and not torch.equal(spec.key[:1], plain.key)


def test_server_streams_kept_runs_and_counts_them(builtin_dir):
    """Served: a streamed chat completion carries the kept runs (several tokens a chunk) and
    its text is the engine's without speculation; /metrics has vLLM's spec_decode counters."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from ringserve.benchmarks.serve import ServerInfo, spec_decode_counts, spec_decode_summary
    from ringserve.engine.engine import LLMEngine
    from ringserve.engine.kv_calibration_text import CALIBRATION_TEXT
    from ringserve.options import EngineOptions
    from ringserve.server import build_app

    from helpers import serve_in_thread

    messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + CALIBRATION_TEXT[:200]}]
    with LLM(builtin_dir, device="cpu", dtype="float32") as llm:
        want = llm.chat([messages], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].text
    options = EngineOptions(model=builtin_dir, device="cpu", dtype="float32", speculative_config=NGRAM)
    engine = LLMEngine.from_options(options)
    try:
        with serve_in_thread(build_app(engine, "m")) as url:
            server = ServerInfo(url, {}, "m", None, {})
            before = spec_decode_counts(server) or {}
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            stream = client.chat.completions.create(
                model="m", messages=messages, max_tokens=24, temperature=0, stream=True
            )
            chunks = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
            import httpx2 as httpx

            text = httpx.get(url + "/metrics").text
            bench = spec_decode_summary(before, spec_decode_counts(server))  # as `ringserve bench serve`
        counters = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("vllm:spec_decode") and s.labels.get("position", "0") == "0"
        }
        stats = engine.spec_stats
    finally:
        engine.close()
    assert "".join(chunks) == want
    assert len(chunks) < 24  # runs of kept drafts arrive together
    assert counters["vllm:spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert counters["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens > 0
    assert counters["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == stats.accepted_per_position[0]
    assert bench["spec_decode_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)
    assert bench["spec_decode_acceptance_rate"] == pytest.approx(
        stats.num_accepted_tokens / stats.num_draft_tokens
    )


def test_drafts_adapt_to_what_a_sequence_keeps():
    """One more draft than a sequence's running average kept, up to k: text that stopped
    copying gets a single draft a step, text that copies again gets k back."""
    from ringserve.engine.sequence import Sequence
    from ringserve.engine.speculative import NgramDrafter

    drafter = NgramDrafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4}))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6] * 4, SamplingParams(max_tokens=100, temperature=0))
    seq.num_computed_tokens = seq.num_tokens - 1  # decoding: its last token next
    lengths = []
    for kept in (0, 0, 0, 0, 4, 4, 4):
        lengths.append(drafter.num_drafts(seq, 1000))
        drafter.record(seq, kept)
    assert lengths == [4, 3, 2, 1, 1, 3, 4]


def test_no_drafts_at_disable_by_batch_size(tiny_model_dir):
    folder = tiny_model_dir("llama")
    config = (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 3}'
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    _, crowded = _run(folder, copying_prompts(4), params, speculative_config=config)
    _, alone = _run(folder, copying_prompts(2), params, speculative_config=config)
    assert crowded.num_drafts == 0 and alone.num_drafts > 0


def test_structured_output_masks_each_position_of_a_run(builtin_dir):
    """A JSON schema with drafts: each row of a run is masked by the grammar after the drafts
    before it, drafts the grammar refuses are cut, and the output (greedy, and seeded
    sampling) is the engine's without speculation, valid against the schema."""
    import json

    import jsonschema

    from ringserve.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
        "required": ["items"],
        "additionalProperties": False,
    }
    record = json.dumps({"items": ["red apple", "green pear", "yellow lemon", "red cherry"]})
    messages = [[{"role": "user", "content": f"Repeat this JSON exactly, nothing else:\n{record}"}]] * 3
    params = [
        SamplingParams(
            max_tokens=60, temperature=t, seed=s, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for t, s in ((0.0, 0), (0.8, 1), (1.0, 2))
    ]
    outputs = []
    for options in ({}, {"speculative_config": NGRAM}):
        with LLM(builtin_dir, device="cpu", dtype="float32", **options) as llm:
            outputs.append(llm.chat(messages, params, use_tqdm=False))
            stats = llm.engine.spec_stats
    plain, spec = outputs
    assert [o.text for o in spec] == [o.text for o in plain]
    for out in spec:
        jsonschema.validate(json.loads(out.text), schema)
    assert stats.num_accepted_tokens > 10, stats


def test_verify_steps_replay_the_decode_graphs(tiny_model_dir):
    """A verify step runs through the decode graphs' path (each new token a decode row of
    its own: its sequence's block table, its position, the keys up to it), here eagerly on
    the CPU: the same tokens as without speculation, and verify steps did take that path."""
    from ringserve.worker.graphs import DecodeGraphs

    folder = tiny_model_dir("llama")
    prompts = copying_prompts(6, seed=11)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, speculative_config=NGRAM) as llm:
        runner = llm.engine.executor.worker.runner
        runner.graphs = graphs = DecodeGraphs(runner, max_batch=32, capture=False)
        verified = []
        run = graphs.run

        def spy(step, pending_tokens=None):
            verified.append(step.is_verify)
            return run(step, pending_tokens)

        graphs.run = spy
        spec = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
    assert sum(verified) >= 3 and not all(verified)


def test_preemption_under_speculation(tiny_model_dir):
    """Too few blocks for every sequence and its drafts: sequences are preempted and
    recomputed, drafts and all, and the output is still the engine's without speculation."""
    folder = tiny_model_dir("llama")
    prompts = copying_prompts(8, seed=13)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain, _ = _run(folder, prompts, params)
    options = dict(block_size=4, num_blocks=30, max_model_len=96, speculative_config=NGRAM)
    with LLM(folder, device="cpu", dtype="float32", **options) as llm:
        spec = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.num_preemptions > 0 and llm.engine.spec_stats.num_accepted_tokens > 0
    assert [list(o.token_ids) for o in spec] == [list(o.token_ids) for o in plain]
