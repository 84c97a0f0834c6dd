"""One engine replica: the plain server's FastAPI app (`create_app`, the same routes, state,
admission and metrics) with its own engine, driven in process by requests that the front door
relays. Ray calls `check_health` (the engine's own health), `__del__` on shutdown, and the
replica pushes its metrics to the front door every second."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from pagedserve.config import EngineConfig
from pagedserve.engine import LLMEngine
from pagedserve.ray_serve.relay import RelayedRequest
from pagedserve.server.api_server import create_app
from pagedserve.server.config import ServerConfig

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-pagedserve-replica"  # which replica answered: for logs, tests, debugging
METRICS_PUSH_SECONDS = 1.0


@dataclass
class ReplicaSpec:
    engine: EngineConfig  # num_threads already set to this replica's share of the cores
    server: ServerConfig
    num_cpus: float
    app_name: str
    frontend_name: str


def _log_to_stderr() -> None:
    """Ray's worker configures only its own loggers: give pagedserve's a handler (its stderr
    reaches the replica's log file and the driver's console)."""
    root = logging.getLogger("pagedserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class EngineReplica:
    async def __init__(self, spec: ReplicaSpec):
        _log_to_stderr()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(spec.server, lambda: LLMEngine(spec.engine))
        self.state = self.app.state.server
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts loading the engine in a thread
        while self.state.serving is None and self.state.load_error is None:
            await asyncio.sleep(0.1)
        if self.state.load_error is not None:
            # Ray reports this as the deployment's failure, and `serve` prints it.
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")
        logger.info(
            "replica %s ready on node %s (%s), pid %d, %g CPUs, %d torch threads",
            self.replica_id,
            ray.get_runtime_context().get_node_id()[:12],
            socket.gethostname(),
            os.getpid(),
            spec.num_cpus,
            spec.engine.num_threads or 0,
        )
        self._frontend = serve.get_deployment_handle(spec.frontend_name, spec.app_name)
        self._pusher = asyncio.create_task(self._push_metrics())

    async def handle(self, request: RelayedRequest) -> AsyncIterator[list[dict[str, Any]]]:
        """Run one request through the app; yield its ASGI messages as they are sent, batched
        when several are ready at once. Ray's cancellation (the client went away) cancels the
        app's task, which aborts the request in the engine."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        body_read = False
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await never.wait()  # a disconnect arrives as cancellation instead
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                tag = (REPLICA_HEADER.encode(), self.replica_id.encode())
                message = {**message, "headers": [*message.get("headers", []), tag]}
            out.put_nowait(message)

        task = asyncio.create_task(self.app(request.asgi_scope(), receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            done = False
            while not done:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                done = batch[-1] is None
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
            await task  # the app's own errors are answered by it; anything else surfaces
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def metrics_text(self) -> str:
        return self.state.metrics.render().decode()

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self._frontend.report_metrics.remote(self.replica_id, self.metrics_text())
            except Exception as e:  # noqa: BLE001 - the front door restarting; try again later
                logger.debug("metrics push failed: %s", e)
            await asyncio.sleep(METRICS_PUSH_SECONDS)

    def check_health(self) -> None:
        """Raise (Ray then replaces this replica) once the engine can serve no more."""
        state = self.state
        if state.engine_error is not None:
            raise RuntimeError(f"the engine is dead: {state.engine_error}")
        if state.async_engine is None or not state.async_engine.is_running:
            raise RuntimeError("the engine loop has stopped")

    async def __del__(self) -> None:
        # The front door has drained the application and Ray has waited for this replica's
        # requests: abort what is left (the replicas' grace is 0) and stop the engine.
        if hasattr(self, "_pusher"):
            self._pusher.cancel()
        await self.state.drain()
        await self._lifespan.__aexit__(None, None, None)
