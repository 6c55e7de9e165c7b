"""What both generation endpoints share (vLLM's serving_engine): the server's state, errors in
OpenAI's shape, request validation, tokenization, sampling parameters and structured outputs,
and the one path from the engine's outputs to a response (streamed or whole) with its finish
reasons and usage. serving_completions and serving_chat build their choices on it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ringserve.errors import RequestError, RingserveError
from ringserve.outputs import RequestOutput, TokenLogprob
from ringserve.sampling_params import SamplingParams, StructuredOutputsParams
from ringserve.server import protocol as P
from ringserve.server.async_engine import AsyncEngine, EngineStoppedError, OverloadedError, RequestStream
from ringserve.server.metrics import Metrics
from ringserve.server.token_pieces import TokenPieces


class ApiError(Exception):
    """A refusal of the request: answered with this status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def status_of(e: BaseException) -> int:
    """The HTTP status of an engine error: the request's fault, the server's load, or a bug."""
    if isinstance(e, RequestError):
        return 400
    if isinstance(e, (OverloadedError, EngineStoppedError)):
        return 503
    return 500


class Server:
    """The state the routes and endpoints share: the engine loop, the names, the metrics, the
    token strings. engine: an LLMEngine or a function that builds one (on the engine thread:
    AsyncEngine)."""

    def __init__(self, engine, served_model_name: str | Sequence[str], max_waiting: int, on_fatal=None):
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

    @property
    def engine(self):
        """The engine, once built: requests are served only after the start-up built it."""
        return self.async_engine.engine

    @property
    def pieces(self) -> TokenPieces:
        """Each token's own bytes and text (made once the engine, and its tokenizer, are built)."""
        if self._pieces is None:
            self._pieces = TokenPieces(self.engine.tokenizer)
        return self._pieces


def finish_reason(out: RequestOutput, ended_in_calls: bool = False) -> str | None:
    """A choice's finish_reason: None until it ends; "tool_calls" when it stopped having
    made calls that the request left to the model (tool_choice auto or required), as vLLM; a
    named tool's call ends as the output did ("stop"), as OpenAI's does; a cut-off one "length"."""
    if not out.finished:
        return None
    if ended_in_calls and out.finish_reason == "stop":
        return "tool_calls"
    return out.finish_reason


class Generation:
    """One request's choices in the engine, and what its response carries besides them: the
    id, the creation time and the usage. Its outputs are read once, through outputs()."""

    def __init__(self, async_engine: AsyncEngine, stream: RequestStream, request_id: str, prompt_tokens: int):
        self.async_engine, self.stream, self.request_id = async_engine, stream, request_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they come; each choice's tokens count once it ends."""
        async for index, out in self.async_engine.results(self.stream):
            if out.finished:
                self.completion_tokens += len(out.token_ids)
            yield index, out

    def usage(self) -> P.Usage:
        return P.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


class OpenAIServing:
    """The base of an endpoint: validation and parameters, and respond(), which answers with
    the choices a subclass builds. response_type: the whole answer's model; chunk_type: a
    streamed event's (both have id, created, model, choices and usage)."""

    response_type: type[BaseModel]
    chunk_type: type[BaseModel]

    def __init__(self, server: Server):
        self.server = server

    @property
    def engine(self):
        return self.server.engine

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # Validation ------------------------------------------------------------------------

    def check_request(self, body: P.SamplingFields) -> None:
        if body.model is not None and body.model not in self.server.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model")
        if body.stream_options is not None and not body.stream:  # as vLLM
            raise ApiError(400, "stream_options can only be set when stream is true", "stream_options")

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        try:
            self.engine.input_processor.check_prompt(token_ids)
        except RequestError as e:
            raise ApiError(400, str(e), param) from None

    async def tokenize(self, prompts: list) -> list[list[int]]:
        """Each prompt's token ids (a text tokenized off the event loop, ids as given), checked
        against the model."""
        try:
            token_ids = await self.off_loop(
                lambda: [self.engine.input_processor.tokenize(p) for p in prompts]
            )
        except RequestError as e:
            raise ApiError(400, str(e), "prompt") from None
        for ids in token_ids:
            self.check_prompt(ids)
        return token_ids

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

    # Parameters ------------------------------------------------------------------------

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
        """The sampling parameters of the request's choice `index`, checked against the model."""
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

    # Generation ------------------------------------------------------------------------

    def submit(self, request_id: str, items, n: int, prompt_tokens: int) -> Generation:
        """items: (request id, token ids, params) per choice, n choices per prompt."""
        async_engine = self.server.async_engine
        try:
            stream = async_engine.submit(items, checked=True)  # each prompt and params checked above
        except RequestError as e:  # too many choices for the waiting queue
            raise ApiError(400, str(e), "n") from None
        except RingserveError as e:
            raise ApiError(status_of(e), str(e)) from None
        for _ in range(len(items) // n):  # as vLLM: once per prompt
            self.server.metrics.params_n.observe(n)
        return Generation(async_engine, stream, request_id, prompt_tokens)

    async def respond(
        self,
        body: P.SamplingFields,
        generation: Generation,
        request: Request,
        stream_choices: Callable[[], AsyncIterator],
        full_choice: Callable[[int, RequestOutput, list[TokenLogprob]], BaseModel],
    ) -> Response | BaseModel:
        """The answer, streamed or whole as the request asks. stream_choices: the
        subclass's stream generator, a choice per event (from generation.outputs());
        full_choice: a choice whole from its final output and all its logprobs."""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(generation, self._chunks(generation, stream_choices(), include_usage))
        finals = await self._collect(generation, request)
        if finals is None:
            return Response(status_code=499)
        choices = [full_choice(index, out, lps) for index, (out, lps) in sorted(finals.items())]
        return self._answer(self.response_type, generation, choices, generation.usage())

    def _answer(self, model: type[BaseModel], generation: Generation, choices: list, usage=None):
        return model(
            id=generation.request_id,
            created=generation.created,
            model=self.server.model_name,
            choices=choices,
            usage=usage,
        )

    async def _chunks(self, generation: Generation, choices: AsyncIterator, include_usage: bool):
        async for choice in choices:
            yield self._answer(self.chunk_type, generation, [choice]).model_dump_json()
        if include_usage:  # stream_options.include_usage: a last event with no choice
            yield self._answer(self.chunk_type, generation, [], generation.usage()).model_dump_json()

    async def _collect(self, generation: Generation, request: Request):
        """Every choice's final output and its logprobs, by index; None if the client left."""

        async def gather():
            finals: dict[int, tuple[RequestOutput, list[TokenLogprob]]] = {}
            lps: dict[int, list[TokenLogprob]] = {}
            async for index, out in generation.outputs():
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
                    raise ApiError(status_of(e), str(e)) from None
            return None  # the client went away: the finally aborts its requests
        finally:
            watcher.cancel()
            task.cancel()
            self.server.async_engine.abort(generation.stream)

    def _sse(self, generation: Generation, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def events():
            try:
                async for data in chunks:
                    yield f"data: {data}\n\n"
            except RingserveError as e:  # headers are out: the error goes in the stream, as vLLM
                yield f"data: {json.dumps(P.error_body(str(e), status_of(e)))}\n\n"
            finally:
                self.server.async_engine.abort(generation.stream)  # no-op unless the client left early
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


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
