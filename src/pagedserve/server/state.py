"""What every front end shares, one per server: the engine's loading and readiness, the API
key, admission (the in-flight limit) and draining. HTTP and gRPC both go through it, so they
refuse, admit and drain requests the same way."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable

from pagedserve.async_engine import AsyncEngine
from pagedserve.engine import LLMEngine
from pagedserve.models.loader import use_one_malloc_arena
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


class Slot:
    """One admitted request's place in the concurrency limit; release() is idempotent."""

    def __init__(self, release: Callable[[], None]):
        self._release = release
        self._held = True
        self.handed_off = False  # True once a streaming response owns it

    def release(self) -> None:
        if self._held:
            self._held = False
            self._release()


class ServerState:
    """Everything the front ends share (no module globals)."""

    def __init__(self, config: ServerConfig, load_engine: Callable[[], LLMEngine]):
        self.config = config
        self.load_engine = load_engine
        self.async_engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: BaseException | None = None
        self.engine_error: str | None = None  # why the engine can run no more steps
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())
        self.metrics = ServerMetrics(
            lambda: self.async_engine.stats() if self.async_engine is not None else None
        )
        # Set by run_server: asks uvicorn to stop (used when the model fails to load).
        self.request_exit: Callable[[], None] = lambda: None

    # ---- engine loading (in a thread, so /health answers meanwhile) ----------------------
    def start_loading(self) -> None:
        loop = self.loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = self.load_engine()
            except BaseException as e:  # noqa: BLE001 - reported on the loop, then exit
                loop.call_soon_threadsafe(self._load_failed, e)
                return
            loop.call_soon_threadsafe(self._loaded, engine)

        use_one_malloc_arena()
        threading.Thread(target=load, name="pagedserve-load", daemon=True).start()

    def _loaded(self, engine: LLMEngine) -> None:
        cfg = self.config
        self.async_engine = AsyncEngine(engine, cfg.log_interval_seconds)
        self.async_engine.start(self.loop)
        self._watchdog = asyncio.ensure_future(self._watch_engine(engine))
        name = cfg.served_model_name or engine.model_name
        self.serving = OpenAIServing(self.async_engine, name, self.metrics)
        s = engine.stats()
        page = engine.block_manager.page_size
        logger.info(
            "Serving %s as '%s' (%s on %s), KV cache %d pages x %d tokens = %d tokens, "
            "max model len %d, on http://%s:%d",
            engine.model_name,
            name,
            str(engine.dtype).removeprefix("torch."),
            engine.device,
            s.kv_pages_total,
            page,
            s.kv_pages_total * page,
            engine.max_model_len,
            cfg.host,
            cfg.port,
        )

    async def _watch_engine(self, engine: LLMEngine) -> None:
        """Exit (status 1) once the engine can run no more steps: a tensor-parallel rank died."""
        while (reason := engine.dead_reason()) is None:
            await asyncio.sleep(0.5)
        logger.error("the engine is dead (%s): exiting", reason)
        self.engine_error = reason
        self.request_exit()

    def _load_failed(self, e: BaseException) -> None:
        logger.error("model failed to load: %s: %s", type(e).__name__, e)
        self.load_error = e
        self.request_exit()

    # ---- the checks every request passes -------------------------------------------------
    def authorized(self, authorization: str) -> bool:
        """Whether an Authorization value ('Bearer KEY') carries the API key (or none is set)."""
        key = self.config.api_key
        if key is None:
            return True
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()
        )

    def ready(self) -> OpenAIServing:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        if self.engine_error is not None:
            raise APIError(503, f"the engine is dead: {self.engine_error}", code="engine_dead")
        if self.serving is None:
            msg = "the model failed to load" if self.load_error else "the model is still loading"
            raise APIError(503, msg, code="model_loading", headers={"Retry-After": "5"})
        return self.serving

    @property
    def serving_now(self) -> bool:
        """Ready for requests and the engine loop alive (what health checks report)."""
        return (
            self.serving is not None
            and not self.draining
            and self.engine_error is None
            and self.async_engine is not None
            and self.async_engine.is_running
        )

    def admit(self, protocol: str) -> Slot:
        if self.in_flight >= self.config.max_concurrent_requests:
            self.metrics.rejected.labels(protocol, "concurrency").inc()
            raise APIError(
                429,
                f"too many requests in flight (limit {self.config.max_concurrent_requests}); "
                "retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        gauge = self.metrics.in_flight.labels(protocol)
        gauge.inc()

        def release() -> None:
            self.in_flight -= 1
            gauge.dec()

        return Slot(release)

    # ---- SIGTERM -------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, let in-flight requests finish within the grace period, abort the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        grace = self.config.shutdown_grace_seconds
        logger.info(
            "shutting down: refusing new requests, %d in flight, grace %.0f s",
            self.in_flight,
            grace,
        )
        deadline = loop.time() + grace
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight and self.async_engine is not None:
            logger.warning("grace period over: aborting %d requests in flight", self.in_flight)
            self.async_engine.abort_all()
            deadline = loop.time() + 5.0
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        """Stop the engine loop and the tensor-parallel workers, if any."""
        if self.async_engine is not None:
            self.async_engine.shutdown()
            self.async_engine.engine.shutdown()
