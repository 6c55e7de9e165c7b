"""What the OpenAPI schema (/openapi.json) says each route answers, so that clients and
schema-driven fuzzers see the real shapes: OpenAI's {"error": {...}} for any 4xx (bad field
400, key 401, model 404, body too large 413, ...) and for 500 (the engine died) / 503
(overloaded, shutting down); with "stream": true, server-sent events whose data is a chunk
(or an error), then `[DONE]`."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ringserve.server import protocol as P

_REF = "#/components/schemas/{model}"
_ERROR = {"model": P.ErrorResponse}


def _event_schema(chunk: type[BaseModel]) -> dict:
    """One server-sent event: `data: [DONE]`, or `data: {json}` holding a chunk or an error."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [{"$ref": _REF.format(model=m.__name__)} for m in (chunk, P.ErrorResponse)]
        },
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"if": {"const": "[DONE]"}, "else": json_data}},
    }


def generation_responses(chunk: type[BaseModel]) -> dict:
    """A completions route's answers besides its response model (the JSON answer)."""
    return {
        200: {
            "content": {"text/event-stream": {"schema": _event_schema(chunk)}},
            "description": 'The answer; with "stream": true, `data: {chunk}` events then `data: [DONE]`',
        },
        "4XX": {**_ERROR, "description": "A bad request, named in error.param where a field is at fault"},
        "5XX": {**_ERROR, "description": "The engine stopped (500); overloaded or shutting down (503)"},
    }


V1_RESPONSES = {"4XX": {**_ERROR, "description": "A wrong or missing API key (401)"}}
HEALTH_RESPONSES = {
    200: {"description": "Healthy (no body)", "content": None},
    503: {**_ERROR, "description": "The engine loop stopped, or the server is shutting down"},
}
METRICS_RESPONSES = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


def list_stream_chunks(app: FastAPI, chunks: list[type[BaseModel]]) -> None:
    """Add the streamed chunk models to the schema's components: no route returns them as
    its response model, yet the event-stream answers above refer to them."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()
        components = schema["components"]["schemas"]
        _, defs = models_json_schema([(c, "serialization") for c in chunks], ref_template=_REF)
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        return schema

    app.openapi = openapi
