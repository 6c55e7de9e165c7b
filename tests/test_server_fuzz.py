"""Property-based fuzzing of every route of `ringserve serve` from its own OpenAPI schema.

schemathesis reads /openapi.json from a live CPU server (a tiny model with the built-in
model's tokenizer) and sends
requests drawn from it, valid ones and invalid ones; every answer must be no 5xx, a status
and body the schema declares (errors in OpenAI's {"error": {...}} shape), and invalid data
must be refused with a 4xx. Generations are kept short (a few tokens, few choices) so the
whole run stays within seconds per route.
"""

from __future__ import annotations

from datetime import timedelta

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from ringserve.config import EngineConfig
from ringserve.engine.engine import LLMEngine
from ringserve.server import build_app

from helpers import serve_in_thread

MAX_EXAMPLES = 25  # per route and mode
MAX_TOKENS = 2  # per choice: the cost of a valid request is its generation
MAX_CHOICES = 4  # prompts x n
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def live_url(smol_vocab_model):
    # a tiny model with the built-in's tokenizer and chat template: the schema is what is
    # checked, and its generations cost a fraction of the built-in model's
    engine = LLMEngine(
        smol_vocab_model, device="cpu", dtype="float32", engine_config=EngineConfig(max_model_len=128)
    )
    # a waiting queue one short of MAX_CHOICES: the largest requests must be refused (400 on
    # "n"), never left to a 503 that no retry would end
    with serve_in_thread(build_app(engine, "smol", max_waiting=MAX_CHOICES - 1)) as url:
        yield url


@pytest.fixture(scope="module")
def health(live_url):
    """GET /health over one kept-alive connection (a new one per check costs ~50 ms)."""
    with httpx.Client(base_url=live_url, timeout=10) as client:
        yield lambda: client.get("/health").status_code


def _short(body):
    """The same body with at most MAX_TOKENS tokens and MAX_CHOICES choices, so that each
    request is cheap; a valid body stays valid (JSON's 3.0 is an integer too)."""
    if not isinstance(body, dict):
        return body

    def cap(key, limit):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            body[key] = limit

    cap("max_tokens", MAX_TOKENS)
    cap("max_completion_tokens", MAX_TOKENS)
    cap("n", 2)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # else 16 (completions) or the rest of the context (chat)
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > MAX_CHOICES // 2:
        body["prompt"] = body["prompt"][: MAX_CHOICES // 2]
    return body


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def _call_and_check(case, health) -> None:
    case.body = _short(case.body)
    response = case.call_and_validate(timeout=30, checks=CHECKS)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == ERROR_KEYS, response.text
    # the server goes on serving after whatever it was sent
    assert health() == 200


def _operations(live_url: str):
    schema = schemathesis.openapi.from_url(live_url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    return schema, operations


def test_every_route_answers_random_requests_as_its_schema_says(live_url, health):
    _, operations = _operations(live_url)
    for op in operations:
        # negative data needs something to break: a route without a body or parameters has none
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(op.body) else [])
        for mode in modes:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=timedelta(seconds=20),  # one example is at most 4 choices of 2 tokens
                database=None,
                derandomize=True,  # the same cases on every run: a failure reproduces
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case):
                _call_and_check(case, health)

            fuzz()


def test_every_route_answers_each_fields_edge_cases_as_its_schema_says(live_url, health):
    # schemathesis' coverage cases: each field at its bounds and just past them, of each
    # wrong JSON type, missing, and each route under other methods (a few hundred, most
    # refused before the engine)
    schema, operations = _operations(live_url)
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for op in operations:
        config = schema.config.generation_for(operation=op)
        for case in schema.iter_coverage_cases(op, generation_modes=modes, generation_config=config):
            _call_and_check(case, health)
