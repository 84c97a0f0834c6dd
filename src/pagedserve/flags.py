"""Command-line flags from config dataclasses: one flag per field, and the dataclass back."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def _flag_type(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset()
) -> None:
    """One flag per field: --field-name, help from the field's metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _flag_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            continue
        parser.add_argument(
            flag,
            type=tp,
            default=f.default,
            choices=f.metadata.get("choices"),
            help=f"{help_text} (default: {f.default})",
        )


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
