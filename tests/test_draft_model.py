"""Speculative decoding with a draft model (engine/draft_model.py): the output is the target's
without speculation, greedy and seeded alike, with a target of hybrid attention, under tensor
parallelism, preemption and structured output; a draft equal to the target keeps every draft
(so the draft's own KV is right: a stale or misplaced position would cost acceptance); the KV
budget holds both caches; a draft that cannot draft for the target is refused."""

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.config.speculative import SpeculativeConfig

from helpers import generate_tokens, varied_prompts


def _truncated(folder: str, out: str, layers: int) -> str:
    """The model in `folder` with only its first `layers` layers (same embeddings, norm and
    head): a draft that agrees with it often, not always."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_and_draft(tiny_model_dir, tmp_path_factory):
    target = tiny_model_dir("llama")
    return target, _truncated(target, str(tmp_path_factory.mktemp("draft")), 1)


def _draft(folder: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}


def test_greedy_output_equals_the_engine_without_speculation(llama_and_draft):
    """100 prompts, a one-layer draft of the two-layer target: drafts kept and rejected."""
    target, draft = llama_and_draft
    prompts = varied_prompts(100)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain, _, _ = generate_tokens(target, prompts, params)
    spec, stats, _ = generate_tokens(target, prompts, params, speculative_config=_draft(draft))
    assert spec == plain
    assert stats.num_drafts > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("layout", ["one rank", "preempted", "cp2", "dp2"])
def test_a_draft_equal_to_the_target_keeps_every_draft(llama_and_draft, layout):
    """The target as its own draft guesses exactly the target's greedy tokens only if the
    draft's cache holds the right KV at every position: after kept runs of every length,
    after all k kept (its k-th draft then seen in the next pass), after a preemption (its
    blocks freed and refilled), under context parallelism (the draft's cache, on rank 0,
    holds every rank's block ids) and under data parallelism (every replica's block ids and
    rows, which overlap from replica to replica)."""
    target, _ = llama_and_draft
    prompts = varied_prompts(8, seed=2)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    options = {
        "one rank": {},
        "preempted": dict(num_blocks=30, max_model_len=96),
        "cp2": dict(cp=2, timeout_s=60),
        "dp2": dict(dp=2, timeout_s=60),
    }[layout]
    plain, _, _ = generate_tokens(
        target, prompts, params, **{k: v for k, v in options.items() if k not in ("cp", "dp")}
    )
    spec, stats, preemptions = generate_tokens(
        target, prompts, params, speculative_config=_draft(target), **options
    )
    assert spec == plain
    assert stats.num_drafts > 20 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
    assert (preemptions > 0) == (layout == "preempted")


def test_the_draft_follows_prefill_chunks_and_prefix_hits(llama_and_draft):
    """Prompts prefilled in chunks of 16: the draft computes each chunk with the target, so a
    sequence's first draft needs only its last token (no pass catches up a prompt inside a
    decode step); a second round hits the prefix cache and the draft catches up the cached
    tokens, at most 16 tokens a pass (the model's step budget), a sequence drafting only
    once caught up. The target as its own draft then still keeps every draft."""
    target, _ = llama_and_draft
    prompts = varied_prompts(6, seed=4)
    prompts = [p * 3 for p in prompts]  # 9 .. 120 tokens
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    chunks = dict(max_num_batched_tokens=16, max_prefill_tokens=16)
    with LLM(target, device="cpu", dtype="float32", block_size=4, **chunks) as llm:
        plain = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = []
    with LLM(
        target, device="cpu", dtype="float32", block_size=4, speculative_config=_draft(target), **chunks
    ) as llm:
        runner = llm.engine.drafter.runner
        forward, catch_up, totals = runner.forward, [], []

        def spy(step, *args, **kwargs):
            # the longest run of a drafting sequence's pass 1; the tokens of each pass
            catch_up.append(max((len(t) for t, s in zip(step.token_ids, step.sample) if s), default=0))
            totals.append(sum(len(t) for t in step.token_ids))
            return forward(step, *args, **kwargs)

        runner.forward = spy
        spec.append([list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        first_round, first_passes = max(catch_up), len(totals)
        again = llm.generate(prompts, params, use_tqdm=False)
        spec.append([list(o.token_ids) for o in again])
        stats = llm.engine.spec_stats
    assert spec == [plain, plain]
    assert first_round <= 5, first_round  # the last token and at most k = 4 kept drafts
    assert sum(o.num_cached_tokens for o in again) > 100
    assert max(totals) <= 16 and max(totals[first_passes:]) == 16, totals  # catch-up fills a pass
    assert stats.num_drafts > 10 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


def test_seeded_sampling_equals_the_engine_without_speculation(llama_and_draft):
    target, draft = llama_and_draft
    prompts = varied_prompts(6, seed=3)
    params = [
        SamplingParams(max_tokens=20, temperature=t, top_p=p, seed=seed, ignore_eos=True)
        for seed, (t, p) in enumerate([(0.5, 1.0), (1.0, 0.9)])
    ]
    batch = [p for p in prompts for _ in params]
    plain, _, _ = generate_tokens(target, batch, params * len(prompts))
    spec, stats, _ = generate_tokens(target, batch, params * len(prompts), speculative_config=_draft(draft))
    assert spec == plain and stats.num_accepted_tokens > 0


def test_hybrid_target_and_tensor_parallelism(tiny_model_dir, tmp_path):
    """A target with windowed and full-attention layers (the draft's KV follows the full
    layers' block table) at tp=2 (the draft runs in the engine's process)."""
    target = tiny_model_dir("qwen3_hybrid")
    draft = _truncated(target, str(tmp_path / "draft"), 1)  # its windowed first layer
    prompts = varied_prompts(10, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _, _ = generate_tokens(target, prompts, params)
    spec, stats, _ = generate_tokens(
        target, prompts, params, speculative_config=_draft(draft, 3), tp=2, timeout_s=60
    )
    assert spec == plain and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_structured_output_cuts_drafts_the_grammar_refuses(smol_vocab_model, tmp_path):
    """A JSON schema: the draft's guesses are cut where the grammar refuses them (the step
    then computes fewer rows), and the output is the engine's without speculation (valid
    where it ended; the random model spends many tokens on whitespace)."""
    import json
    import shutil

    import jsonschema

    from ringserve.sampling_params import StructuredOutputsParams

    draft = _truncated(smol_vocab_model, str(tmp_path / "draft"), 1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{smol_vocab_model}/{name}", draft)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(
            max_tokens=60, temperature=t, seed=s, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for t, s in ((0.0, 0), (1.0, 1))
    ]
    prompts = ["A record:", "JSON:"]
    outputs, checked = [], []
    for options in ({}, {"speculative_config": _draft(draft)}):
        with LLM(smol_vocab_model, device="cpu", dtype="float32", **options) as llm:
            drafter = llm.engine.drafter
            if drafter is not None:
                fill = drafter.fill

                def spy(
                    batch, fill=fill
                ):  # every draft that reaches the verify step is one the grammar allows
                    fill(batch)
                    for seq in batch.seqs:
                        d = seq.draft_token_ids
                        checked.append(len(d))
                        assert seq.grammar.valid_prefix(seq.output_token_ids, d) == len(d)

                drafter.fill = spy
            outputs.append([(o.text, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)])
            stats = llm.engine.spec_stats
    assert outputs[1] == outputs[0] and sum(checked) > 0
    for text, reason in outputs[1]:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert stats.num_drafts > 0, stats


def test_the_kv_budget_holds_both_caches(llama_and_draft):
    from ringserve.config import ModelConfig
    from ringserve.worker.kv_cache import KVCache
    from ringserve.worker.kv_groups import KVGroups

    target, draft = llama_and_draft

    def per_block(folder):
        c = ModelConfig.from_pretrained(folder)
        return KVCache.bytes_per_block(
            KVGroups.for_model(c), 4, c.num_key_value_heads, c.head_dim, torch.float32
        )

    budget = 1 << 20
    with LLM(target, device="cpu", dtype="float32", block_size=4, kv_cache_memory=budget,
             speculative_config=_draft(draft)) as llm:  # fmt: skip
        assert llm.engine.block_manager.num_blocks == budget // (per_block(target) + per_block(draft))
        assert llm.engine.drafter.worker.num_blocks == llm.engine.block_manager.num_blocks


def test_draft_model_config_and_refusals(llama_and_draft, tiny_model_dir, monkeypatch):
    from ringserve.config import ModelConfig
    from ringserve.engine.draft_model import DraftModel
    from ringserve.errors import ModelLoadError
    from ringserve.worker.kv_groups import KVGroups

    target, draft = llama_and_draft
    config = SpeculativeConfig.parse({"model": draft, "num_speculative_tokens": 3})  # vLLM: model alone
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", draft, 3)
    for bad, message in [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs model"),
        ({"model": draft, "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "unknown field"),
        ({"model": draft, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "must be 1"),
        ({"method": "ngram", "model": draft, "num_speculative_tokens": 3}, "needs no model"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)

    class Tokenizer:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    mistral = tiny_model_dir("mistral")  # a window on every layer: no full-attention table
    c = ModelConfig.from_pretrained(mistral)
    with pytest.raises(ModelLoadError, match="full-attention"):
        DraftModel.check(config, c, KVGroups.for_model(c), None)
    c = ModelConfig.from_pretrained(target)
    monkeypatch.setattr(
        "ringserve.engine.draft_model.load_tokenizer", lambda folder: Tokenizer({"a": 0, "b": 1})
    )
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        DraftModel.check(config, c, KVGroups.for_model(c), Tokenizer({"a": 0, "c": 1}))
    assert DraftModel.check(config, c, KVGroups.for_model(c), Tokenizer({"a": 0, "b": 1})).vocab_size == 256
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(target, device="cpu", speculative_config={"model": "/no/such/draft", "num_speculative_tokens": 2})
