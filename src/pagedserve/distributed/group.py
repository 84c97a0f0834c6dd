"""The tensor-parallel process group: setup with timeouts, and the few collectives we use.

Backend: NCCL on CUDA, gloo on CPU. Host-side messages (a step's inputs, heartbeats, the
shard spec) always travel on a gloo group, which is the default group itself on CPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The four variables torchrun sets for every process it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup  # the model's collectives (NCCL on CUDA, gloo on CPU)
    cpu_group: dist.ProcessGroup  # host tensors: step inputs, heartbeats (always gloo)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; None elsewhere."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """From rank 0 to all, in place, on the host."""
        dist.broadcast(x, src=0, group=self.cpu_group)
        return x

    def barrier_sum(self) -> int:
        """A one-element all-reduce: returns only when every rank took part (liveness)."""
        t = torch.ones(1, dtype=torch.long)
        dist.all_reduce(t, group=self.cpu_group)
        return int(t.item())


def torchrun_env() -> dict[str, str] | None:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT when a launcher (torchrun) set them all."""
    if all(k in os.environ for k in TORCHRUN_ENV):
        return {k: os.environ[k] for k in TORCHRUN_ENV}
    return None


def local_rank_and_size(rank: int, size: int) -> tuple[int, int]:
    """This process's index among the ranks of its host, and their number (torchrun's
    LOCAL_RANK / LOCAL_WORLD_SIZE; a single host otherwise)."""
    if torchrun_env() is not None and "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", size))
    return rank, size


def rank_device(device_type: str, rank: int, size: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    local_rank, _ = local_rank_and_size(rank, size)
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel rank {rank} needs cuda:{local_rank}, but this host has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", local_rank)


def init_group(
    rank: int,
    size: int,
    device: torch.device,
    timeout_s: float,
    store: dist.Store | None = None,
) -> TPGroup:
    """Join the group; `store` for ranks on this host, else torchrun's env:// rendezvous.

    Every collective fails after `timeout_s` rather than waiting forever for a dead peer."""
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group already exists in this process: shut the other engine "
            "down first (LLM.engine.shutdown())"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, device, world, cpu_group)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
