"""The seam between the engine and whatever runs the model: one process (`ModelRunner`) or
tensor-parallel ranks (`TensorParallelExecutor`); both are built from one `LoadSpec`."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.attention import AttentionBackend
from pagedserve.loading import LoadSpec, load_runner
from pagedserve.scheduler import SchedulerOutput


class Executor(Protocol):
    num_pages: int  # KV pages of the pool (every rank holds as many)
    kv_bytes_per_page: int  # on one process (a rank's shard under TP)
    backend: AttentionBackend  # the attention backend of this process's model

    def execute(self, out: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Run one step; logits of the last new token of each `sample_rows` row (indices into
        `out.scheduled`, the scheduler's order). `out.released` frees batch rows first."""
        ...

    @property
    def error(self) -> str | None:
        """Why no more steps can run (a tensor-parallel rank died), else None."""
        ...

    def shutdown(self) -> None:
        """Release workers, if any (idempotent)."""
        ...


def start_executor(spec: LoadSpec, device: torch.device) -> Executor:
    if spec.config.tensor_parallel_size > 1:
        from pagedserve.distributed.executor import TensorParallelExecutor  # spawns processes

        return TensorParallelExecutor(spec)
    return load_runner(spec, device)
