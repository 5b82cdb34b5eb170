"""Placements in and out: load, check, score, predict, verify and export them; calibrate the model."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from placement.core.checker import check, check_or_raise
from placement.core.model import Apply, Instance, InvalidInputError, Placement
from placement.formats import read_instance, read_placement
from placement.predict.cost import Window, evaluate
from placement.predict.performance import Prediction, StepTimeModel
from placement.predict.report import report

if TYPE_CHECKING:
    from placement.app.verify import VerifyReport

__all__ = [
    "DefaultLayoutReport",
    "default_placement",
    "default_layout_report",
    "load_instance",
    "load_placement",
    "check_placement",
    "evaluate_placement",
    "predict_performance",
    "solver_names",
    "verify_placement",
    "export_placement",
    "show_placement",
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


def default_placement(instance: Instance) -> Placement:
    """The default layout: ranks in order on the available GPUs, each rank's experts contiguous
    (:func:`solvers.default.default_placement`), what every solve is compared against."""
    from solvers.default import default_placement as _default_placement

    return _default_placement(instance)


@dataclass(frozen=True)
class DefaultLayoutReport:
    """The evaluator's report of the default layout and the wall seconds it took.

    metrics : :func:`placement.predict.report.report` of :func:`default_placement` (both windows).
    scoring_s : wall seconds of that report: what scoring a solver's answer will take on this
        machine (:func:`placement.api.budget.answer_reserve_s` keeps it back from the solver).
    """

    metrics: dict[str, Any]
    scoring_s: float


def default_layout_report(instance: Instance) -> DefaultLayoutReport:
    """Score the default layout (the baseline ``placement solve`` prints beside its answer), timed."""
    t0 = time.monotonic()
    metrics = report(instance, default_placement(instance))
    return DefaultLayoutReport(metrics, time.monotonic() - t0)


def show_placement(
    placement_path: str | os.PathLike[str],
    instance_path: str | os.PathLike[str] | None,
    output_path: str | os.PathLike[str] | None = None,
    *,
    window: Window | None = None,
) -> Path:
    """Draw a placement file (or ``"default"``: the default layout) as a rack map, PNG or SVG by
    the suffix of ``output_path`` (default: beside the placement file, ``.png``), written
    atomically; returns the path written (:func:`placement.app.show.show_files`).

    Raises
    ------
    InvalidInputError
        A missing or malformed file, a wrong suffix, a placement made for another instance or one
        the checker rejects; nothing is written.
    """
    from placement.app.show import show_files

    return show_files(placement_path, instance_path, output_path, window=window)
