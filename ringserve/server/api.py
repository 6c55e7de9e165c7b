"""The routes (vLLM's api_server): the FastAPI app with /v1/completions, /v1/chat/completions,
/v1/models, /health, /version and /metrics; its middleware (API key, body limit, the drain's
gate, access log); and the handlers that put every error in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import ringserve
from ringserve.errors import ENGINE_START_ERRORS, RingserveError
from ringserve.server import protocol as P
from ringserve.server.access_log import AccessLog
from ringserve.server.async_engine import EngineStoppedError
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

# Connections that wait to be accepted (uvicorn's default): those that come while the engine
# is built wait here, and are answered once it is.
LISTEN_BACKLOG = 2048


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
