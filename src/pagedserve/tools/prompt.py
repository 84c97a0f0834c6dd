"""Tools and tool turns in the prompt.

A chat template that renders `tools` itself (transformers' `apply_chat_template(tools=...)`)
gets them as they are. For one that does not (the default model's), the conversation is
rewritten into turns every template renders, in the Hermes format: the tool descriptions
appended to the system turn, assistant calls as `<tool_call>` blocks, tool results as a user
turn of `<tool_response>` blocks (what Qwen2.5's template produces).
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _arguments(call: Message) -> Any:
    """A call's arguments as an object (they travel as a JSON string)."""
    args = call["function"].get("arguments") or "{}"
    try:
        return json.loads(args)
    except ValueError:
        return args


def render_call(call: Message) -> str:
    body = json.dumps({"name": call["function"]["name"], "arguments": _arguments(call)})
    return f"<tool_call>\n{body}\n</tool_call>"


def for_template(
    messages: list[Message], tools: list[Message] | None, renders_tools: bool
) -> tuple[list[Message], dict[str, Any]]:
    """The conversation and the extra apply_chat_template arguments for this template."""
    if renders_tools:
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"] = {**call["function"], "arguments": _arguments(call)}
        return messages, ({"tools": tools} if tools else {})
    return _hermes_turns(messages, tools), {}


def _hermes_turns(messages: list[Message], tools: list[Message] | None) -> list[Message]:
    out: list[Message] = []
    if tools:
        block = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            block = f"{messages[0]['content']}\n\n{block}"
            messages = messages[1:]
        out.append({"role": "system", "content": block})
    previous_was_tool = False
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous_was_tool:  # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            previous_was_tool = True
            continue
        previous_was_tool = False
        turn = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls := m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            turn["content"] = "\n".join(parts + [render_call(c) for c in calls])
        out.append(turn)
    return out
