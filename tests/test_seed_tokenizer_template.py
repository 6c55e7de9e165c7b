"""vLLM's --seed, --tokenizer and --chat-template: unseeded requests sample the same under
the same seed; a tokenizer from another folder; a chat template from a file or a string."""

import os
import shutil

from ringserve import LLM, SamplingParams

SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)


def test_the_engine_seed_makes_unseeded_requests_reproducible(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    runs = []
    for seed in (7, 7, 8):
        with LLM(folder, device="cpu", dtype="float32", seed=seed) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, SAMPLED)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0][0] != runs[0][1][: len(runs[0][0])]  # each request its own draw


def test_a_tokenizer_and_a_chat_template_from_elsewhere(smol_vocab_model, tmp_path):
    bare = str(tmp_path / "no_tokenizer")
    shutil.copytree(smol_vocab_model, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(bare, name))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(smol_vocab_model, device="cpu", dtype="float32") as llm:
        expected = llm.generate(["The sky is"], greedy)[0]
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    with LLM(
        bare, device="cpu", dtype="float32", tokenizer=smol_vocab_model, chat_template=str(template)
    ) as llm:
        out = llm.generate(["The sky is"], greedy)[0]
        assert (out.prompt_token_ids, out.token_ids, out.text) == (
            expected.prompt_token_ids,
            expected.token_ids,
            expected.text,
        )
        chat = llm.chat([{"role": "user", "content": "hi"}], greedy)[0]
        assert chat.prompt == "<user>hi<assistant>"
    with LLM(
        bare,
        device="cpu",
        dtype="float32",
        tokenizer=smol_vocab_model,
        chat_template="[{{ messages[0]['content'] }}]",
    ) as llm:
        assert llm.chat([{"role": "user", "content": "hi"}], greedy)[0].prompt == "[hi]"


def test_llm_chat_shows_the_tools_to_the_template(smol_vocab_model):
    template = (
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with LLM(smol_vocab_model, device="cpu", dtype="float32", chat_template=template) as llm:
        assert (
            llm.chat([{"role": "user", "content": "hi"}], greedy, tools=tools)[0].prompt == "[get_weather]hi"
        )
        assert llm.chat([{"role": "user", "content": "hi"}], greedy)[0].prompt == "hi"
