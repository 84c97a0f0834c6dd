"""Per-step mask filling: every constrained row's bitmask, computed by llguidance's parallel
executor in a worker thread while the model's forward pass runs (a mask is needed only at
sampling). llguidance drops the GIL for the fill, so the two overlap."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from pagedserve.sequence import Sequence
from pagedserve.structured.bitmask import StepMask


class MaskFiller:
    def __init__(self, vocab_size: int):
        self.words = (vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-mask")

    def start(self, seqs: Seq[Sequence]) -> Future[StepMask] | None:
        """Begin filling the masks of `seqs`' constrained rows; None if none has a grammar."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        matchers = [seqs[i].grammar for i in rows]
        return self._pool.submit(self._fill, matchers, rows)

    def _fill(self, matchers: list[llguidance.LLMatcher], rows: list[int]) -> StepMask:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bits = torch.empty(len(rows), self.words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, m in enumerate(matchers)], bits.data_ptr(), self.words * 4, len(rows)
        )
        return StepMask(torch.tensor(rows, dtype=torch.long), bits)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
