"""TOML text of a recipe (``Recipe.to_dict()``): the file ``megaseq import`` writes beside its checkpoint."""

from __future__ import annotations

import json
import math
from typing import Any


def _value(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"recipe key {key}: {value} has no TOML form megaseq writes")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v, key) for v in value) + "]"
    raise ValueError(f"recipe key {key}: cannot write a {type(value).__name__} as TOML")


def dumps(data: dict[str, Any]) -> str:
    """TOML for nested tables of scalars and lists (None values are left out: the default applies)."""
    lines: list[str] = []

    def table(path: list[str], node: dict[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict) and v is not None}
        if path and (scalars or not any(isinstance(v, dict) for v in node.values())):
            lines.append(("\n" if lines else "") + "[" + ".".join(path) + "]")
        for key, value in scalars.items():
            lines.append(f"{key} = {_value(value, '.'.join([*path, key]))}")
        for key, value in node.items():
            if isinstance(value, dict):
                table([*path, key], value)

    table([], data)
    return "\n".join(lines) + "\n"
