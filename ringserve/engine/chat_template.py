"""Conversations through a model's chat template.

A conversation is a list of messages, each a dict with a "role" (a string the template
knows: system, user, assistant, ...) and a "content" (a string, or OpenAI's list of
{"type": "text", "text": ...} parts). The engine's `chat_prompt` is the one caller.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ringserve.errors import RequestError


def is_batch(messages) -> bool:
    """True for a list of conversations, False for one conversation (a list of messages)."""
    return isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))


def check_conversation(messages, where: str = "") -> list[dict]:
    """The messages with each content as one string; RequestError names what is malformed.

    where: a prefix for the error, e.g. "conversation 2: " in a batch."""
    if not isinstance(messages, (list, tuple)):
        raise RequestError(
            f"{where}messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise RequestError(f"{where}the conversation has no messages")
    checked = []
    for i, message in enumerate(messages):
        at = f"{where}messages[{i}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{at} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise RequestError(
                    f"{at} has no {key!r} (it has: {', '.join(map(repr, message)) or 'nothing'})"
                )
        role = message["role"]
        if not isinstance(role, str) or not role:
            raise RequestError(f"{at}['role'] must be a non-empty string such as 'user', got {role!r}")
        checked.append({**message, "content": _text(message["content"], at)})
    return checked


def _text(content, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # OpenAI's content parts: text only
        parts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{at}['content'][{j}] must be {{'type': 'text', 'text': str}} "
                    f"(only text is supported), got {part!r}"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(
        f"{at}['content'] must be a string (or a list of text parts), got {type(content).__name__}"
    )


def read_template(template: str | None) -> str | None:
    """A chat template given as a file (read here) or as the template itself (--chat-template)."""
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template


def render(
    tokenizer,
    messages,
    model: str,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for one conversation. model: its path, for the error messages.

    tools: OpenAI function tools ({"type": "function", "function": {...}}) for the template
    to describe to the model; an assistant message's tool_calls and a tool message's
    tool_call_id pass through to it.

    add_generation_prompt: end with the assistant's turn header, so the model answers.
    continue_final_message: leave the last (assistant) message open, so the model continues it.
    """
    messages = check_conversation(messages)
    if tokenizer is None:
        raise RequestError(f"{model} has no tokenizer, so no chat template: pass token ids to generate()")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        # As vLLM and transformers (>= 4.44): no default template is guessed.
        raise RequestError(
            f"{model} has no chat template: pass chat_template= (a Jinja template string) "
            "or use generate() with plain prompts"
        )
    if add_generation_prompt and continue_final_message:
        raise RequestError("add_generation_prompt and continue_final_message cannot both be set")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's")
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            tokenize=False,
        )
    except Exception as e:  # the template itself refuses (e.g. roles must alternate) or is broken
        raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
