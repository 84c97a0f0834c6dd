"""The async bridge: the engine's step loop in its own thread, one output stream per request.

The asyncio side never touches the engine. It hands commands (add, abort) to the engine thread
through a thread-safe queue and wakes it with an event; the thread drains the queue at the top
of every iteration, runs one step, and posts the step's outputs back to the event loop in one
`call_soon_threadsafe`. When nothing is running the thread sleeps on the event (no spinning).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from pagedserve.engine import EngineCounters, EngineStats, LLMEngine
from pagedserve.output_stream import RequestStream
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An engine step failed; every request that was in the engine at that moment gets this."""


class DuplicateRequestError(ValueError):
    """A request id that is already in flight."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str | None  # None: abort everything


class AsyncEngine:
    """Runs `LLMEngine.step()` in a dedicated thread and streams outputs to asyncio consumers."""

    def __init__(self, engine: LLMEngine, log_interval_seconds: float = 5.0):
        self.engine = engine
        self.log_interval = log_interval_seconds
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> its output queue; touched only on the event loop thread.
        self._streams: dict[str, asyncio.Queue] = {}
        # Snapshots published by the engine thread after every iteration (plain reads elsewhere).
        self._stats: EngineStats = engine.stats()
        self._counters = EngineCounters()
        self._last_log = _LogWindow.start(self._stats)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread; requests still streaming get an error."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._loop is not None and not self._loop.is_closed():
            err = EngineStepError("the engine was shut down")
            for q in self._streams.values():
                q.put_nowait(err)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the asyncio side ----------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        stream: RequestStream | None = None,
    ) -> AsyncIterator[RequestStream]:
        """Yield the request's `RequestStream` after every update: its `events` are what the
        update added (deltas that piled up while the consumer was busy, merged), its outputs
        the totals so far.

        Pass `stream` to choose its prompt ids for usage, its output processor or logprobs
        (default: the ids given, or none for a text prompt). Closing or cancelling the iterator
        before the last update aborts the request in the engine. A request id already in
        flight raises DuplicateRequestError here, at the call; engine errors (ValueError for a
        bad request) are raised by the iterator.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        if self._stopping or not self.is_running:
            raise EngineStepError("the engine loop is not running")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        if stream is None:
            ids = [] if isinstance(prompt, str) else list(prompt)
            stream = RequestStream(request_id, ids, params.n, logprobs=params.logprobs is not None)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._send(_Add(request_id, prompt, params, arrival))
        return self._updates(request_id, q, stream)

    async def _updates(
        self, request_id: str, q: asyncio.Queue, stream: RequestStream
    ) -> AsyncIterator[RequestStream]:
        try:
            while not stream.finished:
                deltas = [await q.get()]
                while not q.empty():
                    deltas.append(q.get_nowait())
                failure = next((d for d in deltas if isinstance(d, BaseException)), None)
                if failure is not None:
                    stream.finished = True  # the engine no longer holds it
                    raise failure
                stream.update(deltas)
                yield stream
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe). Its pages are freed at the top of the next step."""
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        self._send(_Abort(None))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last iteration (safe to read from any thread)."""
        return self._stats

    @property
    def counters(self) -> EngineCounters:
        return self._counters

    def _send(self, cmd: _Add | _Abort) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _dispatch(self, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _post(self, request_id: str, item: object) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(item)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.clear()
            self._handle_commands()
            if not engine.has_unfinished_requests():
                self._publish()
                self._maybe_log(busy=False)
                self._wake.wait(self._idle_timeout())
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - every failure must reach the waiters
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(e)
                continue
            self._publish()
            if outputs:
                self._to_loop(self._dispatch, outputs)
            elif self._stats.num_running == 0:
                # Nothing could be scheduled: wait for a command rather than spin.
                self._wake.wait(0.01)
            self._maybe_log(busy=True)

    def _handle_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time)
                except Exception as e:  # noqa: BLE001 - handed to the request's consumer
                    self._to_loop(self._post, cmd.request_id, e)
            else:
                ids = [cmd.request_id] if cmd.request_id is not None else list(engine.requests)
                for rid in ids:
                    last = engine.abort_request(rid)
                    if last is not None:
                        self._to_loop(self._post, rid, last)

    def _fail_all(self, exc: Exception) -> None:
        engine = self.engine
        ids = list(engine.requests)
        for rid in ids:
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s after a failed step also failed", rid)
                engine.requests.pop(rid, None)
        err = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        for rid in ids:
            self._to_loop(self._post, rid, err)
        self._publish()

    def _publish(self) -> None:
        self._stats = self.engine.stats()
        c = self.engine.counters
        self._counters = EngineCounters(
            c.prompt_tokens, c.generation_tokens, dict(c.finished_by_reason)
        )

    def _idle_timeout(self) -> float | None:
        # Idle: sleep until woken, except for one last log line covering recent activity.
        if self._last_log.saw_activity(self._stats):
            return max(0.0, self._last_log.time + self.log_interval - time.monotonic())
        return None

    def _maybe_log(self, busy: bool) -> None:
        now = time.monotonic()
        window = self._last_log
        if now - window.time < self.log_interval:
            return
        if not busy and not window.saw_activity(self._stats):
            return
        logger.info(window.line(self._stats, now))
        self._last_log = _LogWindow.start(self._stats, now)


@dataclass
class _LogWindow:
    """Counter values at the start of a logging interval."""

    time: float
    stats: EngineStats

    @classmethod
    def start(cls, stats: EngineStats, now: float | None = None) -> _LogWindow:
        return cls(now if now is not None else time.monotonic(), replace(stats))

    def saw_activity(self, stats: EngineStats) -> bool:
        return (
            stats.prompt_tokens != self.stats.prompt_tokens
            or stats.generation_tokens != self.stats.generation_tokens
            or stats.num_running
            or stats.num_waiting
        )

    def line(self, s: EngineStats, now: float) -> str:
        dt = max(now - self.time, 1e-9)
        queries = s.prefix_cache_queries - self.stats.prefix_cache_queries
        hits = s.prefix_cache_hits - self.stats.prefix_cache_hits
        return (
            f"Avg prompt throughput: {(s.prompt_tokens - self.stats.prompt_tokens) / dt:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(s.generation_tokens - self.stats.generation_tokens) / dt:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_usage:.1f}% ({s.kv_slots_filled}/{s.kv_tokens_total} "
            f"tokens, {100 * s.kv_waste:.1f}% of held slots unfilled), "
            f"Preemptions: {s.num_preemptions}, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
