"""The runner's batch state without a model: rows join, grow pages, leave and are reused; each
step's gathered inputs equal those built from the sequences' own lists; a tensor-parallel
rank's copy, built from the packed deltas alone, equals rank 0's after every step."""

import pytest
import torch

from pagedserve.batch_state import BatchTables, RowPlanner, StepDelta, StepInput
from pagedserve.block_manager import BlockManager
from pagedserve.distributed.worker import apply_step, pack_step
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pagedserve.sequence import Sequence, SequenceStatus

PAGE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=64)


def seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(range(100, 100 + num_tokens)), PARAMS, 64)


def expected_step(batch: list[ScheduledSeq], sample_rows: list[int]) -> dict[str, list]:
    """The step built from the sequences' Python lists, decodes first (the former way)."""
    order = sorted(range(len(batch)), key=lambda i: batch[i].num_new_tokens != 1)
    rows = [batch[i] for i in order]
    width = max(len(s.seq.block_table) for s in rows)
    ids, positions, last = [], [], {}
    for i in order:
        s = batch[i]
        start = s.seq.num_computed_tokens
        ids += s.seq.token_ids_slice(start, start + s.num_new_tokens)
        positions += range(start, start + s.num_new_tokens)
        last[i] = len(ids) - 1
    return {
        "input_ids": ids,
        "positions": positions,
        "q_lens": [s.num_new_tokens for s in rows],
        "context_lens": [s.seq.num_computed_tokens + s.num_new_tokens for s in rows],
        "block_tables": [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in rows],
        "sample_tokens": [last[i] for i in sample_rows],
    }


def as_lists(step: StepInput) -> dict[str, list]:
    return {k: v.tolist() for k, v in vars(step).items()}


class Rank0:
    """Rank 0's planner and tables, and a second rank fed only the packed deltas (with rank 0's
    tables attached, so the receiving side checks them)."""

    def __init__(self) -> None:
        self.planner, self.tables, self.peer = RowPlanner(), BatchTables(), BatchTables()

    def step(self, out: SchedulerOutput) -> tuple[StepDelta, StepInput]:
        sample_rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        delta = self.planner.plan(out, sample_rows)
        step = self.tables.apply(delta)
        header, payload = pack_step(delta, self.tables)
        peer_step = apply_step(self.peer, header, payload)
        assert as_lists(peer_step) == as_lists(step)
        assert torch.equal(self.peer.tables, self.tables.tables)
        assert as_lists(step) == expected_step(out.scheduled, sample_rows)
        return delta, step


def advance(sched: Scheduler, out: SchedulerOutput, max_tokens: int) -> None:
    """The engine's side of a step: progress, a sampled token per sampling row, finishes."""
    sampling = [s.seq for s in out.scheduled if s.samples]
    sched.after_step(out)
    for s in sampling:
        s.output_token_ids.append(len(s.output_token_ids) % 50)
        if len(s.output_token_ids) >= max_tokens:
            sched.finish(s, SequenceStatus.FINISHED_LENGTH)


def test_join_then_decode_gathers_rows_decodes_first():
    bm = BlockManager(32, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    ranks = Rank0()
    a, b = seq(0, 6), seq(1, 9)
    sched.add(a)
    sched.add(b)
    delta, _ = ranks.step(out := sched.schedule())
    assert delta.page_ids.tolist() == a.block_table + b.block_table  # both whole tables
    assert delta.freed_rows.tolist() == []
    advance(sched, out, 8)
    c = seq(2, 5)
    sched.add(c)
    delta, step = ranks.step(out := sched.schedule())
    # a and b decode (rows 0 and 1), c joins in row 2 behind them.
    assert delta.rows.tolist() == [0, 1, 2]
    assert step.q_lens.tolist() == [1, 1, 5]
    assert delta.page_ids.tolist() == c.block_table  # a and b gained no page: nothing sent


def test_a_growing_row_sends_only_its_new_page():
    bm = BlockManager(32, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, 64, 8)
    ranks = Rank0()
    a = seq(0, PAGE)  # its first decode needs a second page
    sched.add(a)
    ranks.step(out := sched.schedule())
    advance(sched, out, 8)
    delta, _ = ranks.step(sched.schedule())
    assert (delta.page_rows.tolist(), delta.page_cols.tolist()) == ([0], [1])
    assert delta.page_ids.tolist() == a.block_table[1:]


def test_a_leaving_row_is_cleared_and_reused_lowest_first():
    bm = BlockManager(64, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, 64, 8)
    ranks = Rank0()
    seqs = [seq(i, 10 - i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    ranks.step(out := sched.schedule())
    advance(sched, out, 8)
    sched.finish(seqs[0], SequenceStatus.FINISHED_ABORTED)
    sched.finish(seqs[1], SequenceStatus.FINISHED_STOPPED)
    newcomer = seq(3, 3)
    sched.add(newcomer)
    delta, step = ranks.step(sched.schedule())
    assert delta.freed_rows.tolist() == [0, 1]
    assert ranks.planner.rows == {2: 2, 3: 0}
    assert ranks.tables.tables[1].tolist() == [0] * ranks.tables.tables.shape[1]
    assert step.block_tables[1].tolist()[: len(newcomer.block_table)] == newcomer.block_table


def test_preempted_sequence_rejoins_with_only_its_new_pages():
    bm = BlockManager(6, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, 64, 8)
    ranks = Rank0()
    old, young = seq(0, 11), seq(1, 11)  # 3 pages each: the pool is full
    sched.add(old)
    sched.add(young)
    ranks.step(out := sched.schedule())
    advance(sched, out, 20)
    for _ in range(2):  # old needs a 4th page: young is preempted, then waits
        out = sched.schedule()
        if out.preempted:
            break
        ranks.step(out)
        advance(sched, out, 20)
    assert out.preempted == [young]
    delta, _ = ranks.step(out)
    assert delta.freed_rows.tolist() == [1]
    sched.finish(old, SequenceStatus.FINISHED_ABORTED)
    delta, _ = ranks.step(out := sched.schedule())  # young rejoins: row 0 is free again
    assert delta.freed_rows.tolist() == [0]
    assert ranks.planner.rows == {1: 0}
    assert delta.page_ids.tolist() == young.block_table
    assert out.scheduled[0].num_new_tokens == young.num_tokens


@pytest.mark.parametrize("prefix", [True, False])
def test_tables_follow_a_busy_schedule_on_every_rank(prefix):
    """Chunked prefill, preemption, prefix sharing, aborts and row reuse over many steps; the
    Rank0 helper checks each step against the sequences' lists and the second rank."""
    bm = BlockManager(24, PAGE, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_num_batched_tokens=12, max_num_seqs=6)
    ranks = Rank0()
    shared = list(range(200, 208))
    waiting = [
        Sequence(i, str(i), 0, shared[: 4 + i % 5] + [i] * (i % 7), PARAMS, 64) for i in range(14)
    ]
    all_seqs = list(waiting)
    for s in waiting[:5]:
        sched.add(s)
    steps = 0
    preempted = 0
    while sched.has_work:
        steps += 1
        assert steps < 2_000
        out = sched.schedule()
        if steps % 3 == 0 and len(waiting) > 5:
            sched.add(waiting.pop(5))
        if out.empty:
            continue
        preempted += len(out.preempted)
        ranks.step(out)
        advance(sched, out, 12)
        if steps % 17 == 0 and sched.running:
            sched.finish(sched.running[-1], SequenceStatus.FINISHED_ABORTED)
    assert preempted > 0
    by_id = {s.seq_id: s for s in all_seqs}
    # Rows stay compact, and only sequences that left since the last step still hold one.
    assert len(ranks.tables.tables) <= 8
    assert all(by_id[i].finished for i in ranks.planner.rows)
    assert bm.num_used_pages == 0


def test_pack_then_apply_raises_when_a_rank_drifted():
    bm = BlockManager(8, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, 64, 8)
    ranks = Rank0()
    sched.add(seq(0, 6))
    ranks.step(out := sched.schedule())
    advance(sched, out, 8)
    ranks.peer.tables[0, 0] += 1  # a rank whose copy went wrong
    out = sched.schedule()  # a decode: no page changes, so the delta cannot mend it
    delta = ranks.planner.plan(out, [0])
    ranks.tables.apply(delta)
    header, payload = pack_step(delta, ranks.tables)
    with pytest.raises(RuntimeError, match="differs from rank 0"):
        apply_step(ranks.peer, header, payload)
