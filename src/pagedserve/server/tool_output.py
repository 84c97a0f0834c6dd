"""Tool calls read out of a completion's text, in OpenAI's response and stream shapes."""

from __future__ import annotations

from pagedserve.outputs import CompletionOutput
from pagedserve.server import protocol as P
from pagedserve.tools.parser import ToolCallStream, new_call_id, parse


def _finish_reason(o: CompletionOutput, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and o.finish_reason == "stop" else o.finish_reason


def response_message(
    o: CompletionOutput, parse_tools: bool
) -> tuple[P.ChatResponseMessage, str | None]:
    """A finished completion as the assistant's message, and its finish reason."""
    if not parse_tools:
        return P.ChatResponseMessage(content=o.text), o.finish_reason
    parsed = parse(o.text, final=True)
    if not parsed.calls:
        return P.ChatResponseMessage(content=parsed.content), o.finish_reason
    calls = [
        P.ResponseToolCall(
            id=new_call_id(), function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments)
        )
        for c in parsed.calls
    ]
    message = P.ChatResponseMessage(content=parsed.content.strip() or None, tool_calls=calls)
    return message, _finish_reason(o, True)


class ToolCallRenderer:
    """One streamed choice: each output's new text as a delta of content and tool calls."""

    def __init__(self) -> None:
        self._stream = ToolCallStream()

    def delta(self, o: CompletionOutput) -> tuple[P.DeltaMessage, str | None]:
        content, calls = self._stream.update(o.text, final=o.finished)
        deltas = [
            P.DeltaToolCall(
                index=d.index,
                id=d.id,
                type="function" if d.id else None,
                function=P.DeltaFunctionCall(name=d.name, arguments=d.arguments),
            )
            for d in calls
        ]
        message = P.DeltaMessage(content=content or None, tool_calls=deltas or None)
        return message, _finish_reason(o, bool(self._stream.ids))
