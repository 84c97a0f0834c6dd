"""Per-step mask filling: every constrained row's bitmask, computed in a worker thread while
the model's forward pass runs (a mask is needed only at sampling). llguidance drops the GIL
while it fills a mask, so the two overlap.

One thread fills the rows one after another. llguidance's parallel executor (a rayon pool) was
measured slower here: on a CPU host its threads compete with the forward pass's OpenMP threads
for the same cores (32 constrained sequences: 30-46 output tok/s against 80-93 filled by one
thread and 88-98 unconstrained, in an offline comparison on a shared 2-core machine).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedserve.sequence import Sequence, TokenConstraint
from pagedserve.structured.bitmask import StepMask


class MaskFiller:
    def __init__(self, vocab_size: int):
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-mask")

    def start(self, seqs: Seq[Sequence]) -> Future[StepMask] | None:
        """Begin filling the masks of `seqs`' constrained rows; None if none has a constraint."""
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None
        return self._pool.submit(self._fill, [seqs[i].constraint for i in rows], rows)

    def _fill(self, constraints: list[TokenConstraint], rows: list[int]) -> StepMask:
        bits = torch.empty(len(rows), self.words, dtype=torch.int32)
        for k, constraint in enumerate(constraints):
            constraint.fill_mask(bits[k])
        return StepMask(torch.tensor(rows, dtype=torch.long), bits)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
