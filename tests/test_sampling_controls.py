"""The sampling controls applications send (vLLM's meanings): repetition, presence and
frequency penalties, logit_bias, min_tokens, min_p, include_stop_str_in_output. References:
transformers' generate and logits processors on the same weights, and OpenAI's documented
penalty formula over transformers' logits; with async scheduling as without, and with
penalised and plain rows in one batch."""

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.sampler import SamplingTensors, filtered_logits
from ringserve.engine.sequence import Sequence
from ringserve.model.tiny_models import hf_greedy, hf_model

from helpers import prompts_of_lengths

MAX_TOKENS = 14


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(llama):
    return hf_model(llama)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_repetition_penalty_equals_transformers_in_a_mixed_batch(llama, reference, async_scheduling):
    prompts = prompts_of_lengths([5, 17, 33, 9])
    # a prompt that holds the tokens greedy would pick: the prompt's tokens are penalised too
    prompts.append(prompts[2] + hf_greedy(reference, prompts[2], MAX_TOKENS))
    penalties = [1.8, 1.0, 0.6, 1.3, 1.8]
    with LLM(llama, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, [greedy(repetition_penalty=r) for r in penalties])
        plain = llm.generate(prompts[:1], greedy())[0].token_ids
    for prompt, r, out in zip(prompts, penalties, outs):
        assert out.token_ids == hf_greedy(reference, prompt, MAX_TOKENS, repetition_penalty=r), r
    assert outs[0].token_ids != plain  # the penalty changed the greedy choice: the test can tell


def openai_penalised_greedy(model, prompt, steps, presence, frequency):
    """OpenAI's formula over transformers' logits: mu[j] - c[j] * frequency - (c[j] > 0) * presence,
    c[j] the times token j was generated (the prompt does not count)."""
    ids, generated = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.shape[0])
        logits = logits - counts * frequency - (counts > 0).float() * presence
        token = int(logits.argmax())
        ids.append(token)
        generated.append(token)
    return generated


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_presence_and_frequency_penalties_follow_openais_formula(llama, reference, async_scheduling):
    prompts = prompts_of_lengths([7, 21, 12], seed=1)
    settings = [(0.0, 1.5), (2.0, 0.0), (0.0, 0.0)]  # (presence, frequency)
    with LLM(llama, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        params = [greedy(presence_penalty=p, frequency_penalty=f) for p, f in settings]
        outs = llm.generate(prompts, params)
    plain = hf_greedy(reference, prompts[0], MAX_TOKENS)
    for prompt, (p, f), out in zip(prompts, settings, outs):
        assert out.token_ids == openai_penalised_greedy(reference, prompt, MAX_TOKENS, p, f), (p, f)
    assert outs[0].token_ids != plain


def test_frequency_penalty_scales_with_the_count_presence_does_not():
    """OpenAI's formula on the adjuster itself: logit - count * frequency - (count > 0) *
    presence, count the times the token was generated (the prompt's tokens do not count),
    counted both from the host's history and from the tokens recorded after sampling."""
    from ringserve.engine.logits_adjust import LogitsAdjuster

    adjuster = LogitsAdjuster(8, torch.device("cpu"), eos_token_ids=[7])
    seq = Sequence("r", [1, 1, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    seq.output_token_ids = [3, 3, 3, 4]
    plain = Sequence("p", [3, 4], SamplingParams())
    logits = torch.zeros(2, 8)
    got = adjuster.adjust(logits, [seq, plain], {})
    expected = torch.zeros(8)
    expected[3] = -3 * 0.5 - 0.25
    expected[4] = -1 * 0.5 - 0.25
    torch.testing.assert_close(got[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(got[1], torch.zeros(8), rtol=0, atol=0)  # its neighbour untouched
    adjuster.record([seq, plain], torch.tensor([3, 5]))  # sampled: 3 once more
    expected[3] = -4 * 0.5 - 0.25
    torch.testing.assert_close(adjuster.adjust(logits, [seq, plain], {})[0], expected, rtol=0, atol=0)


def test_logit_bias_equals_transformers_sequence_bias(llama, reference):
    prompts = prompts_of_lengths([6, 19], seed=2)
    plain = hf_greedy(reference, prompts[0], MAX_TOKENS)
    bias = {plain[3]: -3.0, 77: 4.0, 5: 2.5}  # moves the 4th token and lifts others
    with LLM(llama, device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, [greedy(logit_bias=bias), greedy()])
    expected = hf_greedy(reference, prompts[0], MAX_TOKENS, sequence_bias={(t,): b for t, b in bias.items()})
    assert outs[0].token_ids == expected != plain
    assert outs[1].token_ids == hf_greedy(reference, prompts[1], MAX_TOKENS)  # its neighbour untouched


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_holds_back_eos_as_transformers_min_new_tokens(llama, reference, async_scheduling):
    prompt = prompts_of_lengths([11], seed=3)[0]
    with LLM(llama, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        eos = min(llm.engine.eos_token_ids)
        push_eos = {eos: 100.0}  # EOS would win every step
        params = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logit_bias=push_eos, min_tokens=m)
            for m in (0, 5)
        ]
        outs = llm.generate([prompt, prompt], params)
    assert outs[0].token_ids == [eos] and outs[0].finish_reason == "stop"
    expected = hf_greedy(
        reference, prompt, MAX_TOKENS, eos_token_id=eos, min_new_tokens=5, sequence_bias={(eos,): 100.0}
    )
    assert outs[1].token_ids == expected and len(expected) == 6 and expected[-1] == eos
    assert outs[1].finish_reason == "stop"


def test_min_p_drops_what_transformers_min_p_drops():
    from transformers.generation.logits_process import MinPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    settings = [(0.7, 0.1), (1.3, 0.3), (1.0, 0.0), (0.5, 0.05)]  # (temperature, min_p)
    seqs = [
        Sequence(str(i), [1], SamplingParams(temperature=t, min_p=m, seed=i))
        for i, (t, m) in enumerate(settings)
    ]
    ours = filtered_logits(logits, SamplingTensors.from_seqs(seqs, "cpu", 300))
    for row, (t, m) in enumerate(settings):
        scaled = logits[row : row + 1] / t
        expected = MinPLogitsWarper(m)(None, scaled) if m > 0 else scaled
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(expected[0])), (t, m)
        assert torch.allclose(ours[row][~torch.isinf(ours[row])], expected[0][~torch.isinf(expected[0])])
    assert torch.isinf(ours[1]).sum() > 0  # some token dropped: the test can tell


def test_stop_strings_include_stop_str_in_output_and_wait_for_min_tokens(builtin_llm):
    llm = builtin_llm
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = "Count: one, two, three,"
    text = llm.generate([prompt], base)[0].text
    stop = text[6:9]  # a stop string that first appears after the 6th character
    first = text.find(stop)
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    outs = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(**kw),
            SamplingParams(**kw, include_stop_str_in_output=True),
            SamplingParams(**kw, min_tokens=23),
        ],
    )
    assert outs[0].text == text[:first] and outs[0].stop_reason == stop
    assert outs[1].text == text[: first + len(stop)]
    assert outs[2].text == text[: len(outs[2].text)] and len(outs[2].token_ids) >= 23  # not stopped early


@pytest.fixture(scope="module")
def builtin_llm():
    with LLM(None, device="cpu", dtype="float32") as llm:
        yield llm


def test_penalty_slots_are_freed_and_reused(llama):
    with LLM(llama, device="cpu", dtype="float32") as llm:
        prompts = prompts_of_lengths([5] * 10, seed=4)
        for _ in range(2):
            llm.generate(prompts, greedy(frequency_penalty=0.5))
        adjuster = llm.engine.logits_adjuster
        assert adjuster.counts.shape[0] == 16  # 10 rows at once: grown 8 -> 16 once, not again
        assert len(adjuster.free) + len(adjuster.slot_of) == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_equal_transformers_no_bad_words(smol_vocab_model, async_scheduling):
    """A one-token word is never drawn; a two-token word's second token is banned right after
    its first (transformers' NoBadWordsLogitsProcessor, with the ids vLLM finds for the words)."""
    from transformers import AutoTokenizer

    from ringserve.engine.logits_adjust import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(smol_vocab_model)
    reference = hf_model(smol_vocab_model)
    prompt = tokenizer.encode("The weather today is")
    plain = hf_greedy(reference, prompt, MAX_TOKENS)
    # words made of the greedy output's own tokens, so that banning them changes it: the
    # first token alone, and the first pair (at k, k + 1) that a word's text gives back
    one = tokenizer.decode(plain[:1]).strip()
    one_ids = bad_words_token_ids(tokenizer, [one])
    assert one_ids[0] == plain[:1], one_ids
    k, two = next(
        (k, text)
        for k in range(len(plain) - 1)
        if plain[k : k + 2]
        in bad_words_token_ids(tokenizer, [text := tokenizer.decode(plain[k : k + 2]).strip()])
    )
    two_ids = bad_words_token_ids(tokenizer, [two])
    expected_one = hf_greedy(reference, prompt, MAX_TOKENS, bad_words_ids=one_ids)
    expected_two = hf_greedy(reference, prompt, MAX_TOKENS, bad_words_ids=two_ids)
    # the pair is cut right after its first token: its ban waits for that token
    assert expected_two[: k + 1] == plain[: k + 1] and expected_two[k + 1] != plain[k + 1]
    with LLM(smol_vocab_model, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        params = [greedy(bad_words=[one]), greedy(bad_words=[two]), greedy()]
        outs = llm.generate([prompt] * 3, params)
    assert [o.token_ids for o in outs] == [expected_one, expected_two, plain]
    assert expected_one != plain


def test_bad_words_ban_a_last_token_after_the_rest_of_its_word():
    from ringserve.engine.logits_adjust import banned_by_bad_words
    from ringserve.engine.sequence import PENDING_TOKEN

    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_by_bad_words(words, [9, 7], None) == [5, 8]
    assert banned_by_bad_words(words, [7, 9], None) == [5]
    assert banned_by_bad_words(words, [1, 2], None) == [5, 3]
    # the last token still on the device: the host sees it through `pending`
    assert banned_by_bad_words(words, [7, PENDING_TOKEN], 9) == [5]
    assert banned_by_bad_words(words, [1, PENDING_TOKEN], 7) == [5, 8]
    assert banned_by_bad_words(words, [PENDING_TOKEN], 7) == [5, 8]


def test_bad_words_token_ids_as_vllm_finds_them(builtin_dir):
    from transformers import AutoTokenizer

    from ringserve.engine.logits_adjust import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(builtin_dir)
    for word in ["hello", " world", "Paris"]:
        alone = tokenizer.encode(word.strip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.strip(), add_special_tokens=False)
        found = bad_words_token_ids(tokenizer, [word])
        # both forms when they differ and are as long: "hello" starts a text, " hello" is mid-text
        assert found == ([alone, spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [alone])
        assert len(found) == 2 or len(spaced) != len(alone), (word, alone, spaced)
