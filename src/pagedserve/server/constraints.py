"""What a request asks of its output's shape: response_format, vLLM's structured_outputs, tools
and tool_choice, turned into the grammar the engine enforces and what the response reads.

Bad combinations are 400s naming the field; the plan's grammars are compiled (off the event
loop, into the engine's cache, by `OpenAIServing.compile_grammars`) before a request is
admitted, so a schema the backend cannot build is a 400 naming the field and the keyword,
never an error mid-stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server import protocol as P
from pagedserve.server.errors import bad_request
from pagedserve.structured.spec import StructuredSpec
from pagedserve.tools.grammar import parameters_schema, tool_call_spec

# A grammar to compile before admission, and the request field its failure names.
Check = tuple[StructuredSpec, str]


@dataclass
class OutputPlan:
    spec: StructuredSpec | None = None  # the grammar every completion must follow
    checks: list[Check] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # rendered into the prompt
    parse_tools: bool = False  # read tool calls out of the text


def _structured_outputs(so: P.StructuredOutputs) -> Check:
    fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
    given = [(k, v) for k, v in fields.items() if v is not None]
    if len(given) != 1:
        raise bad_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar",
            "structured_outputs",
        )
    ((key, value),) = given
    param = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"{param} is not valid JSON", param) from None
        return StructuredSpec.json_schema(value), param
    if key == "choice":
        if not value or not all(value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredSpec.choice(value), param
    return StructuredSpec(key, value), param


def output_constraint(req: P._SamplingFields) -> Check | None:
    """The grammar response_format or structured_outputs asks for, with its field."""
    found: list[Check] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredSpec.json_schema({"type": "object"}), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request(
                "response_format.json_schema is required when type is json_schema",
                "response_format.json_schema",
            )
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append((StructuredSpec.json_schema(schema), "response_format.json_schema.schema"))
    if req.structured_outputs is not None:
        found.append(_structured_outputs(req.structured_outputs))
    if len(found) > 1:
        raise bad_request(
            "set response_format or structured_outputs, not both", "structured_outputs"
        )
    return found[0] if found else None


def completion_plan(req: P.CompletionRequest) -> OutputPlan:
    constraint = output_constraint(req)
    return OutputPlan(constraint[0], [constraint]) if constraint else OutputPlan()


def chat_plan(req: P.ChatCompletionRequest) -> OutputPlan:
    constraint = output_constraint(req)
    choice = req.tool_choice or ("auto" if req.tools else "none")
    if choice != "none" and not req.tools:
        raise bad_request("tool_choice other than none requires tools", "tool_choice")
    if choice == "none":
        return OutputPlan(constraint[0], [constraint]) if constraint else OutputPlan()
    if constraint is not None:
        raise bad_request(
            f"{constraint[1]} cannot be combined with tool_choice {choice!r} "
            "(use tool_choice none, or a tool whose parameters are the schema)",
            constraint[1],
        )
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if choice == "auto":  # the model chooses; its markup is parsed
        return OutputPlan(tools=tools, parse_tools=True)
    forced = list(range(len(tools)))
    if isinstance(choice, P.NamedToolChoice):
        name = choice.function.name
        forced = [i for i, t in enumerate(tools) if t["function"]["name"] == name]
        if not forced:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among tools", "tool_choice"
            )
    multiple = choice == "required" and req.parallel_tool_calls is not False
    spec = tool_call_spec([tools[i] for i in forced], multiple)
    checks = [
        (StructuredSpec.json_schema(parameters_schema(tools[i])), f"tools[{i}].function.parameters")
        for i in forced
    ]
    return OutputPlan(spec, [*checks, (spec, "tools")], tools, parse_tools=True)
