"""One request's output, accumulated from the engine's deltas.

This is the one place that knows what a request has produced so far: the offline `LLM`, the
HTTP completions and chat renderers and gRPC all feed the engine's `RequestDelta`s into a
`RequestStream` and render its events (what is new since the last update) or its totals
(the whole output, usage). Appending a delta costs its own size, never the output's length.

A per-completion `OutputProcessor` sees every delta before it is recorded: the seam for a
parser that turns text deltas into other content (tool calls) without front-end changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from pagedserve.outputs import (
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    ToolCall,
    Usage,
)


class OutputProcessor(Protocol):
    """Rewrites one completion's deltas, in order, before they are recorded and rendered."""

    def process(self, delta: CompletionDelta) -> CompletionDelta: ...


class ChoiceStream:
    """One completion's totals so far."""

    def __init__(self, index: int, logprobs: bool):
        self.index = index
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, delta: CompletionDelta) -> None:
        if delta.text:
            self._parts.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        for call in delta.tool_calls or []:
            if self.tool_calls is None:
                self.tool_calls = []
            if call.index == len(self.tool_calls):
                self.tool_calls.append(ToolCall(call.id or "", call.name or "", ""))
            self.tool_calls[call.index].arguments += call.arguments
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.finish_reason,
            self.stop_reason,
            list(self.logprobs) if self.logprobs is not None else None,
            list(self.tool_calls) if self.tool_calls is not None else None,
        )


class RequestStream:
    """The output of one engine request (its `n` completions), fed by `update`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        n: int = 1,
        prompt: str | None = None,
        logprobs: bool = False,
        processor: Callable[[int], OutputProcessor] | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [ChoiceStream(i, logprobs) for i in range(n)]
        self._processors = [processor(i) for i in range(n)] if processor else None
        self.finished = False
        self.metrics: RequestMetrics | None = None
        # What the latest update added, one merged delta per completion, in index order.
        self.events: list[CompletionDelta] = []

    def update(self, deltas: Iterable[RequestDelta]) -> list[CompletionDelta]:
        merged: dict[int, CompletionDelta] = {}
        for d in deltas:
            for c in d.completions:
                choice = self.outputs[c.index]
                if choice.finished:
                    continue
                if self._processors is not None:
                    c = self._processors[c.index].process(c)
                choice.add(c)
                if c.index in merged:
                    merged[c.index].extend(c)
                else:  # a copy: merging extends it in place
                    lps = list(c.logprobs) if c.logprobs is not None else None
                    calls = [replace(t) for t in c.tool_calls] if c.tool_calls else None
                    merged[c.index] = replace(
                        c, token_ids=list(c.token_ids), logprobs=lps, tool_calls=calls
                    )
            if d.finished:
                self.finished, self.metrics = True, d.metrics
        self.events = [merged[i] for i in sorted(merged)]
        return self.events

    def abort(self) -> list[CompletionDelta]:
        """End the stream here (its consumer left): unfinished completions end 'abort'."""
        live = [c.index for c in self.outputs if not c.finished]
        done = RequestDelta(self.request_id, [abort_delta(i) for i in live], finished=True)
        return self.update([done])

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), sum(len(c.token_ids) for c in self.outputs))

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.output() for c in self.outputs],
            self.finished,
            self.metrics,
        )


def abort_delta(index: int) -> CompletionDelta:
    return CompletionDelta(index, "", [], finish_reason="abort")
