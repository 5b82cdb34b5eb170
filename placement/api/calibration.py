"""The step-time model against measured runs: calibrate it on a ladder, cross-validate it, and
turn training logs into ladder rows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from placement.core.model import InvalidInputError

if TYPE_CHECKING:
    from placement.formats.ladder import LadderRow
    from placement.predict.calibration import Calibration, CrossValidation

__all__ = ["LogLadder", "calibrate", "cross_validate", "ladder_from_logs"]


def calibrate(
    rows: str | os.PathLike[str] | Sequence[LadderRow] | None = None,
    fit: Sequence[str] = ("gemm_efficiency", "gemm_half_shape", "fp8_gemm_ratio", "elementwise_bytes"),
) -> Calibration:
    """Predict the measured runs of a ladder file and fit the step-time model on its ``fit`` rows.

    Parameters
    ----------
    rows : a ladder file (docs/formats.md), or its rows already read (:class:`LogLadder` ``.rows``);
        ``None`` = the published ladder shipped with the package.
    fit : parameters to fit (:data:`placement.predict.calibration.FITTABLE`).

    Returns
    -------
    :class:`placement.predict.calibration.Calibration`: every row's prediction and error, the fitted values,
    the median absolute error of the rows not fitted and the fitted ``performance`` block.
    """
    from placement.predict.calibration import calibrate as _calibrate, default_ladder_path, read_ladder

    if rows is None or isinstance(rows, (str, os.PathLike)):
        return _calibrate(read_ladder(default_ladder_path() if rows is None else rows), fit)
    return _calibrate(list(rows), fit)


def cross_validate(rows: str | os.PathLike[str] | None = None, fit: Sequence[str] | None = None) -> CrossValidation:
    """Leave-one-configuration-out and leave-one-model-family-out errors of every row of a ladder
    file (``None``: the published ladder), each fitted on all other rows
    (:func:`placement.predict.calibration.cross_validate`; ``fit`` default its ``DEFAULT_FIT``)."""
    from placement.predict.calibration import DEFAULT_FIT, cross_validate as _cross_validate, default_ladder_path, read_ladder

    return _cross_validate(read_ladder(rows or default_ladder_path()), DEFAULT_FIT if fit is None else fit)


@dataclass(frozen=True)
class LogLadder:
    """Ladder rows read from training logs (docs/runlogs.md).

    rows : the rows of ``ladder`` (when given) followed by one row per log, checked.
    document : the logs' rows as a ladder file (``{"version": 1, "rows": [...]}``), to write.
    log_rows : one dict per log (``name``, ``family``, ``gpus``, ``gpu``, ``note``, ...).
    """

    rows: list[LadderRow]
    document: dict[str, Any]
    log_rows: list[dict[str, Any]]


def ladder_from_logs(
    logs: Sequence[str | os.PathLike[str]],
    gpu: str,
    *,
    gpus: int | None = None,
    config: str | None = None,
    ladder: str | os.PathLike[str] | None = None,
    where: str = "logs",
) -> LogLadder:
    """One ladder row per training log (Megatron-LM, Megatron-Bridge, TorchTitan), after the rows
    of the ladder file ``ladder`` when it is given.

    Parameters
    ----------
    logs : one log file per run.
    gpu : the GPU kind the runs used (``h100``, ``gb200``, ...): a log does not say it.
    gpus : GPUs of the job, for logs that do not say it (Megatron-Bridge).
    config : TorchTitan's job configuration (a TOML file, or its launch arguments in one string).
    where : how errors name the logs (the CLI passes its flag).

    Raises
    ------
    InvalidInputError
        An unreadable log, or a log row whose name is also a row of ``ladder``.
    """
    from placement.predict.calibration import ladder_rows, read_ladder
    from placement.sources.runlogs import rows_document, rows_from_logs

    log_rows = rows_from_logs(logs, gpu, gpus=gpus, config=config)
    doc = rows_document(log_rows)
    rows = ladder_rows(doc, where)
    if ladder is not None:
        base = read_ladder(ladder)
        taken = {r.name for r in base}
        clash = [r.name for r in rows if r.name in taken]
        if clash:
            raise InvalidInputError(f"{where}: a log's row name {clash[0]!r} is also a row of {ladder} (rename the log)")
        rows = base + rows
    return LogLadder(rows, doc, log_rows)
