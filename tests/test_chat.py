"""LLM.chat and `ringserve chat` on the built-in model, against transformers' own chat template."""

import os
import signal
import subprocess
import sys

import pytest

from ringserve import LLM, SamplingParams
from ringserve.engine.chat_template import render
from ringserve.errors import RequestError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_ENV = {**os.environ, "PYTHONPATH": REPO}  # `ringserve chat` subprocesses run the code under test
GREEDY = SamplingParams(max_tokens=8, temperature=0)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)  # where only the prompt is checked
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MULTI_TURN = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Name a large animal."},
    {"role": "assistant", "content": "An elephant."},
    {"role": "user", "content": "And a small one?"},
]


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_tokenizer(builtin_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_dir)


def reference_ids(hf_tokenizer, messages, **kwargs) -> list[int]:
    """transformers' apply_chat_template, tokenised by transformers itself."""
    kwargs.setdefault("add_generation_prompt", True)
    return hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]


def test_chat_equals_generate_on_the_templated_prompt(llm, hf_tokenizer):
    single = llm.chat(FRANCE, GREEDY)
    assert len(single) == 1
    ids = reference_ids(hf_tokenizer, FRANCE)
    assert single[0].prompt_token_ids == ids
    assert single[0].prompt == hf_tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=False
    )
    assert single[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids
    assert "Paris" in single[0].text

    batch = llm.chat([FRANCE, MULTI_TURN], [GREEDY, SamplingParams(max_tokens=6, temperature=0)])
    refs = [reference_ids(hf_tokenizer, c) for c in (FRANCE, MULTI_TURN)]
    assert [o.prompt_token_ids for o in batch] == refs
    assert batch[0].token_ids == single[0].token_ids
    assert (
        batch[1].token_ids
        == llm.generate([refs[1]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    )


def test_chat_template_options(llm, hf_tokenizer):
    # No generation prompt: the conversation as it stands (transformers' reference).
    out = llm.chat(MULTI_TURN, ONE_TOKEN, add_generation_prompt=False)[0]
    assert out.prompt_token_ids == reference_ids(hf_tokenizer, MULTI_TURN, add_generation_prompt=False)
    # Continue the assistant's last message instead of starting a new one.
    partial = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(
        partial,
        SamplingParams(max_tokens=3, temperature=0),
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert out.prompt_token_ids == reference_ids(
        hf_tokenizer, partial, add_generation_prompt=False, continue_final_message=True
    )
    assert "Paris" in out.text
    # A template of one's own replaces the model's.
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    out = llm.chat(FRANCE, ONE_TOKEN, chat_template=template)[0]
    assert out.prompt == "[user] What is the capital of France?\n[assistant] "
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)


@pytest.mark.parametrize(
    "messages, error",
    [
        ("hello", r"messages must be a list of \{'role', 'content'\} dicts, got str"),
        ([], r"the conversation has no messages"),
        ([[]], r"the conversation has no messages"),
        (["hello"], r"messages\[0\] must be a dict with 'role' and 'content', got str"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role' \(it has: 'content'\)"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\['role'\] must be a non-empty string"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string .* got int"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string .* got NoneType"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\['content'\]\[0\] must be"),
        ([FRANCE, [{"role": "user"}]], r"conversation 1: messages\[0\] has no 'content'"),
        (FRANCE + [{"role": "user", "content": "hi"}], None),  # the template allows two user turns
        ([{"role": "assistant", "content": "hi"}], None),
    ],
)
def test_malformed_messages_are_named(llm, messages, error):
    if error is None:
        outs = llm.chat(messages, ONE_TOKEN)
        assert len(outs) == 1
        return
    with pytest.raises(RequestError, match=error):
        llm.chat(messages, ONE_TOKEN)
    assert not llm.engine.has_unfinished()


def test_content_parts_are_joined(llm):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert llm.chat(parts, ONE_TOKEN)[0].prompt_token_ids == llm.chat(FRANCE, ONE_TOKEN)[0].prompt_token_ids


def test_no_chat_template_is_a_clear_error(builtin_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_dir)
    tokenizer.chat_template = None
    with pytest.raises(RequestError, match="model-x has no chat template: pass chat_template="):
        render(tokenizer, FRANCE, "model-x")
    assert (
        render(tokenizer, FRANCE, "model-x", chat_template="{{ messages[0].content }}")
        == FRANCE[0]["content"]
    )
    with pytest.raises(RequestError, match="the chat template failed on these messages: .*no such"):
        render(tokenizer, FRANCE, "model-x", chat_template="{{ raise_exception('no such role') }}")


def chat_command(*flags: str) -> list[str]:
    """`ringserve chat` on the CPU, run from this checkout."""
    return [sys.executable, "-m", "ringserve.cli", "chat", "--device", "cpu", *flags]


def test_cli_chat_keeps_the_history(llm):
    """Two piped turns: each answer is what LLM.chat gives on the whole history so far."""
    params = SamplingParams(max_tokens=12, temperature=0)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    first, second = "What is the capital of France?", "And of Germany?"
    run = subprocess.run(
        chat_command("--dtype", "float32", "--max-tokens", "12", "--system", system),
        input=f"{first}\n\n{second}\n",  # the blank line is skipped
        capture_output=True,
        text=True,
        env=CHAT_ENV,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    history = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    answer1 = llm.chat(history, params)[0].text
    history += [{"role": "assistant", "content": answer1}, {"role": "user", "content": second}]
    answer2 = llm.chat(history, params)[0].text
    assert run.stdout == f"{answer1}\n{answer2}\n"
    # The second answer needed the first turn: alone, "And of Germany?" gets another answer.
    assert "Berlin" in answer2
    assert llm.chat([history[0], history[-1]], params)[0].text != answer2


def test_cli_chat_says_why_an_answer_stopped():
    run = subprocess.run(
        chat_command("--max-tokens", "3"),
        input="Tell me a story.\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        env=CHAT_ENV,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1  # one answer, then /exit
    assert "(stopped: length (max_tokens))" in run.stderr


def test_cli_chat_ctrl_c_stops_the_answer_not_the_chat():
    proc = subprocess.Popen(
        chat_command("--max-tokens", "4000"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=CHAT_ENV,
    )
    try:
        proc.stdin.write(b"Tell me a long story.\n")
        proc.stdin.flush()
        first = proc.stdout.read(1)  # the story has begun (hundreds of tokens, unless stopped)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(b"What is the capital of France?\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"(stopped: interrupted)" in err and b"Traceback" not in err
    assert first and b"Paris" in out.splitlines()[-1]  # the next turn was answered
