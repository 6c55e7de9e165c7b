"""Structured output: every output that must follow a JSON schema parses and validates against
it (checked by the `jsonschema` package, not by the grammar engine that made it), regexes
match, choices are one of the choices, grammars' languages hold; with async scheduling as
without, with free rows beside constrained ones, n > 1, and tp/dp/cp layouts.

The model is a tiny random Llama with SmolLM2's tokenizer (49,152 real tokens): sampled at
temperature 1, its outputs are random walks through each grammar, which reach far more of a
schema than a trained model's answers would."""

import json
import re

import jsonschema
import pytest

from ringserve import LLM, RequestError, SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {  # nested objects, required keys, no others
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {  # enums, const, booleans, null, numbers with bounds
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "kind": {"const": "point"},
            "visible": {"type": "boolean"},
            "note": {"type": "null"},
            "x": {"type": "number", "minimum": -10, "maximum": 10},
        },
        "required": ["color", "kind", "visible", "note", "x"],
        "additionalProperties": False,
    },
    {  # arrays with bounds, of objects and of enums
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -99, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 999},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "minItems": 2,
                "maxItems": 3,
            },
        },
        "required": ["tags", "points"],
        "additionalProperties": False,
    },
    {  # patterns and alternatives
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["none", "all"]}]},
        },
        "required": ["id", "value"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 5},
]


def constrained(seed: int, temperature: float = 1.0, max_tokens: int = 120, **spec) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def check_schema_outputs(outs, schemas) -> None:
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_outputs_validate_against_their_schemas(smol_vocab_model, async_scheduling):
    # Each schema twice (seeds differ: n > 1 as the server sends it), greedy once;
    # beside free rows, a regex row and a choice row. Compact JSON: a random model given
    # free whitespace would spend every token on it (the server's tests leave it free).
    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(2):
            params.append(constrained(10 * i + seed, json=schema, disable_any_whitespace=True))
            schemas.append(schema)
        params.append(
            constrained(10 * i + 9, temperature=0, json=json.dumps(schema), disable_any_whitespace=True)
        )
        schemas.append(schema)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params += [
        free,
        constrained(7, regex=r"[a-z]{3}-[0-9]{2,4}"),
        constrained(8, choice=["yes", "no", "perhaps"]),
    ]
    prompts = ["Write JSON."] * len(params)
    with LLM(smol_vocab_model, device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, params)
        alone = llm.generate(prompts[:1], free)[0]
    check_schema_outputs(outs, schemas)
    assert outs[len(schemas)].token_ids == alone.token_ids  # a free row beside grammars is untouched
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", outs[-2].text), outs[-2].text
    assert outs[-1].text in ("yes", "no", "perhaps")
    # the walks differ: the seeds explore the schema rather than repeat one output
    assert len({o.text for o in outs[:3]}) == 3, [o.text for o in outs[:3]]


def test_grammars_lark_and_gbnf(smol_vocab_model):
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    lark = 'start: "[" item ("," item)* "]"\nitem: /[a-c]{1,3}/'
    # (json_object is left to the server's tests: a random model never closes a free-form key)
    params = [constrained(3, grammar=gbnf), constrained(4, grammar=lark), constrained(5, grammar=lark)]
    with LLM(smol_vocab_model, device="cpu", dtype="float32") as llm:
        outs = llm.generate(["Go."] * len(params), params)
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", outs[0].text), outs[0].text
    for out in outs[1:]:
        assert re.fullmatch(r"\[[a-c]{1,3}(?:,[a-c]{1,3})*\]", out.text), out.text


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2), dict(cp=2)])
def test_parallel_layouts_follow_the_grammar_as_one_rank(smol_vocab_model, layout):
    schemas = SCHEMAS[:3]
    # seeded sampling: as reproducible as greedy, and it does not loop in a number's digits
    params = [constrained(i, json=s, disable_any_whitespace=True) for i, s in enumerate(schemas)]
    params.append(constrained(5, temperature=0, regex=r"[0-9]{4}"))
    prompts = ["Write JSON.", "Now some JSON, please.", "JSON", "Digits"]
    with LLM(smol_vocab_model, device="cpu", dtype="float32") as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(smol_vocab_model, device="cpu", dtype="float32", timeout_s=60, **layout) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    check_schema_outputs(outs, schemas)


def test_bad_grammars_are_refused_and_nothing_is_queued(smol_vocab_model):
    with LLM(smol_vocab_model, device="cpu", dtype="float32") as llm:
        for spec, words in [
            (dict(json="{not json"), "structured_outputs"),
            (dict(regex="(unclosed"), "grammar cannot be used"),
            (dict(grammar="start: undefined_rule"), "grammar cannot be used"),
            (
                dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
                "grammar cannot be used",
            ),
        ]:
            with pytest.raises(RequestError, match=words):
                llm.generate(["x", "y"], [SamplingParams(max_tokens=2), constrained(0, **spec)])
            assert not llm.engine.has_unfinished()
    for spec in [{}, dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=[1])]:
        with pytest.raises(RequestError, match="structured_outputs"):
            StructuredOutputsParams(**spec)


def test_grammar_masks_match_each_matchers_own_bitmask_as_the_batch_grows(smol_vocab_model):
    """GrammarMasks.apply against llguidance's compute_bitmask, row by row, over steps whose
    batch grows past the host buffers (they are rebuilt) and shrinks (a slice of them), with
    free rows (every token allowed) and a row whose grammar is done (left as it is)."""
    import torch
    from transformers import AutoTokenizer

    from ringserve.engine.structured_output import GrammarCompiler, GrammarMasks

    tokenizer = AutoTokenizer.from_pretrained(smol_vocab_model)
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    masks = GrammarMasks(vocab, torch.device("cpu"))
    spec = StructuredOutputsParams(json=SCHEMAS[2], disable_any_whitespace=True)
    grammars = [compiler.matcher(spec) for _ in range(8)]  # a row's own: one matcher per row
    done = compiler.matcher(StructuredOutputsParams(choice=["yes"]))
    done.advance(tokenizer.encode("yes", add_special_tokens=False))
    assert done.done
    # each row in its own state (one in error: "[" is not an object)
    prefixes = [
        '{"tags":["a"',
        '{"tags',
        "",
        '{"tags":["b","c"],"points":[{"x":1',
        "[",
        '{"tags":["a","b"],"points":[',
        "{",
        '{"tags":["c"],',
    ]
    for g, prefix in zip(grammars, prefixes):
        g.advance(tokenizer.encode(prefix, add_special_tokens=False))
    assert grammars[4].error is not None and all(g.error is None for i, g in enumerate(grammars) if i != 4)
    for num_rows, rows in [(3, [0, 2]), (8, [1, 2, 4, 5, 7]), (2, [1])]:
        logits = torch.randn(num_rows, vocab)
        step = [grammars[i] for i in rows]
        if num_rows == 8:
            rows, step = [*rows, 6], [*step, done]
        masked = masks.apply(logits, rows, step)
        for r in range(num_rows):
            if r not in rows or (r == 6 and num_rows == 8):
                assert torch.equal(masked[r], logits[r])  # free, or done: untouched
                continue
            g = step[rows.index(r)]
            if g.error is not None:
                assert torch.equal(masked[r], logits[r])
                continue
            words = torch.frombuffer(bytearray(g.matcher.compute_bitmask()), dtype=torch.int32)
            allowed = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
            assert torch.equal(masked[r] == float("-inf"), allowed == 0)
            assert torch.equal(masked[r][allowed == 1], logits[r][allowed == 1])
