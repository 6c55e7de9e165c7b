"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health, /version and /metrics; errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import ringserve
from ringserve.errors import ENGINE_START_ERRORS, RequestError, RingserveError
from ringserve.outputs import RequestOutput, TokenLogprob
from ringserve.sampling_params import SamplingParams, StructuredOutputsParams
from ringserve.server import protocol as P
from ringserve.server.access_log import AccessLog
from ringserve.server.async_engine import AsyncEngine, EngineStoppedError, OverloadedError
from ringserve.server.metrics import Metrics
from ringserve.server.openapi import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    V1_RESPONSES,
    generation_responses,
    list_stream_chunks,
)
from ringserve.server.token_pieces import OffsetCounter, TokenPieces
from ringserve.server.tool_parsers import (
    PARSERS,
    ToolCallStream,
    ToolParser,
    parse_whole,
    special_token_strings,
)
from ringserve.server.tools import ToolPlan, ToolsError, plan_tools, template_messages

logger = logging.getLogger(__name__)

# The largest request body taken: far above any batch the engine can hold (64 prompts of
# 128K token ids, about 7 bytes each in JSON, are 58 MB), far below what would strain memory.
MAX_BODY_BYTES = 64 * 2**20

# Connections that wait to be accepted (uvicorn's default): those that come while the engine
# is built wait here, and are answered once it is.
LISTEN_BACKLOG = 2048


SHUTTING_DOWN = "the server is shutting down: it finishes the requests in flight and takes no new ones"

# What an undeclared request field is told (protocol._Body says why it is refused).
UNSUPPORTED_FIELD = "ringserve does not support this field (leave it out, or null)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def _status_of(e: BaseException) -> int:
    if isinstance(e, RequestError):
        return 400
    if isinstance(e, (OverloadedError, EngineStoppedError)):
        return 503
    return 500


class _ApiKey:
    """Pure ASGI middleware: /v1/* needs `Authorization: Bearer KEY` when a key is set."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if self.api_key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            # constant time: how long a wrong key took to refuse tells nothing of the right one
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode("latin-1", "replace")):
                response = _error_response(401, "invalid or missing API key (Authorization: Bearer KEY)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Pure ASGI middleware: a request body past `limit` bytes is a 413, refused as soon as
    its Content-Length (or, chunked, the bytes received so far) says so, never read whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        announced = length.isdigit()
        received = int(length) if announced else 0

        async def counted():
            nonlocal received
            if received <= self.limit:
                message = await receive()
                if message["type"] == "http.request" and not announced:
                    received += len(message.get("body", b""))
            if received > self.limit:
                # FastAPI lets an HTTPException from reading the body through to its handler
                raise StarletteHTTPException(
                    413, f"the request body is larger than the server takes ({self.limit} bytes)"
                )
            return message

        await self.app(scope, counted, send)


class Drain:
    """The shutdown on SIGTERM / Ctrl-C: the /v1 requests in flight are finished, new ones get a
    503, and the server exits once none is left, or once `timeout_s` has passed (None: no
    limit; a second signal ends the wait too), cutting what is left with an error in
    OpenAI's shape. The listening socket stays open meanwhile, so that a new request is told
    the server is going (503) rather than refused a connection."""

    # After the cut: how long the handlers get to write their error and end before uvicorn's
    # own shutdown cancels them (they need one event-loop turn; a client that does not read
    # could hold one back).
    CUT_GRACE_S = 5.0

    def __init__(self):
        self.draining = False
        self.signals = 0  # stop signals received (by the signal handler)
        self.active = 0  # /v1 requests being answered
        self._idle = asyncio.Event()
        self._idle.set()
        self._signalled_again = asyncio.Event()
        self._task: asyncio.Task | None = None

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def on_signal(self, async_engine: AsyncEngine, timeout_s: float | None, done: Callable[[], None]) -> None:
        """A stop signal (on the event loop): start the drain, or, during one, end its wait."""
        if self.draining:
            self._signalled_again.set()
            return
        self.draining = True
        limit = "no time limit" if timeout_s is None else f"at most {timeout_s:g} s"
        logger.warning(
            "shutting down: finishing %d request(s) in flight (%s; a second signal cuts them), "
            "new requests get 503",
            self.active,
            limit,
        )
        self._task = asyncio.ensure_future(self._run(async_engine, timeout_s, done))

    async def _run(
        self, async_engine: AsyncEngine, timeout_s: float | None, done: Callable[[], None]
    ) -> None:
        try:
            idle = asyncio.ensure_future(self._idle.wait())
            again = asyncio.ensure_future(self._signalled_again.wait())
            await asyncio.wait({idle, again}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
            again.cancel()
            if self.active:
                why = (
                    "a second stop signal"
                    if self._signalled_again.is_set()
                    else f"--shutdown-timeout {timeout_s:g} s passed"
                )
                logger.warning("shutting down: cutting %d request(s) in flight (%s)", self.active, why)
                async_engine.cut(f"the server shut down before the request finished ({why})")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), self.CUT_GRACE_S)
        finally:
            done()


class _DrainGate:
    """Pure ASGI middleware: counts the /v1 requests being answered (a stream until its last
    event) for the Drain, and answers new ones 503 once it has begun."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = _error_response(503, SHUTTING_DOWN)
            await response(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class _QuietStartupFailure:
    """Pure ASGI middleware: an engine that could not be built fails the start-up without
    Starlette's traceback in uvicorn's log; run_server says why (one line for a bad option or
    model, the traceback of a bug)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def quiet_send(message):
            if message["type"] == "lifespan.startup.failed" and self.server.async_engine.build_error:
                message = {"type": message["type"], "message": ""}
            await send(message)

        await self.app(scope, receive, quiet_send)


class Server:
    """The app's state: the engine loop, the names, the metrics, the token strings.
    engine: an LLMEngine or a function that builds one (on the engine thread: AsyncEngine)."""

    def __init__(
        self,
        engine,
        served_model_name: str | Sequence[str],
        max_waiting: int,
        on_fatal=None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
    ):
        # Several names (vLLM's --served-model-name a b): a request may name any, /v1/models
        # lists them all, and responses and metrics carry the first, as vLLM's do.
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        if not names:
            raise ValueError("at least one served model name is needed")
        self.model_names = names
        self.model_name = names[0]
        self.metrics = Metrics(self.model_name)
        self.async_engine = AsyncEngine(engine, max_waiting, self.metrics, on_fatal)
        self._pieces: TokenPieces | None = None
        # tool_choice "auto" reads calls with this family's parser (vLLM's two flags)
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
    def engine(self):
        """The engine, once built: requests are served only after the start-up built it."""
        return self.async_engine.engine

    # Helpers ---------------------------------------------------------------------------

    def check_request(self, body: P.SamplingFields) -> None:
        if body.model is not None and body.model not in self.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model")
        if body.stream_options is not None and not body.stream:  # as vLLM
            raise ApiError(400, "stream_options can only be set when stream is true", "stream_options")

    @property
    def pieces(self) -> TokenPieces:
        """Each token's own bytes and text (made once the engine, and its tokenizer, are built)."""
        if self._pieces is None:
            self._pieces = TokenPieces(self.engine.tokenizer)
        return self._pieces

    @property
    def auto_parser(self) -> ToolParser | None:
        """The parser of tool_choice "auto" (made once the tokenizer, and so its special
        tokens, are there); None when the server was not started with one."""
        if self._auto_parser is None and self.tool_call_parser is not None:
            self._auto_parser = PARSERS[self.tool_call_parser](special_token_strings(self.engine.tokenizer))
        return self._auto_parser

    def token_text(self, token_id: int) -> str:
        return self.pieces.text(token_id)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def structured_outputs(
        self, body: P.SamplingFields, tool_schema: dict | None = None
    ) -> StructuredOutputsParams | None:
        """What the request's output must follow, its grammar compiled (off the event loop:
        a large schema takes a while) and kept for when the request is added.
        tool_schema: what a forced tool_choice makes the output (the calls' JSON)."""
        asked = {}  # the field that asks -> StructuredOutputsParams' arguments
        if tool_schema is not None:
            asked["tool_choice"] = {"json": tool_schema}
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            asked["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked["response_format"] = {"json": rf.json_schema.schema_}
        if body.structured_outputs is not None:
            so = body.structured_outputs
            asked["structured_outputs"] = {
                "json": so.json_, "json_object": bool(so.json_object), "regex": so.regex,
                "choice": so.choice, "grammar": so.grammar, "disable_any_whitespace": so.disable_any_whitespace,
            }  # fmt: skip
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(body, field) is not None:
                asked[field] = {kind: getattr(body, field)}
        if body.guided_grammar is not None:
            asked["guided_grammar"] = {"grammar": body.guided_grammar}
        if not asked:
            return None
        if len(asked) > 1:
            raise ApiError(
                400, f"ask for one structured output at a time, not {', '.join(asked)}", next(iter(asked))
            )
        field, kwargs = next(iter(asked.items()))
        try:
            spec = StructuredOutputsParams(**kwargs)
            await self.off_loop(self.engine.grammar_compiler.check, spec)
        except RequestError as e:
            # the engine's messages name structured_outputs: name the field the request used
            # (a forced tool choice's schema comes from the tools' parameters)
            field = "tools" if field == "tool_choice" else field
            raise ApiError(400, re.sub(r"^structured_outputs", field, str(e)), field) from None
        return spec

    def params(
        self,
        body: P.SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        index: int,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        if body.best_of is not None and body.best_of != body.n:
            # vLLM's v1 engine refuses it too: n candidates ranked by likelihood are not drawn
            raise ApiError(
                400, f"best_of is not supported (leave it unset or equal to n, {body.n})", "best_of"
            )
        seed = body.seed
        if seed is not None and index:
            seed += index  # n > 1: each choice its own stream of random numbers, as vLLM
        try:
            # unset fields take the model's recommended defaults (generation_config.json), as vLLM
            params = self.engine.input_processor.default_params(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                seed=seed,
                stop=body.stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                min_tokens=body.min_tokens,
                logit_bias=_logit_bias(body.logit_bias),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=(
                    body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
                ),
                bad_words=list(body.bad_words or []),
                structured_outputs=structured_outputs,
            )
            self.engine.input_processor.check_params(params)  # against the model too (vocabulary, context)
        except RequestError as e:
            # the messages start with the field at fault ("stop_token_ids: token id ...")
            field = re.match(r"\w+", str(e))
            param = field.group() if field and field.group() in type(body).model_fields else None
            raise ApiError(400, str(e), param) from None
        return params

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.engine.max_model_len
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                "completion). Please reduce the prompt or the completion length.",
                "max_tokens",
            )
        return requested

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        try:
            self.engine.input_processor.check_prompt(token_ids)
        except RequestError as e:
            raise ApiError(400, str(e), param) from None

    # Completions -----------------------------------------------------------------------

    async def completions(self, body: P.CompletionRequest, request: Request):
        self.check_request(body)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        # echo with logprobs scores the prompt too (what eval harnesses send); vLLM's
        # prompt_logprobs asks for the same alone. The engine computes the larger top-N.
        asked = [body.prompt_logprobs, body.logprobs if body.echo else None]
        prompt_logprobs = max((k for k in asked if k is not None), default=None)
        if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
            raise ApiError(
                400, "max_tokens must be at least 1 (0 only with echo or prompt_logprobs)", "max_tokens"
            )
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "the prompt is empty", "prompt")
        try:
            token_ids = await self.off_loop(
                lambda: [self.engine.input_processor.tokenize(p) for p in prompts]
            )
        except RequestError as e:
            raise ApiError(400, str(e), "prompt") from None
        for ids in token_ids:
            self.check_prompt(ids)
        texts = [p if isinstance(p, str) else None for p in prompts]
        if body.echo:
            texts = await self.off_loop(
                lambda: [
                    t if t is not None else self.engine.tokenizer.decode(ids)
                    for t, ids in zip(texts, token_ids)
                ]
            )
        structure = await self.structured_outputs(body)
        n = body.n
        request_id = P.random_id("cmpl")
        created = int(time.time())
        num_prompt_tokens = sum(len(ids) for ids in token_ids)
        items = []
        for i, ids in enumerate(token_ids):
            max_tokens = self.max_tokens(body.max_tokens, len(ids))
            for j in range(n):
                params = self.params(body, max_tokens, body.logprobs, j, prompt_logprobs, structure)
                items.append((f"{request_id}-{i * n + j}", ids, params))
        stream = self.submit(items, n)
        echo = [texts[k // n] if body.echo else "" for k in range(len(items))]

        def first_extras(
            out: RequestOutput, index: int
        ) -> tuple[P.CompletionLogprobs | None, OffsetCounter, list | None]:
            """A choice's logprobs of its echoed prompt (legacy shape), the counter of its
            generated tokens' text offsets (they start after the echoed text), and vLLM's
            prompt_logprobs."""
            lp, skip = None, body.skip_special_tokens
            counter = self.pieces.counter(len(echo[index]), skip)
            if body.logprobs is not None:
                lp = P.CompletionLogprobs()
                if body.echo:
                    # the echoed text is the prompt as given: its tokens are placed in it
                    offsets = self.pieces.align(echo[index], out.prompt_token_ids)
                    self.add_logprobs(
                        lp, out.prompt_token_ids, out.prompt_logprobs, body.logprobs, iter(offsets)
                    )
            vllm = None
            if body.prompt_logprobs is not None:
                vllm = self.vllm_prompt_logprobs(
                    out.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs
                )
            return lp, counter, vllm

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def chunks() -> AsyncIterator[str]:
                started = [False] * len(items)
                counters: list[OffsetCounter | None] = [None] * len(items)  # each choice's text offsets
                completion_tokens = 0
                async for index, out in self.async_engine.results(stream):
                    completion_tokens += len(out.new_token_ids)
                    text, vllm = out.new_text, None
                    lp = P.CompletionLogprobs() if body.logprobs is not None else None
                    if not started[index]:
                        started[index] = True
                        text = echo[index] + text
                        lp, counters[index], vllm = first_extras(out, index)
                    if lp is not None:
                        self.add_logprobs(
                            lp, out.new_token_ids, out.new_logprobs, body.logprobs, counters[index]
                        )
                    choice = P.CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=lp,
                        finish_reason=out.finish_reason if out.finished else None,
                        stop_reason=out.stop_reason,
                        prompt_logprobs=vllm,
                    )
                    yield P.CompletionResponse(
                        id=request_id, created=created, model=self.model_name, choices=[choice]
                    ).model_dump_json()
                if include_usage:
                    usage = _usage(num_prompt_tokens, completion_tokens)
                    yield P.CompletionResponse(
                        id=request_id, created=created, model=self.model_name, choices=[], usage=usage
                    ).model_dump_json()

            return self.sse(stream, chunks())

        finals = await self.collect(stream, request)
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for index, (out, lps) in sorted(finals.items()):
            completion_tokens += len(out.token_ids)
            lp, counter, vllm = first_extras(out, index)
            if lp is not None:
                self.add_logprobs(lp, out.token_ids, lps, body.logprobs, counter)
            choices.append(
                P.CompletionChoice(
                    index=index,
                    text=echo[index] + out.text,
                    logprobs=lp,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=vllm,
                )
            )
        return P.CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage(num_prompt_tokens, completion_tokens),
        )

    def add_logprobs(
        self,
        lp: P.CompletionLogprobs,
        token_ids: list[int],
        logprobs: list[TokenLogprob | None] | None,
        num_top: int,
        offsets: OffsetCounter | Iterator[int],
    ) -> None:
        """Append tokens to a legacy completions logprobs object. offsets: the tokens' text
        offsets (characters of the choice's text before each, echoed prompt included), or
        the counter that makes them from the tokens. Each token is its own text, its
        word-initial space kept. top_logprobs holds the num_top likeliest and the chosen
        token (num_top + 1 entries when it is not among them), as vLLM. A None entry (the
        first prompt token) has no logprob and no top_logprobs."""
        for token_id, entry in zip(token_ids, logprobs or [None] * len(token_ids)):
            lp.tokens.append(self.token_text(token_id))
            lp.token_logprobs.append(None if entry is None else _finite(entry.logprob))
            top = None
            if entry is not None:
                top = {self.token_text(i): _finite(v) for i, v in _with_chosen(entry, num_top)}
            lp.top_logprobs.append(top)
            lp.text_offset.append(
                offsets.add(token_id) if isinstance(offsets, OffsetCounter) else next(offsets)
            )

    def vllm_prompt_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprob | None], num_top: int
    ) -> list[dict[int, P.PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: entry}
        for the prompt token and the num_top likeliest."""
        result = []
        for token_id, entry in zip(token_ids, logprobs):
            if entry is None:
                result.append(None)
                continue
            ranked = {
                i: P.PromptLogprob(logprob=v, rank=r + 1) for r, (i, v) in enumerate(entry.top[:num_top])
            }
            ranked.setdefault(token_id, P.PromptLogprob(logprob=entry.logprob, rank=entry.rank))
            for i, e in ranked.items():
                e.decoded_token = self.token_text(i)
            result.append(ranked)
        return result

    # Chat ------------------------------------------------------------------------------

    async def chat(self, body: P.ChatCompletionRequest, request: Request):
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
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request_id = P.random_id("chatcmpl")
        created = int(time.time())
        n = body.n
        structure = await self.structured_outputs(body, tools.schema)
        # a parser whose markers are special tokens sees them (it strips them from content)
        keep_special = tools.parser is not None and tools.parser.keeps_special_tokens
        stream = self.submit(
            [
                (
                    f"{request_id}-{j}",
                    token_ids,
                    self.params(
                        body,
                        max_tokens,
                        logprobs,
                        j,
                        structured_outputs=structure,
                        skip_special_tokens=False if keep_special else None,
                    ),
                )
                for j in range(n)
            ],
            n,
        )

        def logprobs_of(lps: list[TokenLogprob] | None) -> P.ChatLogprobs | None:
            if logprobs is None:
                return None
            pieces = self.pieces

            def entry(token_id: int, value: float) -> dict:
                # bytes: the token's own, so a character split over tokens is rebuilt
                # from its pieces (its text alone is U+FFFD)
                return dict(
                    token=pieces.text(token_id), logprob=_finite(value), bytes=list(pieces.bytes(token_id))
                )

            content = []
            for t in lps or []:
                # top_logprobs 0 lists none (as vLLM and OpenAI); otherwise N entries, the
                # chosen token first (vLLM's chat)
                top = [P.TopLogprob(**entry(i, v)) for i, v in _chosen_first(t, logprobs)] if logprobs else []
                content.append(P.ChatTokenLogprob(**entry(t.token_id, t.logprob), top_logprobs=top))
            return P.ChatLogprobs(content=content)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(choices, usage=None) -> str:
                return P.ChatCompletionChunk(
                    id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
                ).model_dump_json(exclude_none=False)

            async def chunks() -> AsyncIterator[str]:
                for j in range(n):
                    yield chunk([P.ChatChunkChoice(index=j, delta=P.Delta(role="assistant", content=""))])
                completion_tokens = 0
                readers = [
                    ToolCallStream(tools.parser, tools.max_calls) if tools.parser else None for _ in range(n)
                ]
                async for index, out in self.async_engine.results(stream):
                    completion_tokens += len(out.new_token_ids)
                    delta, reader = P.Delta(content=out.new_text), readers[index]
                    if reader is not None:
                        delta = _tool_delta(reader.feed(out.new_text, out.finished))
                        # what the parser holds back (a marker's start) comes later, or never
                        if not (delta.content or delta.tool_calls or delta.reasoning_content):
                            if not out.finished and not out.new_logprobs:
                                continue
                    choice = P.ChatChunkChoice(
                        index=index,
                        delta=delta,
                        logprobs=logprobs_of(out.new_logprobs),
                        finish_reason=(
                            _finish_reason(out.finish_reason, tools, reader is not None and reader.called)
                            if out.finished
                            else None
                        ),
                        stop_reason=out.stop_reason,
                    )
                    yield chunk([choice])
                if include_usage:
                    yield chunk([], _usage(len(token_ids), completion_tokens))

            return self.sse(stream, chunks())

        finals = await self.collect(stream, request)
        if finals is None:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for index, (out, lps) in sorted(finals.items()):
            completion_tokens += len(out.token_ids)
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
            choices.append(
                P.ChatChoice(
                    index=index,
                    message=message,
                    logprobs=logprobs_of(lps),
                    finish_reason=_finish_reason(out.finish_reason, tools, called),
                    stop_reason=out.stop_reason,
                )
            )
        return P.ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage(len(token_ids), completion_tokens),
        )

    # Plumbing --------------------------------------------------------------------------

    def submit(self, items, n: int = 1):
        """items: (request id, token ids, params) per choice, n choices per prompt."""
        try:
            stream = self.async_engine.submit(items)
        except RequestError as e:  # too many choices for the waiting queue
            raise ApiError(400, str(e), "n") from None
        except RingserveError as e:
            raise ApiError(_status_of(e), str(e)) from None
        for _ in range(len(items) // n):  # as vLLM: once per prompt
            self.metrics.params_n.observe(n)
        return stream

    async def collect(self, stream, request: Request):
        """Every request's final output and its logprobs, by index; None if the client left."""

        async def gather():
            finals: dict[int, tuple[RequestOutput, list[TokenLogprob]]] = {}
            lps: dict[int, list[TokenLogprob]] = {}
            async for index, out in self.async_engine.results(stream):
                lps.setdefault(index, []).extend(out.new_logprobs or [])
                if out.finished:
                    finals[index] = (out, lps[index])
            return finals

        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        task = asyncio.ensure_future(gather())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                try:
                    return task.result()
                except RingserveError as e:
                    raise ApiError(_status_of(e), str(e)) from None
            return None  # the client went away: the finally aborts its requests
        finally:
            watcher.cancel()
            task.cancel()
            self.async_engine.abort(stream)

    def sse(self, stream, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def events():
            try:
                async for data in chunks:
                    yield f"data: {data}\n\n"
            except RingserveError as e:  # headers are out: the error goes in the stream, as vLLM
                yield f"data: {json.dumps(P.error_body(str(e), _status_of(e)))}\n\n"
            finally:
                if stream is not None:
                    self.async_engine.abort(stream)  # no-op unless the client left early
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _finish_reason(reason: str | None, tools: ToolPlan, called: bool) -> str | None:
    """ "tool_calls" when the output ended as calls (auto, required), as vLLM; a named
    choice's call ends as the output did ("stop"), as OpenAI's does; a cut-off call "length"."""
    if called and reason == "stop" and tools.choice in ("auto", "required"):
        return "tool_calls"
    return reason


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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} -> {id: bias clamped to [-100, 100]}, as vLLM reads it."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0:
            raise ApiError(400, f"logit_bias: token ids are >= 0, got {token}", "logit_bias")
        out[token] = min(100.0, max(-100.0, value))
    return out


def _with_chosen(entry: TokenLogprob, num_top: int) -> list[tuple[int, float]]:
    """The num_top likeliest (token id, logprob), then the chosen token when it is not among
    them, as vLLM lists a position's top logprobs (num_top + 1 entries then)."""
    top = entry.top[:num_top]
    if all(i != entry.token_id for i, _ in top):
        top = [*top, (entry.token_id, entry.logprob)]
    return top


def _chosen_first(entry: TokenLogprob, num_top: int) -> list[tuple[int, float]]:
    """num_top (token id, logprob): the chosen token, then the likeliest others, as vLLM's
    chat lists a position's top logprobs (N entries, where completions list N + 1)."""
    others = [(i, v) for i, v in entry.top if i != entry.token_id]
    return [(entry.token_id, entry.logprob), *others][:num_top]


def _finite(logprob: float) -> float:
    """-inf (a token the model rules out) as -9999.0, OpenAI's value for it, as vLLM: JSON has no inf."""
    return max(logprob, -9999.0)


def _usage(prompt_tokens: int, completion_tokens: int) -> P.Usage:
    return P.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def build_app(
    engine,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    max_waiting: int = 1024,
    on_fatal: Callable[[BaseException], None] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    access_log: bool = False,
    stop_requested: Callable[[], bool] = lambda: False,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> FastAPI:
    """The app over an LLMEngine, or over a function that builds one: the engine thread
    calls it, and the start-up (the app's lifespan) ends once it is built, so uvicorn
    accepts connections only then. The engine loop starts and stops with the lifespan.
    access_log: one JSON line per request on the `ringserve.access` logger.
    stop_requested: polled while the engine is built; True (the server was asked to stop)
    fails the start-up without waiting for the build.
    tool_call_parser, enable_auto_tool_choice: vLLM's flags: tool_choice "auto" reads the
    calls with that family's parser (tool_parsers.PARSERS); ValueError for an unknown one."""
    server = Server(
        engine, served_model_name, max_waiting, on_fatal, tool_call_parser, enable_auto_tool_choice
    )
    drain = Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.async_engine.start()
        try:
            await server.async_engine.wait_built(stop_requested)
            yield
        finally:
            await server.async_engine.stop()

    app = FastAPI(title="ringserve", version=ringserve.__version__, lifespan=lifespan)
    app.state.server = server
    app.state.drain = drain
    app.add_middleware(_DrainGate, drain=drain)
    app.add_middleware(_ApiKey, api_key=api_key)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    if access_log:
        app.add_middleware(AccessLog)
    app.add_middleware(_QuietStartupFailure, server=server)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        message = e.message
        if e.param and e.param not in message:  # the message names the field at fault
            message = f"{e.param}: {message}"
        return _error_response(e.status, message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        if isinstance(e.body, (bytes, bytearray)):  # FastAPI parses JSON only when told it is
            media = request.headers.get("content-type") or "none"
            return _error_response(
                415, f"the body must be JSON, sent with Content-Type: application/json (got {media})"
            )
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            by_field: dict[str, str] = {}  # a union's alternatives all fail: name the field once
            for err in errors:
                where = [str(x) for x in err.get("loc", ()) if x != "body"]
                field = where[0] if where else "body"
                text = err.get("msg")
                if err.get("type") == "extra_forbidden":  # a field the models do not declare
                    field = ".".join(where)  # each one named, nested ones by their path
                    text = UNSUPPORTED_FIELD
                by_field.setdefault(field, f"{'.'.join(where) or 'body'}: {text}")
            message = "; ".join(by_field.values())
            param = next(iter(by_field))
        return _error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        # FastAPI's own refusals (an unknown route 404, a wrong method 405, a body that is
        # not UTF-8 400) in OpenAI's shape too, as vLLM
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(RingserveError)
    async def _ringserve_error(request, e: RingserveError):
        return _error_response(_status_of(e), str(e))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        logger.exception("internal error")
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.post(
        "/v1/completions",
        response_model=P.CompletionResponse,
        responses=generation_responses(P.CompletionResponse),
    )
    async def completions(body: P.CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=generation_responses(P.ChatCompletionChunk),
    )
    async def chat(body: P.ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    def card(name: str) -> P.ModelCard:
        engine = server.engine
        return P.ModelCard(id=name, root=engine.model_path, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=P.ModelList, responses=V1_RESPONSES)
    async def models():
        return P.ModelList(data=[card(name) for name in server.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard, responses=V1_RESPONSES)
    async def model(model_id: str):
        # :path: a name may hold slashes ("meta-llama/Llama-3.1-8B-Instruct", as vLLM serves by default)
        if model_id not in server.model_names:
            raise ApiError(404, f"The model `{model_id}` does not exist.", "model")
        return card(model_id)

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health():
        ae = server.async_engine
        if drain.draining:  # so that a load balancer sends its requests elsewhere
            return _error_response(503, SHUTTING_DOWN)
        if ae.healthy:
            return Response(status_code=200)
        reason = f"{type(ae.error).__name__}: {ae.error}" if ae.error else "the engine loop is not running"
        return _error_response(503, f"unhealthy: {reason}")

    @app.get("/version", response_model=P.VersionInfo)
    async def version():
        # the layout lets a benchmark result say what it measured (cp scaling, tp, ep)
        layout = server.engine.parallel
        parallel = P.ParallelLayout(tp=layout.tp, cp=layout.cp, ep=layout.ep, dp=layout.dp)
        return P.VersionInfo(version=ringserve.__version__, parallel=parallel)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    list_stream_chunks(app, [P.ChatCompletionChunk])
    return app


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: one the system picks); raises
    OSError, e.g. when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn reads a host
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn: a restarted server need not wait out the old one's closed connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def run_server(
    engine,
    served_model_name: str | Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 1024,
    log_level: str = "info",
    shutdown_timeout_s: float | None = None,
    access_log: bool = False,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> int:
    """Serve until SIGTERM / Ctrl-C (exit 0 once the requests in flight have ended, see
    Drain: None waits for them however long they take, a number of seconds cuts what is left
    then, 0 at once), or until a parallel worker dies (exit 1).

    engine: an LLMEngine, or a function that builds one. The port is bound first: a taken
    one fails at once (exit 2) before anything is built. The engine thread then calls the
    function, and connections wait in the listen backlog until the engine is built. A bad
    option or model found while building is one `error:` line and exit 2, as `start_llm`
    reports it; any other error is raised. A signal while it builds raises KeyboardInterrupt
    (the build itself cannot be interrupted: its thread is left to the process's exit)."""
    import uvicorn

    try:
        sock = listen(host, port)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2

    class _Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started:  # uvicorn says where it listens only on a socket it bound itself
                bound_host, bound_port = sockets[0].getsockname()[:2]
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", bound_host, bound_port
                )

        def handle_exit(self, sig, frame):
            # A signal once serving starts the drain (and a second one ends its wait); before
            # (the engine is being built) and after it (uvicorn's own shutdown), uvicorn's
            # handling: stop, and at a second Ctrl-C, stop without waiting.
            drain = app.state.drain
            drain.signals += 1
            if not self.started or self.should_exit or drain.signals > 2:
                super().handle_exit(sig, frame)
                return
            # a signal handler runs between any two bytecodes of the loop: hand over
            self.loop.call_soon_threadsafe(
                drain.on_signal, app.state.server.async_engine, shutdown_timeout_s, self.exit_now
            )

        def exit_now(self) -> None:
            self.should_exit = True

    holder = {}

    def on_fatal(error: BaseException) -> None:
        logger.error("a parallel worker failed; the server stops: %s", error)
        holder["server"].should_exit = True

    app = build_app(
        engine,
        served_model_name,
        api_key,
        max_waiting,
        on_fatal,
        access_log=access_log,
        stop_requested=lambda: holder["server"].should_exit,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )
    config = uvicorn.Config(
        app,
        log_level=log_level,
        backlog=LISTEN_BACKLOG,
        # a backstop only: the drain has ended every request before uvicorn shuts down
        timeout_graceful_shutdown=Drain.CUT_GRACE_S,
        access_log=False,  # ours, structured, when asked for
    )
    server = holder["server"] = _Server(config)
    async_engine = app.state.server.async_engine
    # uvicorn re-raises the signal that stopped it once it has shut down; handlers that do
    # nothing make that a clean exit 0 after the graceful shutdown.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit when the start-up failed: the build's error says why
        if async_engine.build_error is None:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    error = async_engine.build_error
    if isinstance(error, EngineStoppedError):  # a signal while the engine was built
        raise KeyboardInterrupt
    if isinstance(error, ENGINE_START_ERRORS):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if error is not None:
        raise error
    if async_engine.fatal:
        return 1
    if not server.started:
        return 2
    return 0
