"""What the engine hands back: per-step deltas, and the whole outputs built from them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# One position's logprobs: token id -> logprob (the sampled token is always present).
TokenLogprobs = dict[int, float]


@dataclass
class ToolCallDelta:
    """A fragment of a tool call being streamed: its id and name come once, in its first."""

    index: int  # which of the completion's calls
    arguments: str  # the next piece of the arguments' JSON text
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class CompletionDelta:
    """What one completion gained in one step (or in several, merged)."""

    index: int
    text: str  # new text safe to show (held back while a stop string may still be forming)
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one entry per new token, when asked for
    # 'stop' | 'length' | 'abort' | 'grammar_dead_end' | 'tool_calls' (set by the tool parser)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that fired
    tool_calls: list[ToolCallDelta] | None = None  # set by a tool-call output processor

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: CompletionDelta) -> None:
        """Append a later delta of the same completion."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += later.logprobs
        for call in later.tool_calls or []:
            if self.tool_calls is None:
                self.tool_calls = []
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(replace(call))
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestDelta:
    """One step's news for one request: the completions that changed, in index order."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    metrics: RequestMetrics | None = None  # set on the last delta of a request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # as CompletionDelta's
    stop_reason: str | int | None = None  # the stop string or stop token id that fired
    logprobs: list[TokenLogprobs] | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )
