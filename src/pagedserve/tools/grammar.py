"""The grammar that forces tool calls (tool_choice "required" or a named function): one or
more Hermes blocks whose JSON is {"name": <a tool>, "arguments": <that tool's parameters>},
so the arguments always validate against the tool's schema."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.structured.spec import JSON_OPTIONS, StructuredSpec

_NO_PARAMETERS = {"type": "object", "properties": {}}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMETERS


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON of one call to any of `tools` (name first, so parsers see it first)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": parameters_schema(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def tool_call_spec(tools: list[dict[str, Any]], multiple: bool) -> StructuredSpec:
    """`multiple`: any number of calls (parallel_tool_calls), else exactly one."""
    calls = 'call ("\\n" call)*' if multiple else "call"
    lark = (
        f"start: {calls}\n"
        f'call: "<tool_call>\\n" %json {json.dumps(call_schema(tools))} "\\n</tool_call>"\n'
    )
    return StructuredSpec("grammar", lark)
