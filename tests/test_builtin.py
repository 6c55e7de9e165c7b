"""The built-in SmolLM2-135M-Instruct (a Q4_1 GGUF shipped on PyPI) and the CLI."""

import os

import pytest

from ringserve import LLM, SamplingParams
from ringserve.cli.main import main
from ringserve.model.tiny_models import hf_greedy, hf_model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", dtype="float32") as llm:
        yield llm


def test_builtin_greedy_equals_transformers_on_the_dequantised_weights(llm, builtin_dir):
    from transformers import AutoTokenizer

    assert os.path.realpath(llm.engine.model_path) == os.path.realpath(builtin_dir)
    tokenizer = AutoTokenizer.from_pretrained(builtin_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ours = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert ours.token_ids == hf_greedy(hf_model(builtin_dir), prompt, 24)


def test_builtin_answers_paris_through_the_chat_template(llm):
    out = llm.generate([QUESTION], SamplingParams(max_tokens=32, temperature=0), chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended by <|im_end|>, which the text leaves out
    assert "<|im_end|>" not in out.text


def test_gguf_conversion_is_cached(builtin_dir):
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    stamp = os.path.getmtime(os.path.join(builtin_dir, "model.safetensors"))
    assert converted_folder(builtin_model_path()) == builtin_dir
    assert os.path.getmtime(os.path.join(builtin_dir, "model.safetensors")) == stamp
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert os.path.isfile(os.path.join(builtin_dir, name))


def test_gguf_conversion_shows_its_progress(tmp_path, monkeypatch, capsys):
    import re

    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))  # a fresh cache: the first run converts
    gguf = builtin_model_path()
    folder = converted_folder(gguf, show_progress=True)
    assert folder.startswith(str(tmp_path)) and os.path.isfile(os.path.join(folder, "model.safetensors"))
    err = capsys.readouterr().err
    assert f"Converting {gguf} to a Hugging Face checkpoint in {folder} (first use only)" in err
    # tqdm redraws with \r: the last frame counts every tensor plus the config and tokenizer.
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.match(r"Converting GGUF: 100%.* (\d+)/\1 .*done\]$", last), last
    assert converted_folder(gguf, show_progress=True) == folder  # cached: nothing to show
    assert capsys.readouterr().err == ""


def test_stop_strings_cut_the_text(llm):
    full = llm.generate([QUESTION], SamplingParams(max_tokens=32, temperature=0), chat=True)[0].text
    cut = full.index("France")
    out = llm.generate(
        [QUESTION], SamplingParams(max_tokens=32, temperature=0, stop=["France", "zzz"]), chat=True
    )[0]
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == "France"


def test_streamed_text_adds_up_to_the_final_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, stop=["\n\n"])
    pieces, final = [], None
    for out in llm.generate_stream(["Write a short poem about the sea."], params, chat=True):
        pieces.append(out.new_text)
        final = out
    assert "".join(pieces) == final.text
    again = llm.generate(["Write a short poem about the sea."], params, chat=True)[0]
    assert again.text == final.text  # the seed reproduces it


def test_raw_completion_without_chat_template(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    ids = llm.tokenizer.encode("The capital of France is")
    assert out.prompt_token_ids == ids


def test_cli_generate_answers_paris(capsys):
    assert main(["generate", QUESTION, "--device", "cpu", "--max-tokens", "32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "Paris" in lines[0]
    assert lines[-1].startswith("prompt tokens:") and "time to first token" in lines[-1]


def test_cli_reports_bad_model(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 2
    assert "model not found" in capsys.readouterr().err


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for option in (
        "--model",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--presence-penalty",
        "--frequency-penalty",
        "--seed",
        "--device",
        "--dtype",
        "--no-chat",
    ):
        assert option in text


def test_greedy_batch_of_chat_prompts_matches_alone(llm):
    questions = [QUESTION, "What is 2 + 2?", "Name a large animal."]
    params = SamplingParams(max_tokens=16, temperature=0)
    alone = [llm.generate([q], params, chat=True)[0].token_ids for q in questions]
    assert [o.token_ids for o in llm.generate(questions, params, chat=True)] == alone


def test_cli_sampling_flags_reach_the_sampling_params():
    import argparse

    from ringserve.cli.common import add_sampling_args, sampling_params

    parser = argparse.ArgumentParser()
    add_sampling_args(parser, max_tokens=7)
    flags = "--min-p 0.2 --repetition-penalty 1.3 --presence-penalty 0.5 --frequency-penalty -0.5 --top-k 4"
    params = sampling_params(parser.parse_args(flags.split()))
    got = (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    assert got == (0.2, 1.3, 0.5, -0.5) and params.top_k == 4 and params.max_tokens == 7
    with pytest.raises(ValueError, match="min_p"):
        sampling_params(parser.parse_args(["--min-p", "2"]))
