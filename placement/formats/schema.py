"""A tiny declarative schema: one description of each file format that both validates input (with
errors naming the file and field path, and near-miss suggestions for unknown keys) and publishes a
JSON Schema (``placement/schemas/*.schema.json``).

Only what the formats need: objects with known keys, integers and numbers with bounds, strings
with choices, booleans, and lists (with element schemas and length bounds).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from placement.core.model import InvalidInputError

__all__ = ["Int", "Num", "Str", "Bool", "List", "Obj", "Any_", "validate", "to_json_schema"]


@dataclass(frozen=True)
class Int:
    desc: str
    minimum: int | None = None
    maximum: int | None = None
    unit: str = ""


@dataclass(frozen=True)
class Num:
    desc: str
    minimum: float | None = None
    exclusive_minimum: float | None = None
    unit: str = ""


@dataclass(frozen=True)
class Str:
    desc: str
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Bool:
    desc: str


@dataclass(frozen=True)
class Any_:
    """A free-form JSON object (provenance, parameters)."""

    desc: str


@dataclass(frozen=True)
class List:
    desc: str
    item: Any
    min_items: int = 0


@dataclass(frozen=True)
class Obj:
    desc: str
    fields: dict[str, Any]
    optional: frozenset[str] = field(default_factory=frozenset)


def _err(where: str, path: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{where}: {path or '<root>'}: {msg}")


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(value: Any, spec: Any, where: str, path: str = "") -> None:
    """Raise :class:`InvalidInputError` naming ``where`` (a file) and the field path on mismatch."""
    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            raise _err(where, path, f"expected an object, found {_type_name(value)}")
        for key in value:
            if key not in spec.fields:
                near = difflib.get_close_matches(key, list(spec.fields), n=1, cutoff=0.6)
                hint = f" (did you mean '{near[0]}'?)" if near else ""
                raise _err(where, f"{path}.{key}" if path else key, f"unknown key{hint}")
        for key, sub in spec.fields.items():
            sub_path = f"{path}.{key}" if path else key
            if key not in value:
                if key in spec.optional:
                    continue
                raise _err(where, sub_path, "missing required key")
            validate(value[key], sub, where, sub_path)
    elif isinstance(spec, Int):
        if not isinstance(value, int) or isinstance(value, bool):
            raise _err(where, path, f"expected an integer, found {_type_name(value)} {_short(value)}")
        if spec.minimum is not None and value < spec.minimum:
            raise _err(where, path, f"expected an integer >= {spec.minimum}, found {value}")
        if spec.maximum is not None and value > spec.maximum:
            raise _err(where, path, f"expected an integer <= {spec.maximum}, found {value}")
    elif isinstance(spec, Num):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _err(where, path, f"expected a number, found {_type_name(value)} {_short(value)}")
        if not math.isfinite(value):
            raise _err(where, path, f"expected a finite number, found {value}")
        if spec.minimum is not None and value < spec.minimum:
            raise _err(where, path, f"expected a number >= {spec.minimum}, found {value}")
        if spec.exclusive_minimum is not None and value <= spec.exclusive_minimum:
            raise _err(where, path, f"expected a number > {spec.exclusive_minimum}, found {value}")
    elif isinstance(spec, Str):
        if not isinstance(value, str):
            raise _err(where, path, f"expected a string, found {_type_name(value)} {_short(value)}")
        if spec.choices is not None and value not in spec.choices:
            raise _err(where, path, f"expected one of {', '.join(spec.choices)}, found {value!r}")
    elif isinstance(spec, Bool):
        if not isinstance(value, bool):
            raise _err(where, path, f"expected true or false, found {_type_name(value)} {_short(value)}")
    elif isinstance(spec, List):
        if not isinstance(value, list):
            raise _err(where, path, f"expected an array, found {_type_name(value)} {_short(value)}")
        if len(value) < spec.min_items:
            raise _err(where, path, f"expected at least {spec.min_items} items, found {len(value)}")
        for i, item in enumerate(value):
            validate(item, spec.item, where, f"{path}[{i}]")
    elif isinstance(spec, Any_):
        if not isinstance(value, dict):
            raise _err(where, path, f"expected an object, found {_type_name(value)}")
    else:  # pragma: no cover - a programming error in a spec
        raise TypeError(f"unknown spec {spec!r}")


def _describe(desc: str, unit: str = "") -> str:
    return f"{desc} [{unit}]" if unit else desc


def to_json_schema(spec: Any, title: str | None = None) -> dict:
    """The JSON Schema (draft 2020-12) equivalent of ``spec``."""
    out: dict[str, Any]
    if isinstance(spec, Obj):
        out = {
            "type": "object",
            "description": spec.desc,
            "properties": {k: to_json_schema(v) for k, v in spec.fields.items()},
            "required": [k for k in spec.fields if k not in spec.optional],
            "additionalProperties": False,
        }
    elif isinstance(spec, Int):
        out = {"type": "integer", "description": _describe(spec.desc, spec.unit)}
        if spec.minimum is not None:
            out["minimum"] = spec.minimum
        if spec.maximum is not None:
            out["maximum"] = spec.maximum
    elif isinstance(spec, Num):
        out = {"type": "number", "description": _describe(spec.desc, spec.unit)}
        if spec.minimum is not None:
            out["minimum"] = spec.minimum
        if spec.exclusive_minimum is not None:
            out["exclusiveMinimum"] = spec.exclusive_minimum
    elif isinstance(spec, Str):
        out = {"type": "string", "description": spec.desc}
        if spec.choices is not None:
            out["enum"] = list(spec.choices)
    elif isinstance(spec, Bool):
        out = {"type": "boolean", "description": spec.desc}
    elif isinstance(spec, List):
        out = {"type": "array", "description": spec.desc, "items": to_json_schema(spec.item)}
        if spec.min_items:
            out["minItems"] = spec.min_items
    elif isinstance(spec, Any_):
        out = {"type": "object", "description": spec.desc}
    else:  # pragma: no cover
        raise TypeError(f"unknown spec {spec!r}")
    if title is not None:
        out = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **out}
    return out
