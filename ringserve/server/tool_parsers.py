"""Tool calls out of a model's text, per model family (vLLM's --tool-call-parser names).

A parser reads the whole text generated so far and says what it holds: the content (text
outside the calls), the calls (function name and the raw JSON text of the arguments) and,
for gpt-oss, the reasoning. `final=False` reads a text that is still growing: it leaves out
what may yet turn into a call (the start of a marker, a call whose name is not complete),
so that each reading extends the one before. A stream (ToolCallStream) sends the difference
between successive readings, so streamed and whole responses carry the same calls.

Arguments are the text the model wrote for them (valid JSON, its whitespace kept; only
Mistral's v11 form keeps malformed ones, as vLLM does), never re-serialized, so a streamed
call's fragments join to exactly the whole response's.

Special tokens: the markers of these families are (or may be) special tokens, which the
detokenizer drops by default; a request parsed here keeps them (keeps_special_tokens, as
vLLM's parsers adjust the request) and the parser strips every special token from content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from ringserve.server.json_prefix import (
    CallScan,
    Incomplete,
    Malformed,
    scan_call,
    scan_call_list,
    skip_ws,
    value_end,
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


def special_token_strings(tokenizer) -> list[str]:
    """The tokenizer's special tokens as text (its added tokens marked special, BOS/EOS...)."""
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            tokens.add(str(added))
    return sorted(t for t in tokens if t)


class ToolParser:
    """Base: the content pieces and calls of a text; a family implements `pieces`."""

    name = ""
    keeps_special_tokens = True  # the request decodes its special tokens, stripped from content here
    markers: tuple[str, ...] = ()  # text that starts or ends a call: never sent as content early

    def __init__(self, special_tokens=()):
        self.special = [t for t in special_tokens if t]
        held = [*self.markers, *self.special]
        # every proper prefix of a marker or special token: a text ending in one is held back
        self._prefixes = {m[:k] for m in held for k in range(1, len(m))}
        self._longest = max((len(m) for m in held), default=0)
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)))
            if self.special
            else None
        )

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"  # as vLLM names them

    def parse(self, text: str, final: bool = True) -> Parsed:
        pieces = self.pieces(text, final)
        content, calls = [], []
        for k, piece in enumerate(pieces):
            if isinstance(piece, ToolCall):
                calls.append(piece)
                continue
            piece = self.strip_special(piece)
            # whitespace between text and a call is the call's layout, not content; the
            # last piece of a growing text may still be followed by one
            if k and isinstance(pieces[k - 1], ToolCall):
                piece = piece.lstrip()
            if (k + 1 < len(pieces) and isinstance(pieces[k + 1], ToolCall)) or (
                k + 1 == len(pieces) and not final
            ):
                piece = piece.rstrip()
            content.append(piece)
        return Parsed("".join(content), calls)

    def pieces(self, text: str, final: bool) -> list[str | ToolCall]:
        """The text in order as content strings and calls."""
        raise NotImplementedError

    # Helpers for the families ----------------------------------------------------------

    def open_tail(self, text: str, final: bool) -> str:
        """Text that runs to the end of the output, less (while it grows) an end that may
        be the start of a marker or a special token."""
        if final:
            return text
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return text[:-k]
        return text

    def strip_special(self, text: str) -> str:
        return self._special_re.sub("", text) if self._special_re else text


def _shown(scans: list[CallScan]) -> list[ToolCall]:
    """The calls of a scan that can be shown: those whose name is complete."""
    return [ToolCall(c.name, c.arguments or "") for c in scans if c.name is not None]


class Hermes(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    blocks, text around them. A block that is no call stays in the content as written."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def pieces(self, text, final):
        out: list[str | ToolCall] = []
        pos, pending = 0, ""  # pending: content since the last call
        while (start := text.find(self.OPEN, pos)) >= 0:
            body = skip_ws(text, start + len(self.OPEN))
            try:
                scan = scan_call(text, body, ("arguments",))
                if scan.end is None:
                    if final:  # cut off (max_tokens): it is text
                        raise Malformed
                    return [*out, pending + text[pos:start], *_shown([scan])]
                after = skip_ws(text, scan.end)
                if text.startswith(self.CLOSE, after):
                    end = after + len(self.CLOSE)
                elif after == len(text) or (not final and self.CLOSE.startswith(text[after:])):
                    end = len(text)  # a call the output ends in (its closing tag not yet, or never, written)
                else:
                    raise Malformed
            except Malformed:
                close = text.find(self.CLOSE, start)
                if close < 0:
                    if not final:  # it may still close: hold it
                        return [*out, pending + text[pos:start]]
                    close = len(text) - len(self.CLOSE)
                pending += text[pos : close + len(self.CLOSE)]
                pos = close + len(self.CLOSE)
                continue
            out += [pending + text[pos:start], ToolCall(scan.name, scan.arguments)]
            pending, pos = "", end
        return [*out, pending + self.open_tail(text[pos:], final)]


class Llama3Json(ToolParser):
    """Llama 3.x: {"name": ..., "parameters": {...}} calls separated by ";", after the
    <|python_tag|> token or as the whole output. Text before the tag is content; JSON that
    is no call (a JSON answer) is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def pieces(self, text, final):
        tag = text.find(self.TAG)
        if tag >= 0:
            head, start = text[:tag], tag + len(self.TAG)
        else:
            first = skip_ws(text, 0)
            if first < len(text) and text[first] != "{":
                return [self.open_tail(text, final)]
            if first == len(text):  # whitespace so far
                return [text if final else ""]
            head, start = text[:first], first
        out: list[str | ToolCall] = [head]
        i = skip_ws(text, start)
        while i < len(text):
            try:
                scan = scan_call(text, i, ("parameters", "arguments"))
                if scan.end is None and final:
                    raise Malformed
            except Malformed:
                if len(out) == 1:  # no call at all: the whole output is text
                    return [self.open_tail(text, final)]
                return [*out, self.open_tail(text[i:], final)]
            if scan.end is None:
                return out + _shown([scan])
            out.append(ToolCall(scan.name, scan.arguments))
            after = skip_ws(text, scan.end)
            if after < len(text) and text[after] == ";":
                i = skip_ws(text, after + 1)
            elif after < len(text):  # text after the calls
                return [*out, self.open_tail(text[after:], final)]
            else:
                break
        return out


class Mistral(ToolParser):
    """Mistral, in either of its tokenizers' forms; text before the first call is content.

    Before v11 (Mistral 7B v0.3, Nemo): [TOOL_CALLS] then a JSON list of
    {"name": ..., "arguments": {...}}.
    v11 and later (Mistral Small 3.x, Magistral, Devstral): each call is
    [TOOL_CALLS]NAME[ARGS]{...}, and v11 may write the id it was shown in its prompts,
    [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...} (that id is dropped: a call gets a new one). As
    vLLM reads it, the name runs to the arguments' "{" ([ARGS] may be missing from text a
    detokenizer wrote without it), and once the arguments have begun it is a call even if
    they turn out no JSON (cut off, malformed): its arguments are then the text as written,
    up to the next [TOOL_CALLS], so that the model sees in its history what it tried.

    Call ids are 9 letters and digits, as Mistral's templates require."""

    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (TAG,)
    _NAME = re.compile(r"[\w.-]+")  # a function name: letters, digits, _ - and .
    _ID = re.compile(r"\w*")

    def new_call_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def pieces(self, text, final):
        out: list[str | ToolCall] = []
        pos = 0
        while (start := text.find(self.TAG, pos)) >= 0:
            body = skip_ws(text, start + len(self.TAG))
            try:
                if text.startswith("[", body):  # a JSON list: the form before v11
                    calls, end = self._call_list(text, body, final)
                else:
                    calls, end = self._named_call(text, body, final)
            except Malformed:
                return [*out, self.open_tail(text[pos:], final)]
            out += [text[pos:start], *calls]
            if end is None:
                return out
            pos = end
        return [*out, self.open_tail(text[pos:], final)]

    def _call_list(self, text: str, i: int, final: bool) -> tuple[list[ToolCall], int | None]:
        """The calls of the JSON list at text[i] and the index after it (None while it is
        incomplete); Malformed when it is no list of calls, or is cut off."""
        scans, end = scan_call_list(text, i, ("arguments",))
        if end is None and final:
            raise Malformed
        return _shown(scans), end

    def _named_call(self, text: str, i: int, final: bool) -> tuple[list[ToolCall], int | None]:
        """The v11 call NAME[ARGS]{...} at text[i] (no call while its name may still grow)
        and the index after it (None while it runs to the end of the text); Malformed when
        no arguments follow the name, or the text ends (final) before they begin."""
        head = self._call_head(text, i)
        if head is None:
            if final:
                raise Malformed
            return [], None
        name, args = head
        # a [TOOL_CALLS] starts the next call, whatever the arguments before it hold
        next_call = text.find(self.TAG, args)
        segment_end = len(text) if next_call < 0 else next_call
        try:
            end = value_end(text[:segment_end], args)
            json.loads(text[args:end])  # the escapes inside its strings too
            return [ToolCall(name, text[args:end])], end
        except (Incomplete, Malformed, json.JSONDecodeError):
            if next_call < 0 and not final:  # still being written (or a malformed tail)
                return [ToolCall(name, self.open_tail(text[args:], final))], None
            return [ToolCall(name, text[args:segment_end])], segment_end

    def _call_head(self, text: str, i: int) -> tuple[str, int] | None:
        """NAME, an optional [CALL_ID]ID and an optional [ARGS] at text[i], then whitespace:
        the name and where the arguments' "{" is; None while the text ends inside it."""
        name = self._NAME.match(text, i)
        if name is None:
            if i == len(text):
                return None
            raise Malformed
        j = name.end()
        for marker, value in ((self.CALL_ID, self._ID), (self.ARGS, None)):
            if text.startswith(marker, j):
                j += len(marker)
                if value is not None:
                    j = value.match(text, j).end()
            elif marker.startswith(text[j:]):  # the name, or the marker, may yet go on
                return None
        j = skip_ws(text, j)
        if j == len(text):
            return None
        if text[j] != "{":
            raise Malformed
        return name.group(), j


class OpenAIHarmony(ToolParser):
    """gpt-oss's harmony messages: [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
    [<|constrain|>json]<|message|>BODY, ended by <|end|>, <|call|> or <|return|>. The
    analysis channel is reasoning, a message to functions.NAME a call (its body the
    arguments), final (and commentary to no one, a preamble) content."""

    name = "openai"
    START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    markers = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    _RECIPIENT = re.compile(r"\bto=([^\s<]+)")

    def parse(self, text, final=True):
        parsed = Parsed()
        pos = 0
        while pos < len(text):
            header_end = text.find(self.MESSAGE, pos)
            if header_end < 0:  # a header still being written; at the end, stray text
                if final:
                    parsed.content += self.strip_special(text[pos:])
                break
            header = text[pos:header_end]
            body_start = header_end + len(self.MESSAGE)
            ends = [(at, end) for end in self.ENDS if (at := text.find(end, body_start)) >= 0]
            if ends:
                at, end = min(ends)
                body, pos = text[body_start:at], at + (0 if end == self.START else len(end))
            else:
                body, pos = self.open_tail(text[body_start:], final), len(text)
            channel = self._CHANNEL.search(header)
            recipient = self._RECIPIENT.search(header)
            if recipient:
                if recipient.group(1).startswith("functions."):
                    parsed.calls.append(ToolCall(recipient.group(1)[len("functions.") :], body))
                # other recipients are built-in tools (browser, python): not served here
            elif channel and channel.group(1) == "analysis":
                parsed.reasoning += self.strip_special(body)
            else:
                parsed.content += self.strip_special(body)
        return parsed


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Llama3Json, Hermes, Mistral, OpenAIHarmony)}


# The forced tool choices: the grammar makes the output the calls themselves


class NamedFunction(ToolParser):
    """tool_choice {"function": {"name": NAME}}: the whole output is NAME's arguments."""

    keeps_special_tokens = False

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def pieces(self, text, final):
        return [ToolCall(self.function, text)]


class RequiredCalls(ToolParser):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"} (the
    schema of tools.required_schema); one cut off (max_tokens) is left as content."""

    keeps_special_tokens = False

    def pieces(self, text, final):
        try:
            scans, end = scan_call_list(text, skip_ws(text, 0), ("parameters",))
            if final and (end is None or skip_ws(text, end) != len(text)):
                raise Malformed
        except Malformed:
            return [text if final else ""]
        return _shown(scans)


# Streaming ----------------------------------------------------------------------------------


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # the call's first delta: its id and name
    name: str | None = None


@dataclass
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class ToolCallStream:
    """One choice's stream: feed each new text; get what to send. max_calls: 1 when the
    request says parallel_tool_calls false (later calls are dropped, as vLLM drops them)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""
        self.sent_content = self.sent_reasoning = 0
        self.sent_args: list[int] = []  # per call sent: the characters of its arguments sent
        self.ids: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, new_text: str, final: bool) -> StreamDelta:
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        delta = StreamDelta(
            content=parsed.content[self.sent_content :], reasoning=parsed.reasoning[self.sent_reasoning :]
        )
        self.sent_content = max(self.sent_content, len(parsed.content))
        self.sent_reasoning = max(self.sent_reasoning, len(parsed.reasoning))
        for index, call in enumerate(parsed.calls[: self.max_calls]):
            if index == len(self.ids):
                self.ids.append(self.parser.new_call_id())
                self.sent_args.append(len(call.arguments))
                delta.calls.append(CallDelta(index, call.arguments, self.ids[index], call.name))
            elif len(call.arguments) > self.sent_args[index]:
                delta.calls.append(CallDelta(index, call.arguments[self.sent_args[index] :]))
                self.sent_args[index] = len(call.arguments)
        return delta


def parse_whole(parser: ToolParser, text: str, max_calls: int | None = None) -> tuple[Parsed, list[str]]:
    """A finished output's reading, and an id per call."""
    parsed = parser.parse(text, final=True)
    parsed.calls = parsed.calls[:max_calls]
    return parsed, [parser.new_call_id() for _ in parsed.calls]
