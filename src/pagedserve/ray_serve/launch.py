"""`pagedserve serve --data-parallel-size N`: N engine replicas and the front door as one Ray
Serve application, on a local Ray instance started here or on the cluster at --ray-address.
Serves until SIGTERM/SIGINT, then drains (the front door refuses new requests and waits for
those in flight) and shuts the application down."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedserve.config import EngineConfig
from pagedserve.ray_serve.config import DataParallelConfig
from pagedserve.ray_serve.frontend import Frontend, FrontendSpec
from pagedserve.ray_serve.placement import (
    NodeCapacity,
    ReplicaResources,
    placement_error,
    replica_resources,
)
from pagedserve.ray_serve.replica import EngineReplica, ReplicaSpec
from pagedserve.ray_serve.router import PrefixAffinityRouter
from pagedserve.server.config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "pagedserve"
FRONTEND_NAME = "PagedserveFrontend"
ENGINE_NAME = "PagedserveEngine"
# The object store carries only small request bodies and messages here.
LOCAL_OBJECT_STORE_BYTES = 256 << 20


def _connect(address: str | None) -> str:
    """Join the cluster, or start a local Ray instance (never someone else's by accident)."""
    try:
        ctx = ray.init(
            address=address or "local",
            object_store_memory=None if address else LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as e:
        raise ValueError(f"cannot join the Ray cluster at {address}: {e}") from None
    return ctx.address_info.get("gcs_address", address or "")


def _nodes() -> list[NodeCapacity]:
    return [
        NodeCapacity(
            name=f"{n['NodeManagerAddress']}",
            num_cpus=n["Resources"].get("CPU", 0.0),
            memory_bytes=n["Resources"].get("memory", 0.0),
            num_gpus=n["Resources"].get("GPU", 0.0),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def build_application(
    engine: EngineConfig,
    server: ServerConfig,
    dp: DataParallelConfig,
    need: ReplicaResources,
):
    n = dp.data_parallel_size
    threads = engine.num_threads or max(1, need.num_cpus // engine.tensor_parallel_size)
    # Each replica's own drain is immediate: the front door has already waited the grace.
    spec = ReplicaSpec(
        engine=dataclasses.replace(engine, num_threads=threads),
        server=dataclasses.replace(server, grpc_port=None, shutdown_grace_seconds=0.0),
        num_cpus=need.num_cpus,
        app_name=APP_NAME,
        frontend_name=FRONTEND_NAME,
    )
    router = (
        RequestRouterConfig(request_router_class=PrefixAffinityRouter)
        if dp.data_parallel_routing == "prefix"
        else RequestRouterConfig()  # Ray's default: power of two choices
    )
    engines = serve.deployment(
        EngineReplica,
        name=ENGINE_NAME,
        num_replicas=n,
        ray_actor_options={
            "num_cpus": need.num_cpus,
            "num_gpus": need.num_gpus,
            "memory": need.memory_bytes,
        },
        # As many as the engine admits (Ray's default of 5 would cap its batch at 5).
        max_ongoing_requests=server.max_concurrent_requests,
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=10.0,
        max_constructor_retry_count=2,
        request_router_config=router,
        logging_config={"enable_access_log": server.access_log},
    ).bind(spec)
    limit = server.max_concurrent_requests * n
    frontend = serve.deployment(
        serve.ingress()(Frontend),
        name=FRONTEND_NAME,
        num_replicas=1,  # one router, so one memory of which replica holds which prefix
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": server.access_log},
        # Above the application's own limit, so that its 429 answers, not Ray's queue; the
        # margin carries the replicas' metrics pushes.
        max_ongoing_requests=limit + 16 * n,
    )
    return frontend.bind(engines, FrontendSpec(limit, server.max_request_body_bytes))


def _drain(handle, grace: float) -> int:
    """Drain through the front door, then remove the application: 0 if it drained cleanly."""
    logger.info("shutting down: draining, grace %.0f s", grace)
    try:
        left = handle.drain.remote(grace).result(timeout_s=grace + 10)
    except Exception as e:  # noqa: BLE001 - Ray itself is going down (a signal to its group)
        logger.error("could not drain the application: %s", e)
        return 1
    if left:
        logger.warning("grace period over: aborting %d requests in flight", left)
    serve.delete(APP_NAME)
    return 0


def run_data_parallel(engine: EngineConfig, server: ServerConfig, dp: DataParallelConfig) -> int:
    if server.grpc_port is not None:
        raise ValueError("--grpc-port is not served with --data-parallel-size > 1 (HTTP only)")
    gcs = _connect(dp.ray_address)
    try:
        nodes = _nodes()
        need = replica_resources(engine, dp.data_parallel_size, nodes)
        error = placement_error(dp.data_parallel_size, need, nodes)
        if error is not None:
            raise ValueError(error)
        logger.info(
            "Ray cluster %s: %d node(s); %d replicas of %s, routing %s",
            gcs,
            len(nodes),
            dp.data_parallel_size,
            need.describe(),
            dp.data_parallel_routing,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, f: stop.set())
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": server.host, "port": server.port},
        )
        try:
            handle = serve.run(
                build_application(engine, server, dp, need), name=APP_NAME, route_prefix="/"
            )
        except RuntimeError as e:
            logger.error("the application failed to start: %s", e)
            return 1
        logger.info(
            "serving on http://%s:%d (pid %d): %d engine replicas",
            server.host,
            server.port,
            os.getpid(),
            dp.data_parallel_size,
        )
        stop.wait()
        return _drain(handle, server.shutdown_grace_seconds)
    finally:
        if dp.ray_address is None:
            serve.shutdown()
        ray.shutdown()
