"""The graceful shutdown on SIGTERM / Ctrl-C: Drain finishes the /v1 requests in flight and
cuts what is left after a time limit; DrainGate is the middleware that counts them and
answers new ones 503 once the drain has begun."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ringserve.server.async_engine import AsyncEngine
from ringserve.server.serving import error_response

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down: it finishes the requests in flight and takes no new ones"


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


class DrainGate:
    """Pure ASGI middleware: counts the /v1 requests being answered (a stream until its last
    event) for the Drain, and answers new ones 503 once it has begun."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = error_response(503, SHUTTING_DOWN)
            await response(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
