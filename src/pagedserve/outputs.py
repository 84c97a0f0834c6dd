"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> logprob (the sampled token is always present).
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'grammar_dead_end'
    stop_reason: str | int | None = None  # the stop string or stop token id that fired
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)
