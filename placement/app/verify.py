"""``placement verify``: check a placement file against its instance, independently of the solvers.

It reads the two files, runs every check the independent checker (:mod:`placement.core.checker`)
knows, and recomputes the metrics with the evaluator (:func:`placement.predict.report.report`) to flag any
number the file misstates.  It never calls a solver: a buggy solver cannot vouch for itself.

Checks, each reported with a message that names it:

- ``instance``: the placement names this instance (name and SHA-256 of its files);
- ``structure``: every rank exactly once on an existing, available GPU; every expert placed once
  per MoE layer; the slots per layer (``ep x`` slots per rank) respected;
- ``etp``: the layout's expert-tensor-parallel size is one the cost model represents (1);
- ``tp``: TP (and TP x CP) groups where their traffic can go (:func:`placement.core.checker.tp_group_violations`);
- ``deepep``: when the file declares ``consumer`` ``deepep`` or ``hybridep``, the equal
  consecutive slices per NVLink domain rule;
- ``groups``: when the file declares ``group_preserving``, every layer keeps expert groups whole;
- ``metrics``: every metric the file states equals the evaluator's, to a relative 1e-9;
- ``replicas``: when the file has a ``replicas`` block (:mod:`placement.formats.replicas`), its map
  has ``E + N`` slots per layer dividing over ``ep``, every expert at least once, no expert twice
  on one EP rank, each rank's first ``E / ep`` slots equal to ``phy2log``, and its stated rank-load
  metrics recomputed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from placement.core.checker import (
    check,
    deepep_violations,
    etp_violations,
    tp_group_violations,
    violates_group_preservation,
)
from placement.predict.report import report
from placement.formats import read_instance, read_placement
from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.pipeline_layout import parse_layout, with_layout

__all__ = ["METRIC_REL_TOL", "CONSUMER_VALUES", "VerifyReport", "verify_document", "verify_files", "metric_misstatements"]

METRIC_REL_TOL = 1e-9
CONSUMER_VALUES = ("none", "deepep", "hybridep")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_document` found.

    violations : one message per violation (empty: valid).
    checks : the names of the checks that ran, in order.
    metrics : the evaluator's report on the placement (``None`` when the structure is invalid).
    notes : facts that are not violations (e.g. the file states no metrics).
    """

    violations: list[str]
    checks: list[str]
    metrics: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.violations


def verify_document(instance: Instance, placement: Placement, doc: dict) -> VerifyReport:
    """Every violation of the placement document ``doc`` (with its parsed ``placement``)."""
    violations: list[str] = []
    checks: list[str] = []
    notes: list[str] = []

    checks.append("instance")
    named = doc.get("instance", {})
    if named.get("name") != instance.name:
        violations.append(f"instance.name: the placement names {named.get('name')!r}, the instance is {instance.name!r}")
    if named.get("sha256") != instance.sha256:
        violations.append(
            f"instance.sha256: the placement was made for {str(named.get('sha256'))[:16]}..., "
            f"the instance's files hash to {instance.sha256[:16]}..."
        )

    checks.append("structure")
    structural = check(instance, placement)
    violations += structural

    checks.append("etp")
    etp_problems = etp_violations(instance)
    violations += etp_problems
    structural = structural + etp_problems  # the evaluator assumes etp = 1: no metrics otherwise

    checks.append("tp")
    violations += tp_group_violations(instance, placement)

    consumer = doc.get("consumer", "none")
    if consumer not in CONSUMER_VALUES:
        violations.append(f"consumer: expected one of {', '.join(CONSUMER_VALUES)}, found {consumer!r}")
    elif consumer != "none" and not structural:
        checks.append("deepep")
        violations += [f"consumer {consumer}: {v}" for v in deepep_violations(instance, placement)]

    if doc.get("group_preserving", False) and not structural:
        checks.append("groups")
        violations += [f"group_preserving: {v}" for v in violates_group_preservation(instance, placement)]

    if "pipeline_model_parallel_layout" in doc and not structural:
        checks.append("pipeline_layout")  # the layout the placement was scored with (placement.core.pipeline_layout)
        try:
            instance = with_layout(instance, parse_layout(doc["pipeline_model_parallel_layout"]))
        except InvalidInputError as exc:
            violations.append(str(exc))
            structural = structural + [str(exc)]
    if "replicas" in doc and not structural:
        checks.append("replicas")
        violations += _replica_violations(instance, placement, doc)

    metrics = None
    if not structural:
        checks.append("metrics")
        metrics = report(instance, placement)
        stated = doc.get("metrics") or {}
        if not stated:
            notes.append("the file states no metrics: nothing to compare")
        violations += metric_misstatements(stated, metrics)
    else:
        notes.append("metrics not recomputed: the placement's structure is invalid")
    return VerifyReport(violations=violations, checks=checks, metrics=metrics, notes=notes)


def _replica_violations(instance: Instance, placement: Placement, doc: dict) -> list[str]:
    from placement.formats.replicas import replica_map_from_document, replica_metrics, replica_violations

    problems = replica_violations(instance, placement, doc)
    stated = (doc.get("replicas") or {}).get("metrics") or {}
    if problems or not stated:
        return problems
    rmap = replica_map_from_document(doc["replicas"], instance.model.num_experts, instance.parallel.ep)
    computed = replica_metrics(instance, rmap, None)
    stated = {k: v for k, v in stated.items() if k not in ("bytes_per_extra_slot", "extra_slots_per_gpu")}
    return [f"replicas.{v}" for v in metric_misstatements(stated, computed)]


def verify_files(instance_path: str | os.PathLike, placement_path: str | os.PathLike) -> VerifyReport:
    """:func:`verify_document` on two files (unreadable files raise ``InvalidInputError``)."""
    instance = read_instance(instance_path)
    placement, doc = read_placement(placement_path)
    return verify_document(instance, placement, doc)


def metric_misstatements(stated: dict, computed: dict, rel_tol: float = METRIC_REL_TOL) -> list[str]:
    """Messages for every stated metric that differs from the evaluator's (relative ``rel_tol``).

    Numbers compare with ``|a - b| <= rel_tol * max(|a|, |b|)``; lists elementwise; strings exactly.
    A stated key the evaluator does not report is a violation too (it cannot be checked).
    """
    out = []
    for key in sorted(stated):
        if key not in computed:
            out.append(f"metrics.{key}: not a metric the evaluator reports")
            continue
        problem = _differs(stated[key], computed[key], rel_tol)
        if problem:
            out.append(f"metrics.{key}: the file states {problem}")
    return out


def _differs(stated, computed, rel_tol: float) -> str | None:
    if isinstance(computed, str):
        return None if stated == computed else f"{stated!r}, the evaluator gives {computed!r}"
    if isinstance(computed, (list, tuple)):
        if not isinstance(stated, (list, tuple)) or len(stated) != len(computed):
            n = len(stated) if isinstance(stated, (list, tuple)) else "not a list"
            return f"{n} values, the evaluator gives {len(computed)}"
        for i, (a, b) in enumerate(zip(stated, computed)):
            problem = _differs(a, b, rel_tol)
            if problem:
                return f"[{i}] = {problem}"
        return None
    if isinstance(stated, bool) or not isinstance(stated, (int, float, np.integer, np.floating)):
        return f"{stated!r} (not a number), the evaluator gives {computed!r}"
    a, b = float(stated), float(computed)
    if math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0):
        return None
    return f"{a!r}, the evaluator gives {b!r} (relative difference {abs(a - b) / max(abs(a), abs(b)):.3g})"
