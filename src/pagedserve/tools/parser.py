"""Reads Hermes tool calls out of generated text, incrementally.

`parse` maps the text so far to what is safe to show: the content outside tool-call blocks and
each call's name and arguments, holding back any tail that may still turn out to be markup (a
partial `<tool_call>`, the wrapper's closing brace, a partial `</tool_call>`). What it returns
for a longer text extends what it returned for a shorter one, so `ToolCallProcessor` (the
output processor of a chat completion whose tool calls are read) sends the differences as
OpenAI's deltas, and a whole response is the sum of its deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace

from pagedserve.outputs import CompletionDelta, ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The wrapper object up to its arguments: the name is known once "arguments" follows it.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:'
)
_TRAILER = re.compile(r"\s*\}?\s*$")  # the wrapper's closing brace after the arguments


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it (or its prefix so far)


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(body: str, closed: bool) -> ParsedCall | None:
    if m := _HEADER.match(body):
        name = json.loads(f'"{m.group(1)}"')
        args = body[m.end() :]
        if not closed:
            args = args[: len(args) - _partial_tag(args, CLOSE)]
        return ParsedCall(name, args[: _TRAILER.search(args).start()].lstrip())
    if closed:  # arguments before the name: read the whole block
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            return ParsedCall(obj["name"], json.dumps(obj.get("arguments", {})))
    return None


def parse(text: str, final: bool) -> Parsed:
    """`final`: the text is complete (a trailing partial `<tool_call>` is then content)."""
    out = Parsed("")
    pos, after_call = 0, False
    while True:
        start = text.find(OPEN, pos)
        segment = text[pos:] if start < 0 else text[pos:start]
        if start < 0 and not final:
            segment = segment[: len(segment) - _partial_tag(segment, OPEN)]
        out.content += segment.lstrip() if after_call else segment
        if start < 0:
            return out
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        call = _call(text[body_start : end if end >= 0 else len(text)], closed=end >= 0)
        if call is not None:
            out.calls.append(call)
        if end < 0:  # inside an unfinished block: nothing after it is content yet
            return out
        if call is None:  # a finished block that holds no call is what the model said
            out.content += text[start : end + len(CLOSE)]
        pos, after_call = end + len(CLOSE), True


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallProcessor:
    """A completion's `OutputProcessor` when tool calls are parsed: text deltas in; content,
    tool-call deltas and the finish reason `tool_calls` out."""

    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    def process(self, delta: CompletionDelta) -> CompletionDelta:
        self._text += delta.text
        parsed = parse(self._text, final=delta.finished)
        content = parsed.content[self._content_sent :]
        self._content_sent = len(parsed.content)
        calls = []
        for k, call in enumerate(parsed.calls):
            if k == len(self._ids):
                self._ids.append(new_call_id())
                self._args_sent.append(0)
                calls.append(ToolCallDelta(k, "", self._ids[k], call.name))
            if fragment := call.arguments[self._args_sent[k] :]:
                self._args_sent[k] = len(call.arguments)
                calls.append(ToolCallDelta(k, fragment))
        finish = delta.finish_reason
        if finish == "stop" and self._ids:
            finish = "tool_calls"
        return replace(delta, text=content, tool_calls=calls or None, finish_reason=finish)
