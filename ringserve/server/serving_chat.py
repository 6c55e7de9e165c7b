"""POST /v1/chat/completions (vLLM's serving_chat): messages rendered by the chat template,
tools and tool_choice read back as calls (whole or as deltas), chat logprobs. Its stream and
full generators build the choices; OpenAIServing.respond sends them with finish reasons and usage."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ringserve.errors import RequestError
from ringserve.outputs import RequestOutput, TokenLogprob
from ringserve.server import protocol as P
from ringserve.server.logprobs import chat_logprobs
from ringserve.server.serving import ApiError, Generation, OpenAIServing, Server, finish_reason
from ringserve.server.tool_parsers import (
    PARSERS,
    ToolCallStream,
    ToolParser,
    parse_whole,
    special_token_strings,
)
from ringserve.server.tools import ToolPlan, ToolsError, plan_tools, template_messages


class ServingChat(OpenAIServing):
    """tool_call_parser, enable_auto_tool_choice: vLLM's flags: tool_choice "auto" reads the
    calls with that family's parser (tool_parsers.PARSERS); ValueError for an unknown one."""

    response_type = P.ChatCompletionResponse
    chunk_type = P.ChatCompletionChunk

    def __init__(
        self, server: Server, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False
    ):
        super().__init__(server)
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}; choose one of {', '.join(PARSERS)}"
            )
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of " + ", ".join(PARSERS) + ")"
            )
        self.tool_call_parser = tool_call_parser if enable_auto_tool_choice else None
        self._auto_parser: ToolParser | None = None

    @property
    def auto_parser(self) -> ToolParser | None:
        """The parser of tool_choice "auto" (made once the tokenizer, and so its special
        tokens, are there); None when the server was not started with one."""
        if self._auto_parser is None and self.tool_call_parser is not None:
            self._auto_parser = PARSERS[self.tool_call_parser](special_token_strings(self.engine.tokenizer))
        return self._auto_parser

    async def create(self, body: P.ChatCompletionRequest, request):
        self.check_request(body)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        try:
            tools = plan_tools(body, self.auto_parser)
            # name goes to the chat template too, which shows it as its authors chose (as vLLM)
            messages = template_messages(body.messages)
        except ToolsError as e:
            raise ApiError(400, str(e), e.param) from None

        try:
            _, token_ids = await self.off_loop(
                lambda: self.engine.input_processor.chat_prompt(messages, tools=tools.tools)
            )
        except RequestError as e:  # no template, or one that refuses these messages
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # a template that cannot render these messages
            raise ApiError(400, f"the chat template failed on these messages: {e}", "messages") from None
        self.check_prompt(token_ids, "messages")
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = self.max_tokens(requested, len(token_ids))
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        request_id = P.random_id("chatcmpl")
        structure = await self.structured_outputs(body, tools.schema)
        # a parser whose markers are special tokens sees them (it strips them from content)
        keep_special = tools.parser is not None and tools.parser.keeps_special_tokens
        items = [
            (
                f"{request_id}-{j}",
                token_ids,
                self.params(
                    body,
                    max_tokens,
                    num_top,
                    j,
                    structured_outputs=structure,
                    skip_special_tokens=False if keep_special else None,
                ),
            )
            for j in range(body.n)
        ]
        generation = self.submit(request_id, items, body.n, len(token_ids))
        return await self.respond(
            body,
            generation,
            request,
            lambda: self.stream_choices(body.n, generation, tools, num_top),
            lambda index, out, lps: self.full_choice(tools, num_top, index, out, lps),
        )

    async def stream_choices(
        self, n: int, generation: Generation, tools: ToolPlan, num_top: int | None
    ) -> AsyncIterator[P.ChatChunkChoice]:
        """Each choice's opening (the assistant role), then a delta per output: its text, or
        with a tool parser what the parser reads of it (content, reasoning, call fragments)."""
        for j in range(n):
            yield P.ChatChunkChoice(index=j, delta=P.Delta(role="assistant", content=""))
        readers = [ToolCallStream(tools.parser, tools.max_calls) if tools.parser else None for _ in range(n)]
        async for index, out in generation.outputs():
            delta, reader = P.Delta(content=out.new_text), readers[index]
            if reader is not None:
                delta = _tool_delta(reader.feed(out.new_text, out.finished))
                # what the parser holds back (a marker's start) comes later, or never
                if not (delta.content or delta.tool_calls or delta.reasoning_content):
                    if not out.finished and not out.new_logprobs:
                        continue
            yield P.ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=chat_logprobs(self.server.pieces, out.new_logprobs, num_top),
                finish_reason=finish_reason(
                    out, _left_to_model(tools) and reader is not None and reader.called
                ),
                stop_reason=out.stop_reason,
            )

    def full_choice(
        self, tools: ToolPlan, num_top: int | None, index: int, out: RequestOutput, lps: list[TokenLogprob]
    ) -> P.ChatChoice:
        """A choice whole: the message, its tool calls parsed out of the text when tools are on."""
        message, called = P.AssistantMessage(content=out.text), False
        if tools.parser is not None:
            parsed, ids = parse_whole(tools.parser, out.text, tools.max_calls)
            called = bool(parsed.calls)
            message = P.AssistantMessage(
                content=parsed.content or (None if called else ""),
                tool_calls=[
                    P.ToolCall(id=i, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                    for i, c in zip(ids, parsed.calls)
                ]
                or None,
                reasoning_content=parsed.reasoning or None,
            )
        return P.ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(self.server.pieces, lps, num_top),
            finish_reason=finish_reason(out, _left_to_model(tools) and called),
            stop_reason=out.stop_reason,
        )


def _left_to_model(tools: ToolPlan) -> bool:
    """Whether the request let the model decide to call (auto) or which to call (required):
    its calls then end as "tool_calls"; a named tool's call is what was asked, as OpenAI."""
    return tools.choice in ("auto", "required")


def _tool_delta(d) -> P.Delta:
    calls = [
        P.DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=P.DeltaFunction(name=c.name, arguments=c.arguments),
        )
        for c in d.calls
    ]
    return P.Delta(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)
