"""The JSON layout every exporter writes, and the checks its readers share."""

from __future__ import annotations

import json

import numpy as np

from placement.core.model import InvalidInputError


def _json_text(doc: dict) -> str:
    # One line per innermost list keeps large maps readable and diffable.
    return _compact(doc) + "\n"


def _compact(value, indent: int = 0) -> str:
    """JSON with scalars and short rows inline: one line per layer of a map, per key of an object."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad} {json.dumps(str(k))}: {_compact(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if _inline(value):
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    items = [pad + " " + _compact(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def _inline(value) -> bool:
    """Scalars, flat lists, and lists of short flat lists (e.g. vLLM's (E, R + 1) per layer)."""
    if not isinstance(value, list):
        return not isinstance(value, dict)
    if all(not isinstance(v, (list, dict)) for v in value):
        return len(value) <= 1 or not any(isinstance(v, str) for v in value)
    return all(isinstance(v, list) and len(v) <= 4 and all(not isinstance(x, (list, dict)) for x in v) for v in value)


def _as_doc(doc: dict | str, what: str) -> dict:
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{what}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{what}: expected a JSON object, found {type(doc).__name__}")
    return doc


def _int_matrix(rows, where: str) -> np.ndarray:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise InvalidInputError(f"{where}: expected a non-empty list of rows")
    if len({len(r) for r in rows}) != 1:
        raise InvalidInputError(f"{where}: rows have different lengths")
    if not all(isinstance(x, int) and not isinstance(x, bool) for r in rows for x in r):
        raise InvalidInputError(f"{where}: expected integers")
    return np.asarray(rows, dtype=np.int64)
