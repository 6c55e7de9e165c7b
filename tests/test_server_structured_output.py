"""Structured output over the OpenAI API, through the official `openai` SDK against the
built-in model: response_format (json_schema, json_object) and vLLM's structured_outputs and
guided_* fields, streamed and not, n > 1; every JSON output validated by `jsonschema`, and
bad requests refused with a 400 naming the field."""

import json
import re

import jsonschema
import openai
import pytest

from conftest import NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "hiking"]}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def json_schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_validates_for_every_choice(live):
    reply = live.client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=120, n=3, temperature=0.8, seed=1,
        response_format=json_schema_format(PERSON),
    )  # fmt: skip
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_validates(live):
    stream = live.client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=120, temperature=0, stream=True,
        response_format=json_schema_format(PERSON),
    )  # fmt: skip
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_json_object_is_a_json_object(live):
    reply = live.client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Name a fruit."}],  # in prose without the format
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")  # no whitespace first


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
        ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}, "compact"),
        ({"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}, r"[A-Z][a-z]{2,8} [0-9]{2}"),
        ({"structured_outputs": {"regex": r"(yes|no), [0-9]{1,3}"}}, r"(yes|no), [0-9]{1,3}"),
        ({"guided_choice": ["Paris", "London", "Rome"]}, r"Paris|London|Rome"),
        ({"guided_grammar": 'root ::= "The answer is " [0-9] "."'}, r"The answer is [0-9]\."),
        ({"response_format": json_schema_format(PERSON)}, None),
    ],
)
def test_completions_take_every_form(live, extra, check):
    reply = live.client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=120, temperature=0, extra_body=extra
    )
    text = reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop", text
    if check in (None, "compact"):
        jsonschema.validate(json.loads(text), PERSON)
        if check == "compact":  # no whitespace between the JSON's tokens
            assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    elif callable(check):
        check(text)
    else:
        assert re.fullmatch(check, text), text


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            "guided_json",
            "grammar",
        ),
        ({"guided_json": "{not json"}, "guided_json", ""),
        ({"guided_regex": "(open"}, "guided_regex", "grammar"),
        ({"guided_grammar": "root ::= undefined"}, "guided_grammar", ""),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "one structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "", ""),
        # SmolLM2's vocabulary has no token for the byte 0x04: found when the grammar needs it
        ({"guided_regex": "a\u0004b"}, "structured_outputs", "tokens cannot follow the grammar"),
    ],
)
def test_bad_structured_output_requests_are_400(live, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model=NAME, messages=ASK, max_tokens=5, extra_body=extra)
    error = e.value.body
    assert param in (error.get("param") or "") + error["message"], error
    assert words in error["message"], error
    assert not live.engine.has_unfinished()
