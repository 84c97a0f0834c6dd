"""A tensor-parallel rank: its shard of the model and of the KV pages, and (ranks 1..N-1) the
loop that runs every step rank 0 broadcasts.

Per step, rank 0 sends two host tensors on the gloo group: a fixed-size header (kind and sizes)
and the step's `StepDelta` (batch_state.py) packed into one int64 tensor: rows freed, pages
appended, the step's rows, starts, token ids. Each rank applies it to its own `BatchTables`, so
block tables never travel whole (but in the check mode, which sends rank 0's for comparison).
Nothing else crosses between ranks but the model's own collectives; the logits are gathered to
rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from pagedserve.batch_state import BatchTables, StepDelta, StepInput
from pagedserve.config import EngineConfig
from pagedserve.distributed.group import (
    TPGroup,
    destroy_group,
    init_group,
    local_rank_and_size,
    rank_device,
)
from pagedserve.distributed.sharding import ShardPlan
from pagedserve.loading import LoadSpec, load_runner
from pagedserve.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# header[0] of every message from rank 0.
STEP, HEARTBEAT, STOP = 1, 2, 3
# kind, the sizes of a StepDelta's parts, the shape of rank 0's tables when they are checked
HEADER_LEN = 1 + len(fields(StepDelta)) + 2


@dataclass
class Rank:
    group: TPGroup
    runner: ModelRunner


@dataclass
class WorkerArgs:
    """How a worker that this host's engine spawned finds the group."""

    rank: int
    size: int
    host: str
    port: int
    device_type: str
    timeout_s: float


# ---- the step message ----------------------------------------------------------------------
def pack_step(
    delta: StepDelta, check: BatchTables | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload of a step. With `check` (rank 0's tables after the step, a debug
    mode), the whole state rides along for the other ranks to compare theirs with."""
    parts = [delta.pack()]
    shape = [0, 0]
    if check is not None:
        parts += [check.tables.flatten(), check.num_pages]
        shape = list(check.tables.shape)
    header = torch.tensor([STEP, *delta.sizes(), *shape], dtype=torch.long)
    return header, torch.cat(parts)


def message(kind: int) -> torch.Tensor:
    return torch.tensor([kind] + [0] * (HEADER_LEN - 1), dtype=torch.long)


def _payload_sizes(header: torch.Tensor) -> list[int]:
    """The delta's parts, then the checked tables and their page counts (empty unchecked)."""
    *sizes, rows, cols = header[1:].tolist()
    return [*sizes, rows * cols, rows if cols else 0]


def apply_step(tables: BatchTables, header: torch.Tensor, payload: torch.Tensor) -> StepInput:
    """Apply a received step to this rank's tables; raises if a checked state differs."""
    *parts, checked, checked_pages = payload.split(_payload_sizes(header))
    step = tables.apply(StepDelta(*parts))
    if len(checked_pages):
        same = torch.equal(tables.num_pages, checked_pages) and torch.equal(
            tables.tables, checked.view(len(checked_pages), -1)
        )
        if not same:
            raise RuntimeError("this rank's batch state differs from rank 0's after a step")
    return step


# ---- a rank --------------------------------------------------------------------------------
def default_threads(config: EngineConfig, device_type: str, rank: int, size: int) -> int | None:
    """Threads per rank: the flag, else on CPU this host's cores shared out among its ranks
    (oversubscribed OpenMP threads are many times slower than fewer ones)."""
    if config.num_threads:
        return config.num_threads
    if device_type != "cpu":
        return None
    _, local_size = local_rank_and_size(rank, size)
    return max(1, len(os.sched_getaffinity(0)) // local_size)


def load_rank(spec: LoadSpec, group: TPGroup) -> Rank:
    """Load this rank's shard and its KV pages (as many on every rank)."""
    threads = default_threads(spec.config, spec.device_type, group.rank, group.size)
    if threads:
        torch.set_num_threads(threads)
    runner = load_runner(spec, group.device, tp=group)
    plan = ShardPlan.for_rank(spec.model_config, group.size, group.rank)
    _log_memory(group, plan, runner.model, threads)
    return Rank(group, runner)


def _log_memory(
    group: TPGroup, plan: ShardPlan, model: torch.nn.Module, threads: int | None
) -> None:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    status = _proc_status()
    logger.info(
        "tensor-parallel rank %d/%d (pid %d, %s, %s threads): query heads %d-%d, KV heads %d-%d, "
        "%.0f MiB of weights; resident memory %.0f MiB, peak %.0f MiB",
        group.rank,
        group.size,
        os.getpid(),
        group.device,
        threads or torch.get_num_threads(),
        plan.q_heads.start,
        plan.q_heads.stop - 1,
        plan.kv_heads.start,
        plan.kv_heads.stop - 1,
        weights / 2**20,
        status.get("VmRSS", 0) / 2**10,
        status.get("VmHWM", 0) / 2**10,
    )


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM (peak resident) of this process in KiB, where /proc has them."""
    try:
        with open("/proc/self/status") as f:
            lines = [line.split() for line in f if line.startswith(("VmRSS", "VmHWM"))]
        return {parts[0].rstrip(":"): int(parts[1]) for parts in lines}
    except OSError:
        return {}


def serve_steps(rank: Rank) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
    group = rank.group
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    while True:
        group.broadcast(header)
        kind = int(header[0])
        if kind == STOP:
            group.barrier_sum()  # every rank got it: all leave the group together
            return
        if kind == HEARTBEAT:
            group.barrier_sum()
            continue
        payload = torch.empty(sum(_payload_sizes(header)), dtype=torch.long)
        group.broadcast(payload)
        rank.runner.run(apply_step(rank.runner.tables, header, payload))


def run_worker(
    rank: int, size: int, device_type: str, timeout_s: float, store: dist.Store | None = None
) -> int:
    """A worker's life: join the group, receive the spec, load, serve steps. The exit status."""
    try:
        group = init_group(rank, size, rank_device(device_type, rank, size), timeout_s, store)
        received: list[LoadSpec | None] = [None]
        dist.broadcast_object_list(received, src=0, group=group.cpu_group)
        spec = received[0]
        assert spec is not None
        serve_steps(load_rank(spec, group))
    except Exception:  # noqa: BLE001 - logged, then a non-zero exit tells the engine
        logger.exception("tensor-parallel rank %d failed; exiting", rank)
        return 1
    finally:
        try:
            destroy_group()
        except Exception:  # noqa: BLE001 - the group may be broken already
            pass
    return 0


def _exit_with_parent() -> None:
    """No worker outlives the engine's process, even one killed by SIGKILL: a thread watches
    for this process being handed to another parent. (Not prctl's PDEATHSIG, which fires when
    the spawning *thread* ends, such as the server's model-loading thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


def worker_main(args: WorkerArgs) -> None:
    """Entry of a worker process spawned by the engine on this host."""
    _exit_with_parent()
    # Ctrl-C reaches the whole process group: the engine shuts the workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: %(message)s",
    )
    torch.set_num_threads(1)  # until the spec says more; startup work is small
    store = dist.TCPStore(
        args.host,
        args.port,
        args.size,
        is_master=False,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    sys.exit(run_worker(args.rank, args.size, args.device_type, args.timeout_s, store))
