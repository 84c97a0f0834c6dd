"""The data-parallel knobs; `pagedserve serve` derives its flags from these fields. No Ray here:
the single-process server reads this module too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RAY_PIN = "ray[serve]==2.60.0"
INSTALL_HINT = f"pip install 'pagedserve[ray]' (which pins {RAY_PIN})"


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class DataParallelConfig:
    data_parallel_size: int = _opt(
        1,
        "Engine replicas, each a whole copy of the model with its own KV cache and its share of"
        " the cores, behind one HTTP port as a Ray Serve application (1: the plain single-process"
        " server, no Ray)",
    )
    ray_address: str | None = _opt(
        None,
        "With --data-parallel-size > 1: the Ray cluster to place the replicas on, e.g."
        " HEAD_IP:6379 (unset: start a local Ray instance on this host)",
    )
    data_parallel_routing: str = _opt(
        "prefix",
        "With --data-parallel-size > 1: prefix (to the replica that most likely holds the"
        " prompt's prefix pages, the least loaded when loads are uneven) or pow2 (Ray Serve's"
        " power of two choices)",
        choices=["prefix", "pow2"],
    )

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.ray_address is not None and self.data_parallel_size == 1:
            raise ValueError("--ray-address needs --data-parallel-size > 1")


def require_ray() -> None:
    """Fail with the install line when Ray Serve is missing (only N > 1 needs it)."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"--data-parallel-size > 1 runs on Ray Serve, which is not installed ({e}): "
            f"{INSTALL_HINT}"
        ) from None
