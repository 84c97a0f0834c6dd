"""The engine's side of tensor parallelism: rank 0 in the engine's process, workers beside it.

`TensorParallelExecutor` is an `Executor` (executor.py), as a `ModelRunner` is: it broadcasts
each step's changes to the batch state once, runs rank 0's shard, and returns the logits
gathered to rank 0.
Ranks 1..N-1 are spawned on this host, or started by torchrun (multi-node).

Faults: a monitor thread notices a spawned worker's exit within a second, and heartbeats (a
broadcast plus a one-element all-reduce, every second while idle) notice a lost or hung peer
anywhere, bounded by the group's timeout; every collective of a step has the same bound. The
first failure is kept in `error`, logged, and every later step raises `EngineDeadError`.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve.distributed.group import (
    destroy_group,
    init_group,
    rank_device,
    torchrun_env,
)
from pagedserve.distributed.sharding import ShardPlan
from pagedserve.distributed.worker import (
    HEARTBEAT,
    STOP,
    Rank,
    WorkerArgs,
    load_rank,
    message,
    pack_step,
    worker_main,
)
from pagedserve.loading import LoadSpec
from pagedserve.scheduler import SchedulerOutput

__all__ = ["CHECK_STATE_ENV", "EngineDeadError", "TensorParallelExecutor"]

logger = logging.getLogger(__name__)

# "1": every step also sends rank 0's whole batch state, and every rank checks that its own,
# built from the deltas alone, is identical (a debug mode; the tests run with it).
CHECK_STATE_ENV = "PAGEDSERVE_CHECK_BATCH_STATE"
MONITOR_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 1.0
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank failed: the engine can run no more steps."""


class TensorParallelExecutor:
    def __init__(self, spec: LoadSpec):
        config = spec.config
        size = config.tensor_parallel_size
        ShardPlan.check(spec.model_config, size)  # a clear ValueError before any process starts
        self.size = size
        self.error: str | None = None
        self._procs: dict[int, BaseProcess] = {}
        self._lock = threading.Lock()  # one sender of collectives at a time: steps, heartbeats
        self._stop = threading.Event()
        self._closed = False
        self._last_used = time.monotonic()
        self.rank: Rank | None = None
        self._check_state = os.environ.get(CHECK_STATE_ENV) == "1"
        timeout = config.tensor_parallel_timeout
        device = rank_device(spec.device_type, 0, size)
        env = torchrun_env()
        store = None
        if env is not None:
            if int(env["WORLD_SIZE"]) != size or int(env["RANK"]) != 0:
                raise ValueError(
                    f"torchrun started this process as rank {env['RANK']} of {env['WORLD_SIZE']}, "
                    f"but the engine runs as rank 0 of tensor_parallel_size {size}: launch with "
                    "`python -m pagedserve.distributed.launch` (see README)"
                )
        else:
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                size,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        atexit.register(self.shutdown)
        try:
            if store is not None:
                self._spawn_workers(spec.device_type, store.port, timeout)
            group = self._while_alive(lambda: init_group(0, size, device, timeout, store))
            self._while_alive(
                lambda: dist.broadcast_object_list([spec], src=0, group=group.cpu_group)
            )
            self.rank = self._while_alive(lambda: load_rank(spec, group))
        except BaseException:
            self.shutdown()
            raise
        self.num_pages = self.rank.runner.num_pages
        self.kv_bytes_per_page = self.rank.runner.kv_bytes_per_page
        self.backend = self.rank.runner.backend
        self._monitor = threading.Thread(
            target=self._watch, name="pagedserve-tp-monitor", daemon=True
        )
        self._monitor.start()

    @property
    def worker_pids(self) -> dict[int, int | None]:
        """Rank -> pid of the workers this process spawned (none under torchrun)."""
        return {r: p.pid for r, p in self._procs.items()}

    # ---- start-up ------------------------------------------------------------------------
    def _spawn_workers(self, device_type: str, port: int, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        for r in range(1, self.size):
            args = WorkerArgs(r, self.size, "127.0.0.1", port, device_type, timeout)
            proc = ctx.Process(target=worker_main, args=(args,), name=f"pagedserve-tp{r}")
            proc.daemon = True  # multiprocessing also ends it at exit, should shutdown not run
            proc.start()
            self._procs[r] = proc
        logger.info(
            "tensor parallelism: rank 0 in this process (pid %s), workers %s",
            os.getpid(),
            ", ".join(f"rank {r} pid {p.pid}" for r, p in self._procs.items()),
        )

    def _while_alive(self, fn: Callable[[], T]) -> T:
        """Run a blocking start-up call, failing within a poll interval if a worker exits
        (rather than after the timeout of a rendezvous or collective it will never join)."""
        result: list[T] = []
        failure: list[BaseException] = []

        def call() -> None:
            try:
                result.append(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(e)

        thread = threading.Thread(target=call, name="pagedserve-tp-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead_worker()
            if dead is not None and thread.is_alive():
                raise EngineDeadError(f"{dead} while starting up; see its log above")
        if failure:
            raise failure[0]
        return result[0]

    # ---- steps ---------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Run one step on every rank (each applies its delta to its own batch state); logits
        of the sampled rows (from rank 0)."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        assert self.rank is not None
        runner = self.rank.runner
        delta = runner.planner.plan(out, sample_rows)
        step = runner.tables.apply(delta)
        header, payload = pack_step(delta, runner.tables if self._check_state else None)
        with self._lock:
            try:
                self.rank.group.broadcast(header)
                self.rank.group.broadcast(payload)
                logits = runner.run(step)
            except Exception as e:
                # The ranks no longer agree on where they are: the group is unusable.
                self._fail(self._why(e))
                raise EngineDeadError(self.error) from e
            self._last_used = time.monotonic()
        return logits

    # ---- faults --------------------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        for r, proc in self._procs.items():
            code = proc.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"tensor-parallel rank {r} (pid {proc.pid}) {how}"
        return None

    def _why(self, e: BaseException) -> str:
        time.sleep(0.2)  # a peer's death is often the cause: give its exit time to show
        dead = self._dead_worker()
        return dead or f"a tensor-parallel collective failed: {type(e).__name__}: {e}"

    def _fail(self, reason: str) -> None:
        if self.error is not None:
            return
        self.error = reason
        logger.error("%s; the engine cannot run more steps", reason)
        for proc in self._procs.values():  # the others would only wait for their timeout
            if proc.exitcode is None:
                proc.kill()

    def _watch(self) -> None:
        while not self._stop.wait(MONITOR_INTERVAL_S):
            dead = self._dead_worker()
            if dead is not None:
                self._fail(dead)
                return
            idle = time.monotonic() - self._last_used >= HEARTBEAT_INTERVAL_S
            if not idle or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._closed or self.rank is None:
                    return
                self.rank.group.broadcast(message(HEARTBEAT))
                self.rank.group.barrier_sum()
                self._last_used = time.monotonic()
            except Exception as e:  # noqa: BLE001 - recorded; steps raise it from now on
                self._fail(self._why(e))
                return
            finally:
                self._lock.release()

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker and leave the group (idempotent; registered to run at exit)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        graceful = self.error is None and self.rank is not None
        # A step stuck in a collective holds the lock: then the workers are stopped by force.
        if graceful and self._lock.acquire(timeout=5.0):
            try:
                self.rank.group.broadcast(message(STOP))
                self.rank.group.barrier_sum()
            except Exception:  # noqa: BLE001 - the workers are ended below in any case
                graceful = False
            finally:
                self._lock.release()
        for proc in self._procs.values():
            proc.join(5.0 if graceful else 0.5)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(2.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        try:
            destroy_group()
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
            logger.warning("could not tear the tensor-parallel group down cleanly")
        atexit.unregister(self.shutdown)
