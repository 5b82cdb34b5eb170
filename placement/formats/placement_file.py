"""The placement file (JSON): the document a solve writes, its writer and its reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from placement.core.model import Instance, Placement
from placement.core.pipeline_layout import parse_layout, render_layout
from placement.formats.files import atomic_write_text
from placement.formats.instance import _fail, _load_json
from placement.formats.schema import validate
from placement.formats.spec import PLACEMENT_SCHEMA_VERSION, PLACEMENT_SPEC

# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
def placement_document(
    instance: Instance,
    placement: Placement,
    *,
    solver: str,
    params: dict | None = None,
    seed: int = 0,
    consumer: str = "none",
    group_preserving: bool = False,
    metrics: dict | None = None,
    solve: dict | None = None,
    apply: str | None = None,
    replicas: dict | None = None,
    pipeline_layout: tuple[str, ...] = (),
) -> dict:
    """The JSON document of a placement (deterministic: no wall-clock values).

    ``replicas``: the block of :func:`placement.formats.replicas.replicas_document`.
    ``pipeline_layout``: the chunk list the placement was scored with, when it differs from the
    instance's or the instance has one (written as ``pipeline_model_parallel_layout``).
    """
    doc = {
        "schema_version": PLACEMENT_SCHEMA_VERSION,
        "kind": "placement",
        "instance": {"name": instance.name, "sha256": instance.sha256},
        "solver": solver,
        "params": params or {},
        "seed": seed,
        "consumer": consumer,
        "group_preserving": group_preserving,
        **({"apply": apply} if apply is not None else {}),
        **({"pipeline_model_parallel_layout": render_layout(pipeline_layout or placement.pipeline_layout)}
           if pipeline_layout or placement.pipeline_layout else {}),
        "rank2gpu": [int(x) for x in placement.rank2gpu],
        "phy2log": [[int(x) for x in row] for row in placement.phy2log],
        "metrics": metrics or {},
        "solve": solve or {},
    }
    if replicas is not None:
        doc["replicas"] = replicas
    return doc


def write_placement(path: str | os.PathLike, doc: dict) -> None:
    """Write a placement document atomically, with compact per-layer rows."""
    atomic_write_text(path, _placement_text(doc))


def _placement_text(doc: dict) -> str:
    # Compact: one line for rank2gpu and one per layer, readable diffs, a small file.
    body = dict(doc)
    rank2gpu = body.pop("rank2gpu")
    phy2log = body.pop("phy2log")
    replicas = body.pop("replicas", None)
    text = json.dumps(body, indent=1, sort_keys=True, allow_nan=False)
    assert text.endswith("}")
    lines = [text[:-1].rstrip() + ","]
    lines.append(' "rank2gpu": ' + json.dumps(rank2gpu, separators=(",", ":")) + ",")
    lines.append(' "phy2log": [')
    for i, row in enumerate(phy2log):
        sep = "," if i + 1 < len(phy2log) else ""
        lines.append("  " + json.dumps(row, separators=(",", ":")) + sep)
    lines.append(" ]" + ("," if replicas is not None else ""))
    if replicas is not None:  # the same for the replica block's (L, E + N) map, written last
        rest = {k: v for k, v in replicas.items() if k != "phy2log"}
        lines.append(' "replicas": {')
        for key in sorted(rest):
            lines.append(f"  {json.dumps(key)}: {json.dumps(rest[key], sort_keys=True, allow_nan=False)},")
        lines.append('  "phy2log": [')
        rows = replicas["phy2log"]
        for i, row in enumerate(rows):
            lines.append("   " + json.dumps(row, separators=(",", ":")) + ("," if i + 1 < len(rows) else ""))
        lines.append("  ]")
        lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def read_placement(path: str | os.PathLike) -> tuple[Placement, dict]:
    """Read a placement file: the structural check only (use :func:`placement.core.checker.check`).

    Returns the :class:`Placement` and the whole document.
    """
    where = Path(path)
    doc, _ = _load_json(where, "placement")
    validate(doc, PLACEMENT_SPEC, str(where))
    rows = doc["phy2log"]
    if rows and len({len(r) for r in rows}) != 1:
        raise _fail(where, "phy2log", "expected every layer's map to have the same length")
    width = len(rows[0]) if rows else 0
    phy2log = np.array(rows, dtype=np.int64).reshape(len(rows), width)
    layout = parse_layout(doc["pipeline_model_parallel_layout"], f"{where}: pipeline_model_parallel_layout") \
        if "pipeline_model_parallel_layout" in doc else ()
    return Placement(np.array(doc["rank2gpu"], dtype=np.int64).reshape(-1), phy2log, layout), doc
