"""The routes (vLLM's api_server): the FastAPI app with /v1/completions, /v1/chat/completions,
/v1/models, /health, /version and /metrics; its middleware (API key, body limit, the drain's
gate, access log); and the handlers that put every error in OpenAI's shape."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import ringserve
from ringserve.errors import RingserveError
from ringserve.server import protocol as P
from ringserve.server.access_log import AccessLog
from ringserve.server.drain import SHUTTING_DOWN, Drain, DrainGate
from ringserve.server.openapi import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    V1_RESPONSES,
    generation_responses,
    list_stream_chunks,
)
from ringserve.server.serving import ApiError, Server, error_response, status_of
from ringserve.server.serving_chat import ServingChat
from ringserve.server.serving_completions import ServingCompletions

logger = logging.getLogger(__name__)

# The largest request body taken: far above any batch the engine can hold (64 prompts of
# 128K token ids, about 7 bytes each in JSON, are 58 MB), far below what would strain memory.
MAX_BODY_BYTES = 64 * 2**20

# What an undeclared request field is told (protocol._Body says why it is refused).
UNSUPPORTED_FIELD = "ringserve does not support this field (leave it out, or null)"


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
                response = error_response(401, "invalid or missing API key (Authorization: Bearer KEY)")
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
    server = Server(engine, served_model_name, max_waiting, on_fatal)
    serving_completions = ServingCompletions(server)
    serving_chat = ServingChat(server, tool_call_parser, enable_auto_tool_choice)
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
    app.add_middleware(DrainGate, drain=drain)
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
        return error_response(e.status, message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        if isinstance(e.body, (bytes, bytearray)):  # FastAPI parses JSON only when told it is
            media = request.headers.get("content-type") or "none"
            return error_response(
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
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        # FastAPI's own refusals (an unknown route 404, a wrong method 405, a body that is
        # not UTF-8 400) in OpenAI's shape too, as vLLM
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RingserveError)
    async def _ringserve_error(request, e: RingserveError):
        return error_response(status_of(e), str(e))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.post(
        "/v1/completions",
        response_model=P.CompletionResponse,
        responses=generation_responses(P.CompletionResponse),
    )
    async def completions(body: P.CompletionRequest, request: Request):
        return await serving_completions.create(body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=generation_responses(P.ChatCompletionChunk),
    )
    async def chat(body: P.ChatCompletionRequest, request: Request):
        return await serving_chat.create(body, request)

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
            return error_response(503, SHUTTING_DOWN)
        if ae.healthy:
            return Response(status_code=200)
        reason = f"{type(ae.error).__name__}: {ae.error}" if ae.error else "the engine loop is not running"
        return error_response(503, f"unhealthy: {reason}")

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
