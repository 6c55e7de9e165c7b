"""The engine loop: one thread owns the LLMEngine and drives step(); asyncio handlers talk to it.

That thread also builds the engine (loading, warm-up): every torch op of the engine runs on
it. PyTorch's CPU ops use OpenMP, whose thread pool belongs to the thread that first used
it: once another thread (the main one) has run torch ops, the same ops on the engine thread
measured 2-8x slower on a 2-core CPU (an engine step 16-19 ms instead of 7-10 ms).

Commands (add, abort, stop) enter through a thread-safe queue; the loop blocks on it when
no request is unfinished. Each step's outputs go back to the event loop in one
call_soon_threadsafe, which routes them to the per-request asyncio queues. Everything
about request routing lives on the event-loop thread; everything about the engine lives
on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ringserve.errors import RequestError, RequestFailedError, RequestTooLargeError, RingserveError
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams
from ringserve.server.metrics import Metrics

logger = logging.getLogger(__name__)

_IDLE_HEALTH_CHECK_S = 0.5  # how often an idle engine loop checks that every rank is alive


class EngineDeadError(RingserveError):
    """The engine loop stopped on an error: the request cannot be served (HTTP 500)."""


class EngineStoppedError(RingserveError):
    """The server is shutting down (HTTP 503)."""


class OverloadedError(RingserveError):
    """Too many requests are waiting (HTTP 503)."""


@dataclass
class RequestStream:
    """The outputs of one HTTP request's engine requests (prompts x n), by index."""

    request_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[int] = field(default_factory=set)


@dataclass
class _Route:  # event-loop side
    stream: RequestStream
    index: int
    waiting: bool = True  # no output yet


@dataclass
class _Timing:  # engine-thread side, for the metrics
    arrival: float
    num_prompt_tokens: int
    scheduled: bool = False
    scheduled_at: float | None = None  # the start of its first step: its prefill starts
    first_token: float | None = None
    last_token: float | None = None
    replica: int = 0  # the data-parallel replica serving it (the metrics' engine label)


class AsyncEngine:
    """engine: an LLMEngine, or a function without arguments that builds one; the engine
    thread calls it (see the module's doc), and `wait_built` waits for it."""

    def __init__(
        self,
        engine,
        max_waiting: int = 1024,
        metrics: Metrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        if callable(engine):
            self.build_engine, self.engine = engine, None
        else:  # already built: a factory that hands it over
            self.build_engine, self.engine = (lambda: engine), engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.on_fatal = on_fatal  # called on the event loop when a WorkerError ends the engine
        self.commands: queue.Queue = queue.Queue()
        self.routes: dict[str, _Route] = {}
        self.num_waiting = 0  # submitted, no output yet (event-loop side)
        self.error: BaseException | None = None
        self.build_error: BaseException | None = None  # why the engine was never built
        self.fatal = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._built: asyncio.Future | None = None  # done once the engine thread built it
        self.thread: threading.Thread | None = None
        self._stopping = False
        # Engine counters already added to the metrics (preemptions per replica).
        self._seen_preemptions: dict[int, int] = {}
        self._seen_computed = 0  # the engine's computed tokens already observed per step
        self._seen_cp: dict[str, int] = {}
        self._seen_spec: dict = {}  # speculative decoding's counts already added

    # Event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread: it builds the engine, then serves the commands."""
        self.loop = asyncio.get_running_loop()
        self._built = self.loop.create_future()
        self.thread = threading.Thread(target=self._run, name="ringserve-engine", daemon=True)
        self.thread.start()

    async def wait_built(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """Until the engine is built; raises what building it raised, or EngineStoppedError
        once give_up() (polled: the server was asked to stop meanwhile) says so."""
        while not self._built.done():
            if give_up():
                self.build_error = EngineStoppedError("the server stopped before the engine was built")
                raise self.build_error
            await asyncio.wait({self._built}, timeout=0.1)
        self._built.result()

    async def stop(self) -> None:
        """Abort what is left, close the engine, end the thread."""
        self._stopping = True
        if self.thread is not None and self.thread.is_alive():
            self.commands.put(("stop",))  # a thread still building closes the engine once built
            if self.engine is not None:  # a build cannot be interrupted: not waited for
                await asyncio.get_running_loop().run_in_executor(None, self.thread.join)
        elif self.engine is not None:
            self.engine.close()
        for route in list(self.routes.values()):
            route.stream.queue.put_nowait(EngineStoppedError("the server is shutting down"))
        self.routes.clear()

    def cut(self, message: str) -> None:
        """End every request in flight with EngineStoppedError(message) (a 503 error body, or
        an error event in a stream) and take no new one: the shutdown's deadline has come."""
        self._stopping = True
        for rid in list(self.routes):
            self._fail(rid, EngineStoppedError(message))
            self.commands.put(("abort", rid))  # its KV blocks are freed; the engine stops next

    @property
    def healthy(self) -> bool:
        return self.error is None and self.thread is not None and self.thread.is_alive()

    def check_available(self, num_requests: int) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped on an error: {_describe(self.error)}")
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if num_requests > self.max_waiting:  # never admitted, however long the client waits
            raise RequestError(
                f"the request asks for {num_requests} completions (prompts x n), more than the "
                f"server lets wait at once (--max-waiting {self.max_waiting})"
            )
        if self.num_waiting + num_requests > self.max_waiting:
            raise OverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(--max-waiting {self.max_waiting}); retry later"
            )

    def submit(
        self, items: list[tuple[str, list[int], SamplingParams]], checked: bool = False
    ) -> RequestStream:
        """Queue engine requests (request id, prompt token ids, params); outputs come by index.
        checked: the input processor's checks ran on them already (not again on the engine thread)."""
        self.check_available(len(items))
        stream = RequestStream([rid for rid, _, _ in items], unfinished=set(range(len(items))))
        now = time.monotonic()
        for index, (rid, token_ids, params) in enumerate(items):
            self.routes[rid] = _Route(stream, index)
            self.commands.put(("add", rid, token_ids, params, now, checked))
        self.num_waiting += len(items)
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (the client went away): frees their blocks."""
        for index in list(stream.unfinished):
            rid = stream.request_ids[index]
            if self._drop(rid):
                self.commands.put(("abort", rid))
        stream.unfinished.clear()

    async def results(self, stream: RequestStream) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) as they come, until every request of the stream finished."""
        while stream.unfinished:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            if out.finished:
                stream.unfinished.discard(index)
            yield index, out

    def _drop(self, rid: str) -> bool:
        route = self.routes.pop(rid, None)
        if route is None:
            return False
        if route.waiting:
            self.num_waiting -= 1
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue  # aborted meanwhile
            if out.error is not None:  # it failed alone inside a step: a 500 (400) for it alone
                error = RequestError if out.request_at_fault else RequestFailedError
                self._fail(out.request_id, error(f"the request failed: {out.error}"))
                continue
            if route.waiting:
                route.waiting = False
                self.num_waiting -= 1
            if out.finished:
                self.routes.pop(out.request_id, None)
            route.stream.queue.put_nowait((route.index, out))

    def _fail(self, rid: str, error: BaseException) -> None:
        route = self.routes.get(rid)
        if route is not None:
            self._drop(rid)
            route.stream.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self.routes):
            self._fail(rid, error)

    def _build_done(self, error: BaseException | None) -> None:
        if error is not None:
            self.error = self.build_error = error
        if self._built.done():  # given up on meanwhile
            return
        if error is None:
            self._built.set_result(None)
        else:
            self._built.set_exception(error)

    def _died(self, error: BaseException) -> None:
        self.error = error
        self._fail_all(EngineDeadError(f"the engine stopped on an error: {_describe(error)}"))
        from ringserve.engine.executor import WorkerError

        if isinstance(error, WorkerError):
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal(error)

    # Engine-thread side ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self.build_engine()
        except BaseException as e:  # noqa: B036 - whatever it was, start-up reports it
            self._call(self._build_done, e)
            return
        self.engine = engine
        if self.metrics is not None and getattr(engine, "max_model_len", None):
            self.metrics.set_max_model_len(engine.max_model_len)
        if self.metrics is not None and getattr(engine, "block_manager", None) is not None:
            self.metrics.set_cache_config(
                engine.block_manager.num_blocks, engine.block_manager.block_size, engine.kv_cache_dtype
            )
        self._call(self._build_done, None)
        timings: dict[str, _Timing] = {}
        try:
            while True:
                commands = []
                if not engine.has_unfinished():
                    self._update_gauges(timings)
                    commands.append(self._next_command())  # idle: sleep until a command
                while True:
                    try:
                        commands.append(self.commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if cmd[0] == "stop":
                        return
                    if cmd[0] == "add":
                        _, rid, token_ids, params, arrival, checked = cmd
                        try:
                            engine.add_request(
                                token_ids, params, rid, prompt_token_ids=token_ids, checked=checked
                            )
                        except RequestError as e:
                            self._call(self._fail, rid, e)
                            continue
                        timings[rid] = _Timing(arrival, len(token_ids))
                    elif cmd[0] == "abort":
                        engine.abort(cmd[1])
                        timings.pop(cmd[1], None)
                if not engine.has_unfinished():
                    continue
                start = time.monotonic()
                try:
                    outputs = engine.step()
                except RequestTooLargeError as e:  # that request alone
                    timings.pop(e.request_id, None)
                    self._call(self._fail, e.request_id, e)
                    continue
                self._record(outputs, timings, start)
                if outputs:
                    self._call(self._deliver, outputs)
        except BaseException as e:  # noqa: B036 - the loop must report whatever ended it
            logger.exception("the engine loop stopped on an error")
            self._call(self._died, e)
        finally:
            try:
                if self.error is None:
                    engine.close()
            except Exception:
                logger.exception("closing the engine failed")

    def _next_command(self):
        """Block until a command comes, checking the ranks meanwhile: one that dies while the
        server idles fails /health (and stops the server) now, not at the next request."""
        while True:
            try:
                return self.commands.get(timeout=_IDLE_HEALTH_CHECK_S)
            except queue.Empty:
                self.engine.check_health()

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _record(self, outputs: list[RequestOutput], timings: dict[str, _Timing], start: float) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        engine = self.engine
        # the tokens this step computed (prompt chunks and one per decoding sequence)
        total = getattr(engine, "num_computed_tokens", 0)  # a test's stand-in engine may not count
        computed, self._seen_computed = total - self._seen_computed, total
        if computed > 0:
            m.iteration_tokens.observe(computed)
        for rid, t in timings.items():  # first step that computed any of it: its queue time ends
            if not t.scheduled:
                seq = engine.seqs.get(rid)
                if seq is None or seq.num_computed_tokens > 0 or seq.output_token_ids:
                    t.scheduled, t.scheduled_at = True, start
                    t.replica = seq.replica if seq is not None else 0
                    m.queue_time.observe(max(0.0, start - t.arrival))
        for out in outputs:
            t = timings.get(out.request_id)
            if t is None:
                continue
            m.generation_tokens.inc(len(out.new_token_ids))
            if t.last_token is None:
                t.first_token = now
                m.ttft.observe(now - t.arrival)
                m.prompt_tokens.inc(t.num_prompt_tokens)
                m.prefix_queries.inc(t.num_prompt_tokens)
                m.prefix_hits.inc(out.num_cached_tokens)
            else:
                m.itl.observe(now - t.last_token)
            t.last_token = now
            if out.finished:
                m.e2e.observe(now - t.arrival)
                # as vLLM: prefill from the first step to the first token, decode from
                # there to the last (none for a request that made no token)
                first = t.first_token
                m.finished(
                    t.replica,
                    out.finish_reason or "stop",
                    t.num_prompt_tokens,
                    len(out.token_ids),
                    None if first is None or t.scheduled_at is None else max(0.0, first - t.scheduled_at),
                    None if first is None else now - first,
                )
                timings.pop(out.request_id, None)
        self._update_gauges(timings)

    def _update_gauges(self, timings) -> None:
        m = self.metrics
        if m is None:
            return
        engine = self.engine
        for replica, sched in enumerate(engine.replicas):  # one scheduler per data-parallel replica
            m.running(replica).set(len(sched.running))
            m.waiting(replica).set(len(sched.waiting))
            bm = sched.block_manager
            m.kv_usage(replica).set(1.0 - bm.num_free_blocks / bm.num_blocks if bm.num_blocks else 0.0)
            preempted = sched.num_preemptions - self._seen_preemptions.get(replica, 0)
            m.preemptions(replica).inc(preempted)  # also shows a replica's count while 0
            self._seen_preemptions[replica] = sched.num_preemptions
        for algo, n in engine.cp_steps.items():
            seen = self._seen_cp.get(algo, 0)
            if n > seen:
                m.cp_steps(algo).inc(n - seen)
                self._seen_cp[algo] = n
        if engine.drafter is not None:
            self._add_spec_decode_counts(engine.spec_stats)

    def _add_spec_decode_counts(self, stats) -> None:
        """The engine's speculative-decoding counts since the last step, onto the counters."""
        seen = self._seen_spec
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total = getattr(stats, name)
            self.metrics.spec_decode(name).inc(total - seen.get(name, 0))
            seen[name] = total
        for position, total in enumerate(stats.accepted_per_position):
            key = ("position", position)
            self.metrics.spec_decode_accepted_at(position).inc(total - seen.get(key, 0))
            seen[key] = total


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
