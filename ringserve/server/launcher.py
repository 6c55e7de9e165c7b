"""`ringserve serve`'s process: the listening socket, uvicorn, and the exit codes; signals
start the Drain (drain.py) once serving, and a worker's death stops the server (vLLM's
launcher)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from ringserve.errors import ENGINE_START_ERRORS
from ringserve.server.api import build_app
from ringserve.server.async_engine import EngineStoppedError
from ringserve.server.drain import Drain

logger = logging.getLogger(__name__)

# Connections that wait to be accepted (uvicorn's default): those that come while the engine
# is built wait here, and are answered once it is.
LISTEN_BACKLOG = 2048


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
