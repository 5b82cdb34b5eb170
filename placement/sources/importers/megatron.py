"""Reader of Megatron-Core router traces (``router_trace_rank{r}.jsonl``), streamed.

The format, as ``megatron/core/transformer/moe/router_trace.py`` of Megatron-LM writes it (read at
commit d98e8a6 of 2026-08-22, package version 0.20.0; the module is not in the megatron-core 0.16.1
wheel): one JSONL file per rank, one record per router call::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

``layer`` is the index ``i`` of the router's module ``decoder.layers.<i>.mlp.router``: local to
the pipeline stage (each stage's ``decoder.layers`` holds only its own layers).  ``stage`` is the
tracer's capture point, not the pipeline stage; the stage comes from the rank and the layout.
``block == "mtp"`` records (multi-token-prediction heads, with ``mtp_idx``; ``layer`` is the inner
layer, 0 for a single-layer head) are the MoE layer ``num_layers + mtp_idx`` when the model has MTP
MoE layers (``model.mtp_num_layers``), and are skipped otherwise.  In training (``--moe-routing-trace-path``, wired into
``megatron/training/training.py``) ``step`` is the iteration and every micro-batch adds one record
per layer; in inference it counts forward passes.  :mod:`placement.sources.importers.recorder` writes the
same schema for Megatron-Core releases without the tracer and for TorchTitan.

Reading is two passes: the scan parses and validates every record and keeps its byte offset; the
ids of the tokens kept are parsed again from those offsets.  Memory is the largest record plus the
kept tokens.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from placement.sources.importers.core import IdChecker, RouterCall
from placement.core.model import InvalidInputError, MoEModel

__all__ = ["read_calls", "TRACE_NAME"]

TRACE_NAME = re.compile(r"router_trace_rank(\d+)\.jsonl$")
MAX_RECORD_BYTES = 2**30  # one JSON line; a larger one is refused before it is read whole


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def _open_regular(path: Path) -> Any:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InvalidInputError(f"{path}: trace file not found") from None
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read trace file: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(f"{path}: expected a regular trace file")
    try:
        return path.open("rb")
    except OSError as exc:
        raise InvalidInputError(f"{path}: cannot read trace file: {exc.strerror or exc}") from None


def _parse(line: bytes, where: str) -> dict:
    try:
        rec = json.loads(line, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{where}: malformed JSON record (truncated file?): {exc}") from None
    if not isinstance(rec, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    return rec


def _int_field(rec: dict, key: str, where: str) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInputError(f"{where}: {key}: expected an integer, found {v!r:.40}")
    return v


def _ids(rec: dict, where: str, checker: IdChecker, check: bool = True) -> np.ndarray:
    raw = rec.get("top_indices")
    if not isinstance(raw, list):
        raise InvalidInputError(f"{where}: top_indices: expected a list of per-token lists")
    k = checker.model.top_k
    if not raw:
        return np.empty((0, k), dtype=np.int64)
    try:
        ids = np.array(raw)
    except ValueError:
        raise InvalidInputError(f"{where}: top_indices: rows of different lengths") from None
    if ids.dtype.kind not in "iu" or ids.ndim != 2:
        raise InvalidInputError(f"{where}: top_indices: expected integer rows of top_k={k} ids")
    if ids.shape[1] != k:
        raise InvalidInputError(f"{where}: top_indices: {ids.shape[1]} ids per token, the model's top_k is {k}")
    return checker.check(ids, where) if check else ids.astype(np.int64, copy=False)


def read_calls(paths: Sequence[str | os.PathLike[str]], model: MoEModel,
               on_bytes: Callable[[int], None] | None = None) -> Iterator[RouterCall]:
    """Scan Megatron router traces; yields one :class:`RouterCall` per decoder (and MTP) record.

    ``on_bytes`` is called with the length of every line scanned (progress; it only observes).

    Raises
    ------
    InvalidInputError
        ``path: record N: ...`` for a malformed or truncated line, a missing or mistyped field, a
        ``rank`` that differs from the file name's, ``num_tokens``/``topk`` that disagree with
        ``top_indices``, ids outside the experts, repeated experts, too many expert groups.
    """
    checker = IdChecker(model)
    for p in sorted({str(x) for x in paths}):
        path = Path(p)
        m = TRACE_NAME.search(path.name)
        name_rank = int(m.group(1)) if m else None
        with _open_regular(path) as fh:
            offset = 0
            number = 0
            while True:
                line = fh.readline(MAX_RECORD_BYTES + 1)
                if not line:
                    break
                number += 1
                where = f"{path}: record {number}"
                start, offset = offset, offset + len(line)
                if on_bytes is not None:
                    on_bytes(len(line))
                if len(line) > MAX_RECORD_BYTES:
                    raise InvalidInputError(f"{where}: a record longer than {MAX_RECORD_BYTES:,} bytes")
                if not line.strip():
                    continue
                if not line.endswith(b"\n"):
                    # The tracer ends every record with a newline: a last line without one was cut.
                    _parse(line, where)  # a clear JSON error when it is cut mid-record
                    raise InvalidInputError(f"{where}: the last record has no newline (truncated file?)")
                rec = _parse(line, where)
                block = rec.get("block", "decoder")
                mtp = block == "mtp" and model.mtp_num_layers > 0
                if block != "decoder" and not mtp:
                    continue
                step = _int_field(rec, "step", where)
                layer = _int_field(rec, "layer", where)
                if mtp:
                    head = _int_field(rec, "mtp_idx", where)
                    if layer != 0 or not 0 <= head < model.mtp_num_layers:
                        raise InvalidInputError(
                            f"{where}: MTP record mtp_idx={head} layer={layer}: expected mtp_idx < "
                            f"model.mtp_num_layers={model.mtp_num_layers} and inner layer 0"
                        )
                    layer = model.num_layers + head
                rank = _int_field(rec, "rank", where)
                if name_rank is not None and rank != name_rank:
                    raise InvalidInputError(f"{where}: rank {rank} in a file named for rank {name_rank}")
                if layer < 0 or rank < 0:
                    raise InvalidInputError(f"{where}: layer and rank must be non-negative")
                ids = _ids(rec, where, checker)
                for key, want in (("num_tokens", ids.shape[0]), ("topk", model.top_k)):
                    if key in rec and _int_field(rec, key, where) != want:
                        raise InvalidInputError(f"{where}: {key}={rec[key]} but top_indices holds {want}")
                yield RouterCall(
                    where=where,
                    step=step,
                    layer=layer,
                    num_tokens=int(ids.shape[0]),
                    load=_Loader(path, start, len(line), where, checker),
                    rank=rank,
                    local_layer=not mtp,
                )


class _Loader:
    """Parses one record's ids again from its byte range (the second pass)."""

    __slots__ = ("path", "start", "size", "where", "checker")

    def __init__(self, path: Path, start: int, size: int, where: str, checker: IdChecker) -> None:
        self.path, self.start, self.size, self.where, self.checker = path, start, size, where, checker

    def __call__(self) -> np.ndarray:
        with _open_regular(self.path) as fh:
            fh.seek(self.start)
            line = fh.read(self.size)
        # validated by the scan; the core checks the shape again (a file changed in between)
        return _ids(_parse(line, self.where), self.where, self.checker, check=False)
