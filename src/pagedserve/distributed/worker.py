"""A tensor-parallel rank: its shard of the model and of the KV pages, and (ranks 1..N-1) the
loop that runs every step rank 0 broadcasts.

Per step, rank 0 sends two host tensors on the gloo group: a fixed-size header (kind and sizes)
and the step's flat inputs (`StepInput`, packed into one int64 tensor). Nothing else crosses
between ranks but the model's own collectives; the logits are gathered to rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
from pagedserve.model_runner import ModelRunner, StepInput

logger = logging.getLogger(__name__)

# header[0] of every message from rank 0.
STEP, HEARTBEAT, STOP = 1, 2, 3
HEADER_LEN = 5  # kind, tokens, rows, block-table width, sampled tokens


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
def pack_step(step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
    header = torch.tensor(
        [STEP, len(step.input_ids), *step.block_tables.shape, len(step.sample_tokens)],
        dtype=torch.long,
    )
    payload = torch.cat(
        [
            step.input_ids,
            step.positions,
            step.q_lens,
            step.context_lens,
            step.block_tables.flatten(),
            step.sample_tokens,
        ]
    )
    return header, payload


def message(kind: int) -> torch.Tensor:
    return torch.tensor([kind] + [0] * (HEADER_LEN - 1), dtype=torch.long)


def _payload_sizes(header: torch.Tensor) -> list[int]:
    _, tokens, rows, width, sampled = header.tolist()
    return [tokens, tokens, rows, rows, rows * width, sampled]


def unpack_step(header: torch.Tensor, payload: torch.Tensor) -> StepInput:
    ids, positions, q_lens, context, tables, sample = payload.split(_payload_sizes(header))
    rows, width = int(header[2]), int(header[3])
    return StepInput(ids, positions, q_lens, context, tables.view(rows, width), sample)


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
        rank.runner.run(unpack_step(header, payload))


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
