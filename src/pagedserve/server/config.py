"""Every HTTP server knob; `pagedserve serve` derives its flags from these fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "Address to listen on (0.0.0.0 for all interfaces)")
    port: int = _opt(8000, "Port to listen on")
    grpc_port: int | None = _opt(
        None, "Also serve the gRPC API (proto/pagedserve/v1) on this port, same host (unset: off)"
    )
    served_model_name: str | None = _opt(
        None, "Model id the API answers to (unset: the model's own name)"
    )
    api_key: str | None = _opt(
        None,
        f"Require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
        f"(unset: env {API_KEY_ENV}, else no key)",
    )
    max_concurrent_requests: int = _opt(
        256, "Generation requests in flight at once; more get 429 with Retry-After"
    )
    max_request_body_bytes: int = _opt(1 << 20, "Largest request body in bytes; larger get 413")
    shutdown_grace_seconds: float = _opt(
        30.0, "On SIGTERM: seconds to let in-flight requests finish before aborting them"
    )
    log_interval_seconds: float = _opt(
        5.0, "Seconds between throughput/KV-usage log lines while the engine is busy"
    )
    access_log: bool = _opt(False, "Log one line per HTTP request")

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grpc_port is not None:
            if not 0 <= self.grpc_port <= 65535:
                raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
            if self.grpc_port == self.port != 0:
                raise ValueError(f"grpc_port must differ from port ({self.port})")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.shutdown_grace_seconds < 0:
            raise ValueError("shutdown_grace_seconds must be >= 0")
        if self.log_interval_seconds <= 0:
            raise ValueError("log_interval_seconds must be > 0")
