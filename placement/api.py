"""The Python API: what job schedulers and notebooks call.  Nothing here prints.

>>> import placement
>>> inst = placement.load_instance("instances/tiny.json")          # doctest: +SKIP
>>> result = placement.solve(inst, time_limit_s=10, seed=0)         # doctest: +SKIP
>>> result.metrics["heldout_cross_domain_bytes_per_step"]           # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

from placement.checker import check_or_raise
from placement.cost import report
from placement.formats import placement_document, read_instance, read_placement, write_placement
from placement.model import Instance, Placement, SolverError

__all__ = [
    "DEFAULT_SOLVER",
    "FINISH_RESERVE_S",
    "load_instance",
    "load_placement",
    "solve",
    "evaluate_placement",
    "save_result",
    "result_document",
]

DEFAULT_SOLVER = "default"
# Time kept back from the solver's share of the limit for checking, scoring and writing the result.
FINISH_RESERVE_S = 1.0


def load_instance(path: str | os.PathLike) -> Instance:
    """Read and validate an instance file (raises :class:`~placement.model.InvalidInputError`)."""
    return read_instance(path)


def load_placement(instance: Instance, path: str | os.PathLike) -> Placement:
    """Read a placement file and check it against ``instance`` (raises ``InvalidInputError``)."""
    placement, _ = read_placement(path)
    check_or_raise(instance, placement)
    return placement


def evaluate_placement(instance: Instance, placement: Placement) -> dict:
    """The evaluator's report on the sampled and held-out windows (checks the placement first)."""
    check_or_raise(instance, placement)
    return report(instance, placement)


def solve(
    instance: Instance,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float = 60.0,
    seed: int = 0,
    num_workers: int | None = None,
    consumer: str = "none",
    group_preserving: bool | None = None,
    objective: str = "total",
    layout: str = "optimize",
    progress: Callable[[str], None] | None = None,
    started_at: float | None = None,
):
    """Solve ``instance`` with a registered solver and score the answer.

    Parameters
    ----------
    instance : the problem (its held-out window is withheld from the solver).
    solver : a name from ``solvers.SOLVERS``.
    time_limit_s : wall-clock budget for the whole call, measured from ``started_at`` (default:
        now); the solver gets it less :data:`FINISH_RESERVE_S` for checking and scoring.
    seed, num_workers, consumer, group_preserving, objective, layout : see :class:`solvers.SolveOptions`.
    progress : called with one-line progress messages.

    Returns
    -------
    solvers.SolveResult with ``metrics`` (the evaluator's report) and ``wall_s`` filled in.

    Raises
    ------
    InvalidInputError, InfeasibleError, SolverError
    """
    from solvers import SolveOptions, get_solver
    from solvers.base import default_workers

    start = time.monotonic() if started_at is None else started_at
    fn = get_solver(solver)
    if time_limit_s <= 0:
        from placement.model import InvalidInputError

        raise InvalidInputError(f"--time-limit: expected a positive number of seconds, found {time_limit_s}")
    options = SolveOptions(
        time_limit_s=time_limit_s,
        seed=seed,
        num_workers=num_workers or default_workers(),
        consumer=consumer,  # type: ignore[arg-type]
        group_preserving=group_preserving,
        objective=objective,  # type: ignore[arg-type]
        layout=layout,  # type: ignore[arg-type]
        deadline=start + max(0.1, time_limit_s - FINISH_RESERVE_S),
        progress=progress,
    )
    result = fn(instance.for_solver(), options)
    try:
        check_or_raise(instance, result.placement)
    except Exception as exc:
        raise SolverError(f"solver {solver!r} returned an invalid placement: {exc}") from None
    metrics = report(instance, result.placement)
    params = {**result.params, "seed": seed, "time_limit_s": time_limit_s}
    return dataclasses.replace(result, params=params, metrics=metrics, wall_s=time.monotonic() - start)


def result_document(instance: Instance, result) -> dict:
    """The placement-file document for a :class:`solvers.SolveResult` (deterministic)."""
    solve_info = {
        "status": result.status,
        "objective_bytes": result.objective_bytes,
        "bound_bytes": result.bound_bytes,
        "gap": result.gap,
        "details": result.details,
    }
    return placement_document(
        instance,
        result.placement,
        solver=result.solver,
        params=result.params,
        seed=int(result.params.get("seed", 0)),
        consumer=result.consumer,
        group_preserving=result.group_preserving,
        metrics=result.metrics,
        solve=solve_info,
    )


def save_result(instance: Instance, result, path: str | os.PathLike) -> None:
    """Write the placement file for ``result`` atomically."""
    write_placement(path, result_document(instance, result))
