"""A chat request's tools: its checks, as vLLM's OpenAI server makes them, what the chat
template receives, and how the output becomes tool calls (a grammar for the forced choices,
the server's parser for "auto")."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from ringserve.server import protocol as P
from ringserve.server.tool_parsers import NamedFunction, RequiredCalls, ToolParser


class ToolsError(ValueError):
    """A request whose tools cannot work (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None  # what the chat template renders
    schema: dict | None  # what the output must follow (the forced choices)
    parser: ToolParser | None  # what reads the calls out of the output
    max_calls: int | None  # 1 when parallel_tool_calls is false

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def plan_tools(body: P.ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """What the request's tools and tool_choice ask for; ToolsError if it cannot be served.
    auto_parser: the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    tools = body.tools
    choice = body.tool_choice
    if choice is None:  # OpenAI's default: auto with tools, none without
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:  # as vLLM
        raise ToolsError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    names = [t.function.name for t in tools or []]
    for name in names:
        if names.count(name) > 1:
            raise ToolsError(f"tools: the function name {name!r} is given more than once", "tools")
    if choice == "required" and not tools:  # OpenAI and vLLM: as "none"
        choice = "none"
    rendered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan("none", rendered, None, None, None)
    if choice == "auto":
        if auto_parser is None:
            raise ToolsError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return ToolPlan("auto", rendered, None, auto_parser, max_calls)
    if choice == "required":
        return ToolPlan("required", rendered, required_schema(tools, max_calls), RequiredCalls(), max_calls)
    name = choice.function.name
    if name not in names:
        raise ToolsError(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`",
            "tool_choice",
        )
    return ToolPlan("named", rendered, _parameters(tools[names.index(name)]), NamedFunction(name), None)


def _parameters(tool: P.ChatTool) -> dict:
    # a function without parameters takes an object, as vLLM constrains it
    return copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}


def required_schema(tools: list[P.ChatTool], max_calls: int | None = None) -> dict:
    """tool_choice "required", as vLLM constrains it: a list of at least one
    {"name": one of the tools, "parameters": its arguments}; at most max_calls of them
    (parallel_tool_calls false). Each tool's $defs move to the top, where its $refs
    ("#/$defs/...") then point."""
    defs: dict[str, dict] = {}
    alternatives = []
    for tool in tools:
        params = _parameters(tool)
        for key, schema in params.pop("$defs", {}).items():
            if key in defs and defs[key] != schema:
                raise ToolsError(f"tools: the definition {key!r} has different schemas in two tools", "tools")
            defs[key] = schema
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[P.ChatMessage]) -> list[dict]:
    """The conversation as chat templates read it: an assistant's calls with their
    arguments as objects (Hugging Face templates write them with tojson, as vLLM passes
    them), a tool message's tool_call_id and name."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolsError(f"messages.{i}: only an assistant message has tool_calls", "messages")
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ToolsError(
                    f"messages.{i}: a tool message needs the tool_call_id it answers", "messages"
                )
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _args(call: P.ToolCallParam):
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:  # as written: the template shows what the model wrote
        return call.function.arguments
