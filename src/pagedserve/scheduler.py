"""Continuous batching: every step re-decides which sequences run and how many tokens each.

There is no prefill phase and decode phase: each sequence has known tokens (prompt + output)
and computed tokens (K/V already in pages); a step lets computed catch up with known, within a
token budget. Running sequences go first, in admission order; waiting ones are admitted FCFS
into the same step. When pages run out, the most recently admitted sequence is preempted: its
pages are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.block_manager import BlockManager
from pagedserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so it samples one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Ids of sequences that left the running set (finished, aborted, preempted) since the last
    # step that ran: the runner frees their batch rows before this step's joins.
    released: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._released: list[int] = []  # until a step runs: empty outputs are never executed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # Running sequences, oldest first; preempt from the newest end when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1

        # Waiting sequences, FCFS, while budget, sequence slots and pages allow.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                cached = bm.find_cached_prefix(seq)
                n = min(seq.num_tokens - len(cached) * bm.page_size, budget)
                if not bm.allocate(seq, n, cached):
                    # max_model_len fits the pool, so this clears once running sequences finish.
                    break
                seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * bm.page_size
                bm.record_prefix_query(seq.num_tokens, seq.num_cached_tokens)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        if out.scheduled:
            out.released, self._released = self._released, []
        return out

    def unrelease(self, seq_ids: list[int]) -> None:
        """Hand `seq_ids` out again with the next step (the step that carried them failed)."""
        self._released[:0] = seq_ids

    def _preempt(self, seq: Sequence) -> None:
        self._released.append(seq.seq_id)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def after_step(self, out: SchedulerOutput) -> None:
        """Advance computed tokens and register newly full pages with the prefix cache."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_pages(s.seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (stop, length or abort) and return its pages at once."""
        seq.status = status
        seq.finished_time = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
