"""Ladder rows from your own training logs (``placement calibrate --from-logs``).

Each log file is one run and becomes one ladder row (the format of ``placement/data/ladder.json``,
docs/formats.md) with the model's ``family`` and ``shape``.  Readers, one module per stack:

- :mod:`placement.sources.runlogs.megatron`: Megatron-LM (its arguments block and ``iteration`` lines) and
  Megatron-Bridge (its configuration summary and the same ``iteration`` lines);
- :mod:`placement.sources.runlogs.torchtitan`: TorchTitan (its step lines and device-mesh line, with the
  job configuration given by ``--config``: a TOML file, read through TorchTitan's own
  ``ConfigManager`` when the installed TorchTitan knows the model).

The GPU kind is never in a log (``--gpu KIND``); the GPU count is, except in Megatron-Bridge's
(``--gpus N``).  A log without what a row needs raises :class:`InvalidInputError` naming the file and
the missing fact.  docs/runlogs.md describes the rules (warm-up, duplicates, prefixes).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Sequence

from placement.core.model import InvalidInputError
from placement.core.perfdata import GPU_KINDS
from placement.sources.runlogs.common import RunRecord, dedupe, family_of, fill_from_family, read_lines, steady_state

__all__ = ["read_run", "rows_from_logs", "rows_document"]


def read_run(path: str, *, config: str | None = None, gpus: int | None = None) -> RunRecord:
    """Read one log into a :class:`RunRecord`, choosing the reader by what the log prints."""
    from placement.sources.runlogs import megatron, torchtitan

    lines = read_lines(path)
    if torchtitan.looks_like(lines):
        return torchtitan.read(path, lines, config, gpus)
    if megatron.looks_like_lm(lines):
        return megatron.read_lm(path, lines)
    if megatron.looks_like_bridge(lines):
        return megatron.read_bridge(path, lines)
    raise InvalidInputError(
        f"{path}: no Megatron-LM arguments block, Megatron-Bridge configuration summary or TorchTitan step line found"
    )


def _row(rec: RunRecord, gpu: str, gpus: int | None, name: str) -> dict[str, Any]:
    where = rec.path
    if rec.gpus is not None and gpus is not None and rec.gpus != gpus:
        raise InvalidInputError(f"{where}: --gpus {gpus} disagrees with the log's {rec.gpus} GPUs")
    n = rec.gpus if rec.gpus is not None else gpus
    if n is None:
        raise InvalidInputError(f"{where}: the log does not say the number of GPUs (give --gpus N)")
    for what in ("seq_len", "micro_batch", "global_batch"):
        if getattr(rec, what) is None:
            raise InvalidInputError(f"{where}: the log does not say the {what.replace('_', ' ')}")
    model_par = rec.tp * rec.cp * rec.pp
    if n % model_par:
        raise InvalidInputError(f"{where}: {n} GPUs are not a multiple of tp*cp*pp = {model_par}")
    if rec.precision not in GPU_KINDS[gpu].peak_dense_tflops:
        raise InvalidInputError(f"{where}: the run's precision {rec.precision} has no peak on --gpu {gpu}")
    shape = fill_from_family(rec.shape, where)
    kept, note = steady_state(dedupe(rec.intervals), where)
    value = statistics.median(iv.value for iv in kept)
    assert rec.seq_len is not None and rec.global_batch is not None and rec.micro_batch is not None
    row: dict[str, Any] = {
        "name": name,
        "source": f"training log {where} ({rec.stack})",
        "release": rec.release,
        "gpu": gpu,
        "precision": rec.precision,
        "family": family_of(shape),
        "shape": shape,
        "gpus": n,
        "tp": rec.tp,
        "cp": rec.cp,
        "pp": rec.pp,
        "vpp": rec.vpp,
        "ep": rec.ep,
        "dp": n // model_par,
        "micro_batch": rec.micro_batch,
        "global_batch": rec.global_batch,
        "seq_len": rec.seq_len,
        "dispatcher": rec.dispatcher,
        "dispatch_precision": rec.dispatch_precision,
        "overlap": rec.overlap,
        "expert_load": rec.expert_load,
    }
    if rec.measure == "time_s":
        row["tokens_per_s_per_gpu"] = round(rec.global_batch * rec.seq_len / (value * n), 3)
        flops = [iv.tflops_per_gpu for iv in kept]
        if all(f is not None for f in flops):
            row["tflops_per_gpu"] = round(statistics.median(f for f in flops if f is not None), 3)
        note = f"iteration time {value * 1e3:.1f} ms, {note}"
    else:
        row["tokens_per_s_per_gpu"] = round(value, 3)
    row["fit"] = True
    row["note"] = "; ".join([note] + rec.notes)
    return row


def rows_from_logs(
    paths: Sequence[str | os.PathLike[str]],
    gpu: str,
    *,
    gpus: int | None = None,
    config: str | None = None,
) -> list[dict[str, Any]]:
    """One ladder row (a JSON-ready dict, ``fit`` true) per log file.

    Parameters
    ----------
    paths : the log files, one run each.
    gpu : the GPU kind the runs used (:data:`placement.core.perfdata.GPU_KINDS`).
    gpus : GPUs of the job, for logs that do not say it (Megatron-Bridge).
    config : TorchTitan's job configuration (a TOML file) for TorchTitan logs.

    Raises
    ------
    InvalidInputError : a log lacks what a row needs (the message names the file and the fact).
    """
    if gpu not in GPU_KINDS:
        raise InvalidInputError(f"--gpu: unknown GPU kind {gpu!r} (choose from {', '.join(GPU_KINDS)})")
    if gpus is not None and gpus < 1:
        raise InvalidInputError(f"--gpus: expected a positive integer, found {gpus}")
    rows: list[dict[str, Any]] = []
    names: set[str] = set()
    for p in paths:
        stem = Path(p).stem or "run"
        name, k = stem, 2
        while name in names:
            name, k = f"{stem}_{k}", k + 1
        names.add(name)
        rows.append(_row(read_run(str(p), config=config, gpus=gpus), gpu, gpus, name))
    return rows


def rows_document(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ladder file holding ``rows`` (what ``placement calibrate ROWS.json`` reads)."""
    return {"version": 1, "rows": rows}
