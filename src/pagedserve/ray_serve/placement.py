"""What each replica asks Ray for, and whether N of them fit the cluster: checked before
serving, since Ray would otherwise wait forever for resources that never come. No Ray here."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.loading import CPU_DEFAULT_KV_BYTES
from pagedserve.models.loader import ModelSource

GIB = 1 << 30
# A replica process before its weights and KV pool: Python, torch, Ray's worker, the tokenizer.
PROCESS_BASELINE_BYTES = 768 << 20


@dataclass
class ReplicaResources:
    num_cpus: int
    memory_bytes: int
    num_gpus: int

    def describe(self) -> str:
        gpus = f", {self.num_gpus} GPU" if self.num_gpus else ""
        return f"{self.num_cpus} CPU, {self.memory_bytes / GIB:.1f} GiB memory{gpus}"


@dataclass
class NodeCapacity:
    name: str
    num_cpus: float
    memory_bytes: float
    num_gpus: float

    def fits(self, need: ReplicaResources) -> int:
        counts = [math.floor(self.num_cpus / need.num_cpus)]
        counts.append(math.floor(self.memory_bytes / need.memory_bytes))
        if need.num_gpus:
            counts.append(math.floor(self.num_gpus / need.num_gpus))
        return max(0, min(counts))


def _model_bytes(model: str | None) -> int:
    path = ModelSource.resolve(model).path
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith((".safetensors", ".gguf", ".bin"))
    )


def replica_resources(
    config: EngineConfig, num_replicas: int, nodes: list[NodeCapacity]
) -> ReplicaResources:
    """A replica's share: --num-threads per tensor-parallel rank if given, else the cluster's
    cores split evenly; GPUs (one per rank) when serving on CUDA; memory for the weights, the
    KV pool where it lives in host memory, and a process's baseline."""
    tp = config.tensor_parallel_size
    total_cpus = sum(n.num_cpus for n in nodes)
    cpus = config.num_threads * tp if config.num_threads else math.floor(total_cpus / num_replicas)
    if cpus < 1:
        raise ValueError(
            f"--data-parallel-size {num_replicas} needs at least 1 CPU per replica, but the Ray "
            f"cluster has {total_cpus:g} CPUs: use at most {math.floor(total_cpus)} replicas"
        )
    has_gpus = any(n.num_gpus for n in nodes)
    on_gpu = config.device == "cuda" or (config.device == "auto" and has_gpus)
    kv_in_host = 0 if on_gpu else (config.kv_cache_bytes or CPU_DEFAULT_KV_BYTES)
    memory = _model_bytes(config.model) + kv_in_host + PROCESS_BASELINE_BYTES
    return ReplicaResources(cpus, memory, tp if on_gpu else 0)


def placement_error(
    num_replicas: int, need: ReplicaResources, nodes: list[NodeCapacity]
) -> str | None:
    """Why N replicas cannot be placed (naming what is short), or None when they fit."""
    if sum(n.fits(need) for n in nodes) >= num_replicas:
        return None
    short = []
    by_cpu = sum(math.floor(n.num_cpus / need.num_cpus) for n in nodes)
    by_memory = sum(math.floor(n.memory_bytes / need.memory_bytes) for n in nodes)
    if by_cpu < num_replicas:
        short.append(f"CPUs (room for {by_cpu})")
    if by_memory < num_replicas:
        short.append(f"memory (room for {by_memory})")
    if need.num_gpus:
        by_gpu = sum(math.floor(n.num_gpus / need.num_gpus) for n in nodes)
        if by_gpu < num_replicas:
            short.append(f"GPUs (room for {by_gpu})")
    have = "; ".join(
        f"{n.name}: {n.num_cpus:g} CPU, {n.memory_bytes / GIB:.1f} GiB, {n.num_gpus:g} GPU"
        for n in nodes
    )
    return (
        f"--data-parallel-size {num_replicas} needs {num_replicas} replicas of "
        f"{need.describe()} each, but the Ray cluster cannot place them: short of "
        f"{' and '.join(short) or 'room on any one node'}. Cluster: {have}"
    )
