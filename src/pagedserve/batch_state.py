"""The runner's batch state, kept between steps: a row per running sequence holding its block
table, changed only by what a step changes (rows joining or leaving, pages gained).

`RowPlanner` (rank 0, beside the scheduler) turns a scheduled step into a `StepDelta`: rows
freed, pages appended (a joining row's whole table, a growing row's new pages), and the step's
row selection with its tokens. `BatchTables` applies a delta and gathers the step's
`StepInput` with tensor ops; under tensor parallelism every rank keeps its own `BatchTables`
and receives only the deltas. Positions are not state: the scheduler owns progress, so each
step sends its rows' starts (computed tokens) and every rank derives the positions.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields

import torch

from pagedserve.scheduler import SchedulerOutput
from pagedserve.sequence import Sequence


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@dataclass
class StepInput:
    """A step's flat inputs as plain host tensors, in the layout attention needs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q_lens: torch.Tensor  # [B] new tokens of each row, single-token rows (decodes) first
    context_lens: torch.Tensor  # [B] computed + new tokens
    block_tables: torch.Tensor  # [B, max_pages], int64, zero past a row's pages
    sample_tokens: torch.Tensor  # [S] index among the T of each sampled row's last token


@dataclass
class StepDelta:
    """What one step changes in the batch state, and the step itself (all int64, 1-D)."""

    freed_rows: torch.Tensor  # [F] rows whose sequence left (finished, aborted, preempted)
    page_rows: torch.Tensor  # [P] row of each appended page
    page_cols: torch.Tensor  # [P] its index in the row's block table
    page_ids: torch.Tensor  # [P]
    rows: torch.Tensor  # [B] the step's rows, decodes first
    q_lens: torch.Tensor  # [B]
    starts: torch.Tensor  # [B] tokens already computed
    input_ids: torch.Tensor  # [T]
    sample_tokens: torch.Tensor  # [S]

    def sizes(self) -> list[int]:
        return [len(getattr(self, f.name)) for f in fields(self)]

    def pack(self) -> torch.Tensor:
        """One tensor of every part in order (`StepDelta(*packed.split(sizes))` rebuilds it)."""
        return torch.cat([getattr(self, f.name) for f in fields(self)])


class RowPlanner:
    """Rank 0's bookkeeping: which row each running sequence holds, and how many of its pages
    the tables already have. Rows are reused lowest first, so the tables stay compact."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = []  # a heap of released rows
        self._num_rows = 0
        self._known_pages: list[int] = []  # per row: pages sent to the tables

    def _join(self, seq_id: int) -> int:
        if self._free:
            row = heapq.heappop(self._free)
        else:
            row = self._num_rows
            self._num_rows += 1
            self._known_pages.append(0)
        self.rows[seq_id] = row
        return row

    def plan(self, out: SchedulerOutput, sample_rows: list[int]) -> StepDelta:
        """The delta of a step; `sample_rows` index `out.scheduled`, as the logits will."""
        # A sequence that left before any step of it ran (that step failed) holds no row.
        freed = [r for r in (self.rows.pop(i, None) for i in out.released) if r is not None]
        for row in freed:
            self._known_pages[row] = 0
            heapq.heappush(self._free, row)
        page_rows: list[int] = []
        page_cols: list[int] = []
        page_ids: list[int] = []
        # Decodes first, then chunks, each in the scheduler's order (the layout attention needs).
        decodes, chunks = _Group(), _Group()
        place: list[tuple[_Group, int]] = []  # scheduled index -> its group and place there
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self._join(seq.seq_id)
            known, table = self._known_pages[row], seq.block_table
            if len(table) > known:
                page_rows += [row] * (len(table) - known)
                page_cols += range(known, len(table))
                page_ids += table[known:]
                self._known_pages[row] = len(table)
            group = decodes if n == 1 else chunks
            place.append((group, len(group.rows)))
            group.add(row, n, seq.num_computed_tokens, seq)
        lens = _long(decodes.lens + chunks.lens)
        last_token = torch.cumsum(lens, 0) - 1
        nd = len(decodes.rows)
        sampled = [i + (nd if g is chunks else 0) for g, i in (place[r] for r in sample_rows)]
        return StepDelta(
            _long(freed),
            _long(page_rows),
            _long(page_cols),
            _long(page_ids),
            _long(decodes.rows + chunks.rows),
            lens,
            _long(decodes.starts + chunks.starts),
            _long(decodes.ids + chunks.ids),
            last_token[sampled],
        )


@dataclass
class _Group:
    """Rows of one kind (decodes or chunks) as the planner collects them."""

    rows: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def add(self, row: int, n: int, start: int, seq: Sequence) -> None:
        self.rows.append(row)
        self.lens.append(n)
        self.starts.append(start)
        self.ids += seq.token_ids_slice(start, start + n)


def _grown(need: int, have: int) -> int:
    return have if need <= have else max(need, 2 * have)


class BatchTables:
    """Block tables by row, [rows, pages] int64, grown by doubling as rows or pages need; each
    rank holds one and changes it only by `apply`."""

    def __init__(self) -> None:
        self.tables = torch.zeros(0, 0, dtype=torch.long)
        self.num_pages = torch.zeros(0, dtype=torch.long)  # per row: pages in its table

    def _fit(self, rows: int, cols: int) -> None:
        have_rows, have_cols = self.tables.shape
        if rows <= have_rows and cols <= have_cols:
            return
        tables = torch.zeros(_grown(rows, have_rows), _grown(cols, have_cols), dtype=torch.long)
        tables[:have_rows, :have_cols] = self.tables
        num_pages = torch.zeros(len(tables), dtype=torch.long)
        num_pages[:have_rows] = self.num_pages
        self.tables, self.num_pages = tables, num_pages

    def apply(self, delta: StepDelta) -> StepInput:
        """Apply a step's changes, then gather its inputs from the scheduled rows."""
        d = delta
        if len(d.freed_rows):
            self.tables.index_fill_(0, d.freed_rows, 0)
            self.num_pages.index_fill_(0, d.freed_rows, 0)
        if len(d.page_rows):
            self._fit(int(d.page_rows.max()) + 1, int(d.page_cols.max()) + 1)
            self.tables[d.page_rows, d.page_cols] = d.page_ids
            self.num_pages.scatter_reduce_(0, d.page_rows, d.page_cols + 1, "amax")
        width = int(self.num_pages[d.rows].max()) if len(d.rows) else 0
        tables = self.tables[:, :width].index_select(0, d.rows)
        row = torch.repeat_interleave(torch.arange(len(d.rows)), d.q_lens)
        first_token = torch.cumsum(d.q_lens, 0) - d.q_lens
        positions = d.starts[row] + torch.arange(len(d.input_ids)) - first_token[row]
        context = d.starts + d.q_lens
        return StepInput(d.input_ids, positions, d.q_lens, context, tables, d.sample_tokens)
