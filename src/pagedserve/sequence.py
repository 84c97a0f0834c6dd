"""A sequence: one completion being generated, with its KV pages and detokenizer state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The constraint left no token to sample (e.g. it is complete but min_tokens forbids EOS).
    FINISHED_GRAMMAR = "grammar_dead_end"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
            SequenceStatus.FINISHED_GRAMMAR,
        )


class TokenConstraint(Protocol):
    """Limits which tokens a sequence may sample next (the seam for a grammar: structured
    output). Its masks are filled for a whole step at once while the forward pass runs and
    applied to the logits as one tensor op; the engine reports each sampled token."""

    def fill_mask(self, words: torch.Tensor) -> None:
        """Write the tokens that may come next into `words` ([ceil(vocab / 32)] int32, token t
        allowed when bit t % 32 of word t // 32 is set); may run on another thread."""
        ...

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; False when the constraint cannot accept it."""
        ...

    def is_complete(self) -> bool:
        """Nothing but the end of the output can follow."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state (one per completion of a request)."""
        ...


@dataclass(eq=False)
class Sequence:
    """One of a request's `n` completions; the unit the scheduler and block manager see."""

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # How many of prompt + output tokens already have K/V in this sequence's pages (written
    # only by the scheduler).
    num_computed_tokens: int = 0
    # Of those, how many came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Of its full pages, how many the block manager has offered to the prefix cache.
    num_registered_pages: int = 0
    # Chained hashes of this sequence's full pages, in order (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Advanced by every output token; it lives on the sequence, so preemption by recompute
    # (which keeps the output tokens) keeps its state.
    constraint: TokenConstraint | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: str | int | None = None
    # Incremental detokenizer state, read and written only by detokenizer.py.
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    emitted_text_len: int = 0  # how much of output_text was handed out

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status.finished
