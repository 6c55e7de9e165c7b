"""Prompt logprobs (SamplingParams.prompt_logprobs) and max_tokens=0: each prompt token's
log-probability and top-N equal transformers' log_softmax on the same weights, whether the
prompt is prefilled in several chunks, already in the prefix cache, recomputed after a
preemption, or computed over tp or cp ranks."""

import pytest
import torch

from ringserve import LLM, RequestError, SamplingParams
from ringserve.model.tiny_models import hf_model

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. The five "
    "boxing wizards jump quickly, and a wizard's job is to vex chumps quickly in fog."
)


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax [len(prompt), V] of the next token at every position."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def assert_matches(prompt_logprobs, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    """Entry 0 is None; entry i holds prompt[i]'s log-probability given prompt[:i], its rank
    and the `top` likeliest (token, log-probability) there, as transformers computes them."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    entries = prompt_logprobs[1:]
    assert [e.token_id for e in entries] == prompt[1:]
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), want, atol=1e-4, rtol=1e-4)
    ranks = (ref[:-1] > want[:, None]).sum(-1) + 1
    # A rank can differ by one where two logits tie within float32 noise.
    assert all(abs(e.rank - r) <= 1 for e, r in zip(entries, ranks.tolist()))
    values, ids = ref[:-1].topk(top, dim=-1)
    got = torch.tensor([[v for _, v in e.top] for e in entries])
    torch.testing.assert_close(got, values, atol=1e-4, rtol=1e-4)
    mismatched = [i for i, e in enumerate(entries) if [t for t, _ in e.top] != ids[i].tolist()]
    # Ids may swap only where their values tie (checked above to 1e-4).
    assert all(torch.allclose(values[i, :-1], values[i, 1:], atol=1e-4) for i in mismatched)


def test_builtin_prompt_logprobs_over_chunks_and_a_cached_prefix(builtin_dir):
    """A 60-odd token prompt prefilled 16 tokens a step. A request with prompt logprobs fills
    the prefix cache for a plain one; a second request with prompt logprobs, its prefix now
    cached, still scores every prompt token (computing the whole prompt). Only the rows
    that score or sample return logits."""
    with LLM(
        None, device="cpu", dtype="float32", max_num_batched_tokens=16, max_prefill_tokens=16, block_size=16
    ) as llm:
        prompt = llm.tokenizer.encode(TEXT)
        cacheable = (len(prompt) - 1) // 16 * 16
        assert cacheable >= 3 * 16
        returned_rows = []
        execute = llm.engine.executor.execute

        def counting(step, *args, **kwargs):
            logits = execute(step, *args, **kwargs)
            returned_rows.append(logits.shape[0])
            return logits

        llm.engine.executor.execute = counting
        score = SamplingParams(max_tokens=0, prompt_logprobs=3)
        scored = llm.generate([prompt], score)[0]
        # Every position but the last scores the next prompt token; the last one's row is
        # the sampling row (no token drawn with max_tokens=0).
        assert sum(returned_rows) == len(prompt) and len(returned_rows) == -(-len(prompt) // 16)
        assert scored.token_ids == [] and scored.finish_reason == "length"
        returned_rows.clear()
        plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        assert plain.prompt_logprobs is None and plain.num_cached_tokens == cacheable
        assert returned_rows == [1]  # no cost for a request that does not ask
        again = llm.generate([prompt], score)[0]
        assert again.num_cached_tokens == 0
    assert_matches(scored.prompt_logprobs, prompt, reference(hf_model(builtin_dir), prompt), top=3)
    assert again.prompt_logprobs == scored.prompt_logprobs


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny_model_dir):
    """A long prompt is prefilled 8 tokens a step next to a growing decode, in so few blocks
    that it is preempted part way and recomputed from the start: each prompt token is still
    scored once, and its generated tokens are those it gets alone."""
    folder = tiny_model_dir("llama")
    g = torch.Generator().manual_seed(4)
    short, long = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (10, 110))
    grow = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    with LLM(folder, device="cpu", dtype="float32") as llm:
        alone = llm.generate([long], params)[0]
    # 16 blocks of 8 tokens: the decode reaches 110 tokens, the long prompt needs 14 blocks.
    options = dict(
        block_size=8, num_blocks=16, max_model_len=128, max_num_batched_tokens=9, max_prefill_tokens=9
    )
    with LLM(folder, device="cpu", dtype="float32", **options) as llm:
        _, out = llm.generate([short, long], [grow, params])
        assert llm.engine.num_preemptions > 0
    assert out.token_ids == alone.token_ids
    assert_matches(out.prompt_logprobs, long, reference(hf_model(folder), long), top=2)


def test_max_tokens_zero_next_to_a_generating_request(tiny_model_dir):
    folder = tiny_model_dir("llama")
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32") as llm:
        expected = llm.generate([[9, 8, 7, 6]], greedy)[0].token_ids
        zero, other = llm.generate([[1, 2, 3], [9, 8, 7, 6]], [SamplingParams(max_tokens=0), greedy])
        assert (zero.token_ids, zero.text, zero.finish_reason, zero.finished) == ([], "", "length", True)
        assert zero.prompt_logprobs is None
        assert other.token_ids == expected
        assert not llm.engine.has_unfinished()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    for bad in (dict(max_tokens=-1), dict(prompt_logprobs=-1), dict(prompt_logprobs=1.5)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2)])
def test_prompt_logprobs_over_ranks(layout, tiny_model_dir):
    """tp: the vocabulary is sharded (logits gathered per row); cp: the prompt's rows are
    computed on different ranks (gathered back in order). Prefilled in chunks of 12."""
    folder = tiny_model_dir("llama")
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=4)
    with LLM(
        folder,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=12,
        max_prefill_tokens=12,
        timeout_s=60,
        **layout,
    ) as llm:
        out, plain = llm.generate(
            [prompt, prompt[:20]], [params, SamplingParams(max_tokens=3, temperature=0)]
        )
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model(folder), prompt), top=4)
    assert plain.prompt_logprobs is None and len(plain.token_ids) == 3
