"""The application's front door (one replica, behind Ray Serve's HTTP proxy): reads each request
whole, keys it by its prompt's leading text, and relays it through a deployment handle whose
router picks the engine replica; the replica's ASGI messages come back as a stream, so SSE
passes through token by token. Ray's proxy forwards only the request's head before routing,
which is why the body is read here: the router needs the prompt.

It also owns what is application-wide: the in-flight limit (429 + Retry-After), draining on
SIGTERM (503), and /metrics, where every replica's series (pushed here each second) appear with
a `replica` label."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from ray.serve.handle import DeploymentHandle
from starlette.types import Receive, Scope, Send

from pagedserve.ray_serve.metrics_merge import merge_replica_metrics
from pagedserve.ray_serve.relay import GENERATION_PATHS, RelayedRequest, routing_key
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

# A replica silent this long has stopped (or been replaced): its series leave the scrape.
METRICS_STALE_SECONDS = 10.0


@dataclass
class FrontendSpec:
    max_concurrent_requests: int  # for the whole application: replicas x each one's limit
    max_request_body_bytes: int


class FrontDoor:
    """The ASGI app of the front door."""

    def __init__(self, engine: DeploymentHandle, spec: FrontendSpec):
        self._engine = engine.options(stream=True)
        self._spec = spec
        self._in_flight = 0
        self._draining = False
        self._replica_metrics: dict[str, tuple[str, float]] = {}
        self._registry = r = CollectorRegistry()
        self._in_flight_gauge = Gauge(
            "pagedserve_app_requests_in_flight",
            "Generation requests in flight in the whole application (front door)",
            registry=r,
        )
        self._rejected = Counter(
            "pagedserve_app_requests_rejected",
            "Requests the front door refused or cut short, by reason"
            " (concurrency, draining, replica_failed)",
            ["reason"],
            registry=r,
        )

    # ---- called by the replicas and by `serve` ---------------------------------------------
    def report_metrics(self, replica: str, text: str) -> None:
        self._replica_metrics[replica] = (text, time.monotonic())

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new requests, wait for those in flight; how many were left at the deadline."""
        self._draining = True
        logger.info("draining: %d requests in flight, grace %.0f s", self._in_flight, grace_seconds)
        deadline = time.monotonic() + grace_seconds
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight

    # ---- HTTP ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup: nothing to start, the replicas own the engines
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/metrics" and method == "GET":
            await self._send_metrics(send)
            return
        generation = method == "POST" and path in GENERATION_PATHS
        try:
            self._admit(generation)
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        try:
            try:
                body = await self._read_body(receive)
            except APIError as e:
                await e.response()(scope, receive, send)
                return
            if body is None:
                return  # the client left before sending its whole request
            request = RelayedRequest(
                method=method,
                path=path,
                query_string=scope.get("query_string", b""),
                headers=list(scope.get("headers", [])),
                body=body,
                client=scope.get("client"),
                routing_key=routing_key(path, body),
            )
            await self._relay(request, scope, receive, send)
        finally:
            if generation:
                self._in_flight -= 1
                self._in_flight_gauge.dec()

    def _admit(self, generation: bool) -> None:
        """Refuse while draining (503) or at the application's limit (429); else count it."""
        if self._draining:
            self._rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not generation:
            return
        if self._in_flight >= self._spec.max_concurrent_requests:
            self._rejected.labels("concurrency").inc()
            raise APIError(
                429,
                f"too many requests in flight (limit {self._spec.max_concurrent_requests}); "
                "retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self._in_flight += 1
        self._in_flight_gauge.inc()

    async def _read_body(self, receive: Receive) -> bytes | None:
        limit = self._spec.max_request_body_bytes
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise APIError(
                    413,
                    f"request body is larger than the limit of {limit} bytes",
                    code="request_too_large",
                )
            if not message.get("more_body", False):
                return bytes(body)

    async def _relay(self, request: RelayedRequest, scope: Scope, receive: Receive, send: Send):
        stream = self._engine.handle.remote(request)
        started, sse, finished = False, False, False
        try:
            async for messages in stream:
                for message in messages:
                    if message["type"] == "http.response.start":
                        started = True
                        headers = dict(message.get("headers", []))
                        sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                    finished = message["type"] == "http.response.body" and not message.get(
                        "more_body", False
                    )
                    await send(message)
        except Exception as e:  # noqa: BLE001 - a replica died or was cut off mid-request
            logger.warning("request to %s failed in its replica: %s", request.path, e)
            self._rejected.labels("replica_failed").inc()
            error = APIError(
                503,
                f"the replica serving this request failed: {type(e).__name__}",
                code="replica_unavailable",
                headers={"Retry-After": "1"},
            )
            if not started:
                await error.response()(scope, receive, send)
            elif not finished:
                tail = f"data: {json.dumps(error.body())}\n\n".encode() if sse else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            if not finished:
                stream.cancel()  # the client left (or the replica failed): abort there

    async def _send_metrics(self, send: Send) -> None:
        now = time.monotonic()
        fresh = {
            r: text
            for r, (text, at) in self._replica_metrics.items()
            if now - at < METRICS_STALE_SECONDS
        }
        body = merge_replica_metrics(fresh, self._registry.collect())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


class Frontend:
    """The front door's deployment (wrapped by `serve.ingress()`): its app, plus the methods the
    replicas (metrics) and `serve` (drain) call through handles."""

    def __init__(self, engine: DeploymentHandle, spec: FrontendSpec):
        self._door = FrontDoor(engine, spec)

    def __serve_build_asgi_app__(self) -> FrontDoor:
        return self._door

    def report_metrics(self, replica: str, text: str) -> None:
        self._door.report_metrics(replica, text)

    async def drain(self, grace_seconds: float) -> int:
        return await self._door.drain(grace_seconds)
