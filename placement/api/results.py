"""A solve result as a placement file."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from placement.core.model import Instance
from placement.formats import placement_document, write_placement

if TYPE_CHECKING:
    from solvers.base import SolveResult

__all__ = ["result_document", "result_pipeline_layout", "save_result"]


def result_document(instance: Instance, result: SolveResult, *, allocation: str | None = None) -> dict[str, Any]:
    """The placement-file document of a solve result (deterministic: no wall-clock values).

    ``allocation``: the host list the instance was restricted to (:func:`placement.api.allocate`),
    recorded as ``solve.details.allocation`` with the GPUs it holds.
    """
    solve_info = {
        "status": result.status,
        "objective_bytes": float(result.objective_bytes),
        "bound_bytes": None if result.bound_bytes is None else float(result.bound_bytes),
        "gap": result.gap,
        "details": {k: v for k, v in result.details.items() if k != "replicas"},
    }
    doc = placement_document(
        instance,
        result.placement,
        solver=result.solver,
        params=result.params,
        seed=int(result.params.get("seed", 0)),
        consumer=result.consumer,
        group_preserving=result.group_preserving,
        apply=result.params.get("apply"),
        metrics=result.metrics,
        solve=solve_info,
        replicas=result.details.get("replicas"),
        pipeline_layout=result_pipeline_layout(instance, result),
    )
    if allocation is not None:  # which hosts the placement was solved for
        doc["solve"]["details"]["allocation"] = {"hosts": allocation, "gpus": int(instance.cluster.available.sum())}
    return doc


def result_pipeline_layout(instance: Instance, result: SolveResult) -> tuple[str, ...]:
    """The chunk list a solve result was scored with: its placement's, else the instance's layout."""
    return result.placement.pipeline_layout or instance.parallel.pipeline_layout


def save_result(instance: Instance, result: SolveResult, path: str | os.PathLike[str], *,
                allocation: str | None = None) -> None:
    """Write the placement file of ``result`` atomically (a reader never sees a partial file);
    ``allocation`` as in :func:`result_document`."""
    write_placement(path, result_document(instance, result, allocation=allocation))
