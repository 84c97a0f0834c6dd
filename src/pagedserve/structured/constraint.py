"""A compiled grammar as a sequence's `TokenConstraint`: one llguidance matcher."""

from __future__ import annotations

import llguidance
import torch


class GrammarConstraint:
    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_mask(self, words: torch.Tensor) -> None:
        # llguidance writes the mask in place and drops the GIL while it works.
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_complete(self) -> bool:
        return self._matcher.is_stopped()

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self._matcher.deep_copy())
