"""Reading JSON that is still being generated: where a value ends, whether the text so far
can still become valid JSON, and the tool-call objects ({"name": ..., "arguments": {...}})
inside it, with the raw text of their arguments so far (what a stream sends as fragments).

Two outcomes besides a value's end: Incomplete (the text ends inside the value, valid so
far: more tokens may complete it) and Malformed (no continuation can make it JSON)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


class Incomplete(Exception):
    """The text ends inside the value; what came so far is valid."""


class Malformed(Exception):
    """The text cannot be (the start of) the JSON expected here."""


_WS = re.compile(r"[ \t\n\r]*")
_CHARS = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*'
_STRING = re.compile(f'"{_CHARS}"')
_STRING_START = re.compile(f'"{_CHARS}' + r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z")  # cut off inside
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")
_LITERALS = ("true", "false", "null")


def skip_ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def string_end(s: str, i: int) -> int:
    """The index after the JSON string starting at s[i] (a quote)."""
    m = _STRING.match(s, i)
    if m:
        return m.end()
    if _STRING_START.match(s, i):
        raise Incomplete
    raise Malformed


def value_end(s: str, i: int) -> int:
    """The index after the JSON value starting at s[i] (no whitespace before it)."""
    if i >= len(s):
        raise Incomplete
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        return _container_end(s, i)
    if c == "-" or c.isdigit():
        run = _NUMBER_CHARS.match(s, i)  # the number is all of it: "1.5" is no "1" then ".5"
        if run.end() == len(s):  # at the very end it may still grow
            if _NUMBER_START.fullmatch(run.group()):
                raise Incomplete
        elif _NUMBER.fullmatch(run.group()):
            return run.end()
        raise Malformed
    for literal in _LITERALS:
        if s.startswith(literal, i):
            return i + len(literal)
        if literal.startswith(s[i:]):
            raise Incomplete
    raise Malformed


def _container_end(s: str, i: int) -> int:
    is_object = s[i] == "{"
    close = "}" if is_object else "]"
    i = _need(s, skip_ws(s, i + 1))
    if s[i] == close:
        return i + 1
    while True:
        if is_object:
            if s[i] != '"':
                raise Malformed
            i = _expect(s, skip_ws(s, string_end(s, i)), ":")
            i = skip_ws(s, i)
        i = _need(s, skip_ws(s, value_end(s, i)))
        if s[i] == close:
            return i + 1
        i = _need(s, skip_ws(s, _expect(s, i, ",")))


def _need(s: str, i: int) -> int:
    if i >= len(s):
        raise Incomplete
    return i


def _expect(s: str, i: int, char: str) -> int:
    if s[_need(s, i)] != char:
        raise Malformed
    return i + 1


@dataclass
class CallScan:
    """A tool-call object read so far."""

    name: str | None  # once its string is complete
    arguments: str | None  # the raw text of the arguments object (so far); None: not begun
    end: int | None  # the index after the object; None while it is incomplete


def scan_call(s: str, i: int, args_keys: tuple[str, ...]) -> CallScan:
    """The call object {"name": "...", <one of args_keys>: {...}} starting at s[i] (keys in
    any order, others ignored). Malformed when it is not one: a complete object must name
    its function and give its arguments as an object."""
    name = arguments = None
    if i >= len(s):
        return CallScan(None, None, None)
    if s[i] != "{":
        raise Malformed
    try:
        i = _need(s, skip_ws(s, i + 1))
        if s[i] != "}":
            while True:
                if s[i] != '"':
                    raise Malformed
                key_end = string_end(s, i)
                key = json.loads(s[i:key_end])
                v = skip_ws(s, _expect(s, skip_ws(s, key_end), ":"))
                # a name that is no string, or arguments that are no object, show at once
                if v < len(s) and s[v] != {"name": '"'}.get(key, "{" if key in args_keys else s[v]):
                    raise Malformed
                if key in args_keys:
                    try:
                        end = value_end(s, v)
                    except Incomplete:
                        arguments = s[v:]
                        raise
                    arguments = s[v:end]
                    json.loads(arguments)  # the escapes inside its strings too
                else:
                    end = value_end(s, v)
                    if key == "name":
                        name = json.loads(s[v:end])
                i = _need(s, skip_ws(s, end))
                if s[i] == "}":
                    break
                i = _need(s, skip_ws(s, _expect(s, i, ",")))
    except Incomplete:
        return CallScan(name, arguments, None)
    except json.JSONDecodeError:
        raise Malformed from None
    if name is None or arguments is None:
        raise Malformed
    return CallScan(name, arguments, i + 1)


def scan_call_list(s: str, i: int, args_keys: tuple[str, ...]) -> tuple[list[CallScan], int | None]:
    """A JSON array of call objects starting at s[i]: the calls read so far (the last one
    possibly incomplete) and the index after the array (None while it is incomplete)."""
    calls: list[CallScan] = []
    if i >= len(s):
        return calls, None
    if s[i] != "[":
        raise Malformed
    i = skip_ws(s, i + 1)
    while True:
        call = scan_call(s, i, args_keys)
        calls.append(call)
        if call.end is None:
            return calls, None
        i = skip_ws(s, call.end)
        if i >= len(s):
            return calls, None
        if s[i] == "]":
            return calls, i + 1
        if s[i] != ",":
            raise Malformed
        i = skip_ws(s, i + 1)
