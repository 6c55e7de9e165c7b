"""Tool calling: each family's parser on hand-written outputs (whole, and streamed in any
chunking), tools and tool calls through a chat template, and the chat API through the
official `openai` SDK on the built-in model: named and required choices (enforced by the
grammar, the arguments validated by `jsonschema`), auto through a server built with a
parser, streamed and not, the special tokens a parser reads kept for it (a tokenizer with
Mistral's markers added), and the 400s of bad tools."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from ringserve.server.tool_parsers import PARSERS, ToolCallStream, parse_whole

from conftest import KEY, NAME

# Special tokens as a tokenizer of each family lists them (stripped from content)
SPECIAL = [
    "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|im_end|>", "</s>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
    "<|return|>", "<|constrain|>",
]  # fmt: skip

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"tz": "Europe/Paris", "precise": true, "n": [1, 2.5e-3]}'

# family -> (output, content, [(name, arguments)], reasoning)
CASES = {
    "llama3_json": [
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}<|eom_id|>', "",
         [("get_weather", WEATHER)], ""),
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", "parameters": {TIME}}}',
         "", [("get_weather", WEATHER), ("get_time", TIME)], ""),
        (f'Let me look.\n<|python_tag|>{{"name": "get_time", "arguments": {TIME}}}', "Let me look.",
         [("get_time", TIME)], ""),
        ('{"city": "Paris"}<|eot_id|>', '{"city": "Paris"}', [], ""),  # JSON that is no call
        # malformed (before its name is complete: a stream has sent nothing of it yet)
        ('<|python_tag|>{"name": get_weather, "parameters": {"city": "Paris"}}',
         '{"name": get_weather, "parameters": {"city": "Paris"}}', [], ""),
        ("The capital is Paris. {braces} <|eot_id|>", "The capital is Paris. {braces} ", [], ""),
    ],
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call><|im_end|>', "",
         [("get_weather", WEATHER)], ""),
        (f'I will check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
         f'<tool_call>\n{{"arguments": {TIME}, "name": "get_time"}}\n</tool_call>',
         "I will check both.", [("get_weather", WEATHER), ("get_time", TIME)], ""),
        ('<tool_call>\n{"name": get_weather}\n</tool_call> then text',  # malformed: content as written
         '<tool_call>\n{"name": get_weather}\n</tool_call> then text', [], ""),
        ("a < b and <tool> is not <tool_call", "a < b and <tool> is not <tool_call", [], ""),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]</s>', "",
         [("get_weather", WEATHER)], ""),
        (f'Two calls.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
         f'{{"name": "get_time", "arguments": {TIME}}}]',
         "Two calls.", [("get_weather", WEATHER), ("get_time", TIME)], ""),
        ("[TOOL_CALLS] get_weather(Paris)</s>", " get_weather(Paris)", [], ""),  # malformed
        # v11 and later (Mistral Small 3.2, Magistral, Devstral): NAME[ARGS]{...} per call
        (f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}</s>", "", [("get_weather", WEATHER)], ""),
        (f"Two calls.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}",
         "Two calls.", [("get_weather", WEATHER), ("get_time", TIME)], ""),
        # v11 writes back the call ids of its prompt; a detokenizer may drop [ARGS]
        (f"[TOOL_CALLS] get_weather[CALL_ID]a1B2c3D4e[ARGS] {WEATHER} [TOOL_CALLS]get_time{TIME}",
         "", [("get_weather", WEATHER), ("get_time", TIME)], ""),
        (f"[TOOL_CALLS]get_time[ARGS]{TIME}\nDone [soon].", "Done [soon].", [("get_time", TIME)], ""),
        ("[TOOL_CALLS]get_weather[ARGS]Paris</s>", "get_weatherParis", [], ""),  # no arguments: text
        ("Use [TOOL_CALLS]get_weather", "Use get_weather", [], ""),  # cut off before its arguments
    ],
    "openai": [
        (f"<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
         f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>",
         "", [("get_weather", WEATHER)], "The user wants the weather."),
        ("<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final"
         "<|message|>It is 4.<|return|>", "It is 4.", [], "2 + 2 is 4."),
        (f"<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_weather"
         f"<|channel|>commentary json<|message|>{WEATHER}<|call|><|start|>assistant<|channel|>commentary "
         f"to=functions.get_time <|constrain|>json<|message|>{TIME}<|call|>",
         "Checking both.", [("get_weather", WEATHER), ("get_time", TIME)], ""),
    ],
}  # fmt: skip
FLAT = [(family, *case) for family, cases in CASES.items() for case in cases]


def test_every_family_has_cases():
    assert set(CASES) == set(PARSERS)


@pytest.mark.parametrize("family, text, content, calls, reasoning", FLAT)
def test_whole_output(family, text, content, calls, reasoning):
    parsed, ids = parse_whole(PARSERS[family](SPECIAL), text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.reasoning == reasoning
    for _, arguments in calls:
        json.loads(arguments)
    assert len(set(ids)) == len(calls)
    if family == "mistral":  # Mistral's templates refuse other ids
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids)


def stream(parser, parts: list[str], max_calls=None):
    """What a client rebuilds from a stream fed these pieces: content, reasoning, calls.
    Each call's first delta must carry its id and name, later ones only arguments."""
    reader = ToolCallStream(parser, max_calls)
    content = reasoning = ""
    calls: list[list[str]] = []
    for k, part in enumerate(parts):
        delta = reader.feed(part, final=k == len(parts) - 1)
        content += delta.content
        reasoning += delta.reasoning
        for call in delta.calls:
            if call.index == len(calls):
                assert call.id and call.name
                calls.append([call.name, call.arguments])
            else:
                assert call.id is None and call.name is None
                calls[call.index][1] += call.arguments
    return content, reasoning, [tuple(c) for c in calls]


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """A text split a character at a time, not at all, and at 20 random sets of points."""
    rng = random.Random(seed)
    splits = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


@pytest.mark.parametrize("family, text, content, calls, reasoning", FLAT)
def test_streamed_in_any_chunking_gives_the_whole_result(family, text, content, calls, reasoning):
    parser = PARSERS[family](SPECIAL)
    for parts in chunkings(text):
        assert stream(parser, parts) == (content, reasoning, calls), parts


def test_content_is_never_sent_before_it_is_known_not_to_be_a_call():
    parser = PARSERS["hermes"]([])
    reader = ToolCallStream(parser)
    sent = ""
    for ch in 'Sure <tool_call>{"name": "f", "arguments": {}}</tool_call>':
        sent += reader.feed(ch, final=False).content
        assert "Sure".startswith(sent)  # never the space before the call, nor the marker's start


def test_mistral_v11_sends_no_call_before_its_name_ends_nor_content_that_may_be_a_marker():
    reader = ToolCallStream(PARSERS["mistral"]([]))  # no special tokens listed: the markers alone
    text = 'Sure [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    sent, names = "", []
    for k, ch in enumerate(text, 1):
        delta = reader.feed(ch, final=k == len(text))
        sent += delta.content
        names += [c.name for c in delta.calls if c.name]
        assert "Sure".startswith(sent)  # never the space before the call, nor "[TOOL_C..."
    assert sent == "Sure" and names == ["get_weather"]


@pytest.mark.parametrize(
    "text, calls",
    [
        # the first call's arguments are no JSON; the second's are cut off (max_tokens)
        (f'[TOOL_CALLS]get_weather[ARGS]{{"city": Paris}} [TOOL_CALLS]get_time[ARGS]{TIME[:20]}',
         [("get_weather", '{"city": Paris} '), ("get_time", TIME[:20])]),
        (f"[TOOL_CALLS]get_time[ARGS]{{[TOOL_CALLS]get_weather[ARGS]{WEATHER}",
         [("get_time", "{"), ("get_weather", WEATHER)]),
    ],
)  # fmt: skip
def test_mistral_v11_arguments_that_are_no_json_still_make_a_call(text, calls):
    """As vLLM: once a v11 call's arguments have begun it is a call, its arguments as written
    (the model then sees in its history the call it tried), whole and streamed alike."""
    parsed, _ = parse_whole(PARSERS["mistral"](SPECIAL), text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("", calls)
    for parts in chunkings(text):
        assert stream(PARSERS["mistral"](SPECIAL), parts) == ("", "", calls), parts


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f'<tool_call>{{"name": "a", "arguments": {WEATHER}}}</tool_call><tool_call>{{"name": "b", "arguments": {{}}}}</tool_call>'
    parsed, _ = parse_whole(PARSERS["hermes"]([]), text, max_calls=1)
    assert [c.name for c in parsed.calls] == ["a"]
    assert stream(PARSERS["hermes"]([]), list(text), max_calls=1)[2] == [("a", WEATHER)]


# Chat templates --------------------------------------------------------------------------

# A template that uses what tools need: the tools' JSON, an assistant's calls (arguments as
# objects, as Hugging Face templates take them), and the tool's answer with its call id.
TOOLS_TEMPLATE = """
{%- if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}{% endfor %}{{ "\n" }}
{%- endif -%}
{%- for m in messages -%}
{%- if m.tool_calls -%}
<{{ m.role }}>{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}{{ "\n" }}
{%- elif m.role == 'tool' -%}
<tool {{ m.tool_call_id }}>{{ m.content }}
{% else -%}
<{{ m.role }}>{{ m.content }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<assistant>{% endif -%}
"""

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "additionalProperties": False,
            "$defs": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        },
    },
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]


def test_tools_and_calls_render_through_the_template(live):
    from ringserve.engine import chat_template as chat
    from ringserve.server import protocol as P
    from ringserve.server.tools import template_messages

    messages = template_messages([P.ChatMessage.model_validate(m) for m in CONVERSATION])
    text = chat.render(
        live.engine.tokenizer, messages, "m", chat_template=TOOLS_TEMPLATE, tools=[GET_WEATHER, GET_TIME]
    )
    assert text == (
        f"TOOLS: get_weather{json.dumps(GET_WEATHER['function']['parameters'])}"
        f" get_time{json.dumps(GET_TIME['function']['parameters'])}\n"
        "<user>Weather in Paris?\n<assistant>CALL call_1 get_weather Paris\n<tool call_1>18 degrees\n<assistant>"
    )


# The server ------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (GET_WEATHER, GET_TIME)}


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def chat_calls(client, streamed: bool, **kwargs):
    """(content, [(id, name, arguments)], finish_reason) of one chat completion, streamed or not."""
    if streamed:
        return collect_stream(client.chat.completions.create(stream=True, **kwargs))
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def collect_stream(chunks):
    """(content, calls [(id, name, arguments)], finish_reason) of a streamed chat choice 0."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index == len(calls):  # the first delta: id, type, name
                    assert call.id and call.type == "function" and call.function.name
                    calls.append([call.id, call.function.name, call.function.arguments or ""])
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls], finish


@pytest.mark.parametrize("streamed", [False, True])
def test_named_tool_choice_gives_that_functions_arguments(live, streamed):
    kwargs = dict(
        model=NAME, messages=ASK, max_tokens=80, temperature=0, tools=[GET_WEATHER, GET_TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    if streamed:
        content, calls, finish = collect_stream(live.client.chat.completions.create(stream=True, **kwargs))
        assert content == ""
    else:
        choice = live.client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert finish == "stop"  # a forced function ends as OpenAI's does
    [(call_id, name, arguments)] = calls
    assert call_id.startswith("chatcmpl-tool-") and name == "get_weather"
    _validate(name, arguments)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_of_the_tools(live, streamed, parallel):
    kwargs = dict(
        model=NAME, messages=ASK, max_tokens=200, temperature=0, tools=[GET_WEATHER, GET_TIME],
        tool_choice="required", parallel_tool_calls=parallel,
    )  # fmt: skip
    if streamed:
        _, calls, finish = collect_stream(live.client.chat.completions.create(stream=True, **kwargs))
    else:
        choice = live.client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert finish == "tool_calls"
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for _, name, arguments in calls:
        _validate(name, arguments)
    assert len({c[0] for c in calls}) == len(calls)


def test_a_conversation_with_calls_and_results_is_served(live):
    reply = live.client.chat.completions.create(
        model=NAME,
        messages=CONVERSATION,
        max_tokens=8,
        temperature=0,
        tools=[GET_WEATHER],
        tool_choice="none",
    )
    assert (
        reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    )


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "does not match"),
        ({"tools": [GET_WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),  # auto by default
        ({"tools": [GET_WEATHER], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tools": [GET_WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": [{"type": "function", "function": {"name": "get weather!"}}], "tool_choice": "none"},
         "tools", "pattern"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", ""),
        ({"tools": [GET_WEATHER, GET_WEATHER], "tool_choice": "required"}, "tools", "more than once"),
        ({"tools": [GET_WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "tool_choice", "one structured output"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools", ""),
        ({"tools": [GET_WEATHER], "tool_choice": "none",
          "messages": [{"role": "tool", "content": "18 degrees"}]}, "messages", "tool_call_id"),
        ({"tools": [GET_WEATHER], "tool_choice": "none", "messages": [{"role": "user", "content": "hi",
          "tool_calls": CONVERSATION[1]["tool_calls"]}]}, "messages", "assistant"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(live, extra, param, words):
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
    r = live.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tool_choice_none_without_tools_and_required_with_none_are_plain_chat(live):
    for extra in ({"tool_choice": "none"}, {"tools": [], "tool_choice": "required"}):
        r = live.http.post(
            "/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
        )
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"], r.text


@pytest.fixture(scope="module")
def hermes_live():
    """A server built with --enable-auto-tool-choice --tool-call-parser hermes."""
    from ringserve.config import EngineConfig
    from ringserve.engine.engine import LLMEngine
    from ringserve.server import build_app

    from helpers import serve_in_thread

    engine = LLMEngine(None, device="cpu", dtype="float32", engine_config=EngineConfig(max_model_len=512))
    app = build_app(engine, NAME, api_key=KEY, tool_call_parser="hermes", enable_auto_tool_choice=True)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0))


# SmolLM2 writes no tool calls of itself: a regex makes it write what Qwen would
HERMES_OUTPUT = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}'
    r"\n</tool_call>"
)


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_reads_the_calls_with_the_servers_parser(hermes_live, streamed):
    kwargs = dict(
        model=NAME, messages=ASK, max_tokens=60, temperature=0, tools=[GET_WEATHER, GET_TIME],
        extra_body={"structured_outputs": {"regex": HERMES_OUTPUT}},
    )  # fmt: skip
    content, calls, finish = chat_calls(hermes_live.client, streamed, **kwargs)
    assert content == "Checking."
    assert [(name, json.loads(args)) for _, name, args in calls] == [("get_weather", json.loads(WEATHER))]
    assert finish == "tool_calls"


def test_auto_without_a_call_is_plain_content(hermes_live):
    reply = hermes_live.client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=20, temperature=0, tools=[GET_WEATHER],
        extra_body={"structured_outputs": {"regex": "It is sunny < 30 degrees"}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.content == "It is sunny < 30 degrees" and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


@pytest.fixture(scope="module")
def mistral_live(tmp_path_factory, builtin_dir):
    """A server built with --enable-auto-tool-choice --tool-call-parser mistral on a tiny
    random Llama whose tokenizer (SmolLM2's) has Mistral's [TOOL_CALLS] and [ARGS] added
    as special tokens, which a detokenizer drops unless told to keep them. Its `markers`:
    their token ids."""
    import shutil

    import transformers as tf

    from ringserve.config import EngineConfig
    from ringserve.engine.engine import LLMEngine
    from ringserve.model.tiny_models import TINY, save_random_model
    from ringserve.server import build_app

    from helpers import serve_in_thread

    folder = str(tmp_path_factory.mktemp("mistral_markers"))
    tokenizer = tf.AutoTokenizer.from_pretrained(builtin_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tokenizer.save_pretrained(folder)
    shutil.copy(f"{builtin_dir}/chat_template.jinja", folder)
    config = tf.LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)}, tie_word_embeddings=True)
    save_random_model(config, folder)
    engine = LLMEngine(folder, device="cpu", dtype="float32", engine_config=EngineConfig(max_model_len=512))
    app = build_app(engine, NAME, api_key=KEY, tool_call_parser="mistral", enable_auto_tool_choice=True)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(
            client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0),
            markers=tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"]),
        )


def _mistral_v11_grammar(markers: list[int]) -> str:
    """A Lark grammar (llguidance's: <[ID]> is that token) that makes the random model write
    Mistral v11's call with its markers as the special tokens themselves."""
    tool_calls, args = markers
    return f'start: "Checking." <[{tool_calls}]> "get_weather" <[{args}]> {json.dumps(WEATHER)}'


@pytest.mark.parametrize("streamed", [False, True])
def test_the_parsers_markers_reach_it_though_the_request_skips_special_tokens(mistral_live, streamed):
    """The request leaves skip_special_tokens at its default (true): the server keeps the
    special tokens of an output its parser reads, which finds the call in them."""
    kwargs = dict(
        model=NAME, messages=ASK, max_tokens=60, temperature=0, tools=[GET_WEATHER],
        extra_body={"structured_outputs": {"grammar": _mistral_v11_grammar(mistral_live.markers)}},
    )  # fmt: skip
    content, calls, finish = chat_calls(mistral_live.client, streamed, **kwargs)
    assert content == "Checking."
    assert [(name, args) for _, name, args in calls] == [("get_weather", WEATHER)]
    assert all(len(call_id) == 9 and call_id.isalnum() for call_id, _, _ in calls)
    assert finish == "tool_calls"


def test_without_the_parser_the_same_output_has_its_markers_dropped(mistral_live):
    """The same tokens in a request that no parser reads (no tools): the special tokens go,
    as the detokenizer drops them by default."""
    reply = mistral_live.client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"grammar": _mistral_v11_grammar(mistral_live.markers)}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.content == "Checking.get_weather" + WEATHER and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_is_a_list_of_calls_of_the_tools(parallel):
    from ringserve.server import protocol as P
    from ringserve.server.tools import required_schema

    tools = [P.ChatTool.model_validate(t) for t in (GET_WEATHER, GET_TIME)]
    schema = required_schema(tools, None if parallel else 1)
    weather = {"name": "get_weather", "parameters": json.loads(WEATHER)}
    time_call = {"name": "get_time", "parameters": {"zone": "CET"}}  # its $ref resolves at the top
    jsonschema.validate([weather], schema)
    for bad in (
        [],
        [{"name": "get_time", "parameters": {"zone": "Mars"}}],
        [{"name": "nope", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate([weather, time_call], schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([weather, time_call], schema)
    assert required_schema(tools, None if parallel else 1) == schema  # the tools are left as they were
