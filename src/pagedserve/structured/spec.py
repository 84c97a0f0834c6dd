"""What a request constrains its output to, as plain hashable data (the grammar cache's key)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "regex", "choice", "grammar"]

# Compact JSON in json.dumps' default style: what models have seen most, and no room for the
# runs of whitespace that flexible-whitespace grammars let small models fall into. (Lark
# grammars' %json blocks take the same options as their "x-guidance" key.)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredSpec:
    kind: Kind
    # json: the schema as canonical JSON text; regex: the pattern; choice: the JSON list of
    # strings; grammar: Lark text (llguidance's dialect, which also embeds %json schemas).
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredSpec:
        return cls("json", json.dumps(schema, sort_keys=False, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(options)))
