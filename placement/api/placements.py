"""Placements in and out: load, check, score, predict, verify and export them; calibrate the model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from placement.core.checker import check, check_or_raise
from placement.core.model import Apply, Instance, InvalidInputError, Placement
from placement.formats import read_instance, read_placement
from placement.predict.cost import Window, evaluate
from placement.predict.performance import Prediction, StepTimeModel
from placement.predict.report import report

if TYPE_CHECKING:
    from placement.app.verify import VerifyReport
    from placement.predict.calibration import Calibration

__all__ = [
    "load_instance",
    "load_placement",
    "check_placement",
    "evaluate_placement",
    "predict_performance",
    "calibrate",
    "solver_names",
    "verify_placement",
    "export_placement",
]


def load_instance(path: str | os.PathLike[str]) -> Instance:
    """Read and validate an instance file and its routing ``.npz``.

    Parameters
    ----------
    path : the instance JSON; its ``routing.file`` is resolved inside the same folder.

    Returns
    -------
    Instance, with ``sha256`` identifying its files.

    Raises
    ------
    InvalidInputError
        One line naming the file and the field (malformed JSON, wrong types, sizes out of range,
        a missing, truncated or pickled ``.npz``, a path escaping the folder, ...).
    """
    return read_instance(path)


def load_placement(instance: Instance, path: str | os.PathLike[str]) -> Placement:
    """Read a placement file and check it against ``instance``.

    Raises
    ------
    InvalidInputError
        The file is malformed, or the checker finds a violation (the first is named).
    """
    placement, _ = read_placement(path)
    check_or_raise(instance, placement)
    return placement


def check_placement(instance: Instance, placement: Placement) -> list[str]:
    """Every structural violation of ``placement`` against ``instance`` (empty: valid)."""
    return check(instance, placement)


def evaluate_placement(instance: Instance, placement: Placement) -> dict[str, Any]:
    """The evaluator's report on the sampled and the held-out window.

    Returns
    -------
    dict of :class:`placement.predict.cost.Metrics` fields (per optimizer step); held-out twins carry the
    prefix ``heldout_``.

    Raises
    ------
    InvalidInputError
        The placement violates the instance (checked first).
    """
    check_or_raise(instance, placement)
    return report(instance, placement)


def predict_performance(instance: Instance, placement: Placement, *, window: Window = "heldout") -> Prediction:
    """Predicted step time, tokens/s and TFLOP/s per GPU of ``placement`` on one routing window.

    The same figures as the report's ``predicted_*`` keys (:mod:`placement.predict.performance`), typed.

    Raises
    ------
    InvalidInputError
        The placement violates the instance, or the instance has no ``performance`` block.
    """
    check_or_raise(instance, placement)
    if instance.performance is None:
        raise InvalidInputError(f"{instance.name}: performance: the instance has no performance block")
    metrics = evaluate(instance, placement, window=window)
    return StepTimeModel(instance).predict_metrics(metrics, placement.rank2gpu)


def calibrate(
    rows: str | os.PathLike[str] | None = None,
    fit: Sequence[str] = ("gemm_efficiency", "gemm_half_shape", "fp8_gemm_ratio", "elementwise_bytes"),
) -> Calibration:
    """Predict the measured runs of a ladder file and fit the step-time model on its ``fit`` rows.

    Parameters
    ----------
    rows : a ladder file (docs/formats.md); ``None`` = the published ladder shipped with the package.
    fit : parameters to fit (:data:`placement.predict.calibration.FITTABLE`).

    Returns
    -------
    :class:`placement.predict.calibration.Calibration`: every row's prediction and error, the fitted values,
    the median absolute error of the rows not fitted and the fitted ``performance`` block.
    """
    from placement.predict.calibration import calibrate as _calibrate, default_ladder_path, read_ladder

    return _calibrate(read_ladder(default_ladder_path() if rows is None else rows), fit)


def solver_names() -> list[str]:
    """The registered solver names, sorted (what ``solver=`` accepts)."""
    from solvers import SOLVERS

    return sorted(SOLVERS)



def verify_placement(instance_path: str | os.PathLike[str], placement_path: str | os.PathLike[str]) -> VerifyReport:
    """Verify a placement file against its instance, independently of the solvers.

    Returns a :class:`placement.app.verify.VerifyReport`: ``violations`` (empty when valid), the
    ``checks`` run and ``notes``; see :mod:`placement.app.verify` for the checks.

    Raises
    ------
    InvalidInputError
        A file cannot be read or parsed.
    """
    from placement.app.verify import verify_files

    return verify_files(instance_path, placement_path)


def export_placement(
    fmt: str,
    placement_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    instance_path: str | os.PathLike[str] | None = None,
    *,
    keep_router: bool = False,
    apply: Apply | None = None,
) -> dict[Path, str]:
    """Check a placement file and write it, atomically, in a format a stack reads.

    ``apply`` (megatron, torchtitan): ``runtime`` writes the keep-router permutation that is also the
    map of :mod:`placement.consumers.runtime` (any map), ``checkpoint`` the permutation of router and experts;
    default: the placement's ``apply`` (what it was solved for), else the instance's (``runtime``).
    ``keep_router`` is the older spelling of ``apply="runtime"``.

    ``fmt``: one of :data:`placement.consumers.export.FORMATS` (sglang, vllm, vllm-ascend, megatron,
    torchtitan, slurm, hybridep, maxtext); every format but vllm needs the instance.  Returns
    ``{path: text}`` of the files written (``slurm`` writes a per-host GPU file and a launcher
    script beside the host file, and warns with ``LaunchWarning`` when torchrun cannot launch it).

    Raises
    ------
    InvalidInputError
        Unreadable files, a placement made for another instance, or one the checker rejects.
    InfeasibleError
        The stack cannot take this placement.
    """
    from placement.consumers.export import export_file

    return export_file(fmt, placement_path, output_path, instance_path, keep_router=keep_router, apply=apply)
