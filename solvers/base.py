"""The one interface every placement algorithm implements, and its result type.

A solver is a callable ``solve(instance, options) -> SolveResult``.  It receives the instance's
solver view (:meth:`placement.model.Instance.for_solver`: no held-out window), must honour
``options.deadline`` (a ``time.monotonic()`` instant) and return the best placement it has by then.
It never prints: progress goes to ``options.progress`` when given, logs to the ``logging`` module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

from placement.model import Instance, Placement

__all__ = ["Consumer", "CONSUMERS", "Objective", "OBJECTIVES", "LayoutMode", "LAYOUT_MODES", "SolveOptions", "SolveResult", "Solver"]

Consumer = Literal["none", "deepep", "hybridep"]
CONSUMERS: tuple[Consumer, ...] = ("none", "deepep", "hybridep")
Objective = Literal["total", "bottleneck"]
OBJECTIVES: tuple[Objective, ...] = ("total", "bottleneck")
LayoutMode = Literal["optimize", "fixed"]
LAYOUT_MODES: tuple[LayoutMode, ...] = ("optimize", "fixed")


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SolveOptions:
    """What every solver accepts.

    time_limit_s : wall-clock budget of the solve itself (the caller sets ``deadline`` from it).
    seed : random seed; the same instance, seed and options give the same placement.
    num_workers : CP-SAT workers / processes; defaults to the cores available.
    consumer : layout rule the rank placement must obey (``deepep``/``hybridep``: equal
        consecutive slices of each EP group per NVLink domain).
    group_preserving : only group-preserving expert permutations (required for checkpoint
        permutations under group-limited routing); ``None`` = the model's routing decides.
    objective : ``total`` cross-domain bytes, or the ``bottleneck`` (slowest stage / busiest NIC).
    layout : ``optimize`` the rank -> GPU map, or keep it ``fixed`` at the default layout (when the
        launcher decides where ranks run, as for SGLang or vLLM serving).
    deadline : ``time.monotonic()`` instant by which the solver returns; derived if not given.
    progress : called with one-line progress messages (the CLI prints them on a terminal).
    """

    time_limit_s: float = 60.0
    seed: int = 0
    num_workers: int = field(default_factory=default_workers)
    consumer: Consumer = "none"
    group_preserving: bool | None = None
    objective: Objective = "total"
    layout: LayoutMode = "optimize"
    deadline: float | None = None
    progress: Callable[[str], None] | None = None

    def resolved_deadline(self) -> float:
        return self.deadline if self.deadline is not None else time.monotonic() + self.time_limit_s

    def group_preserving_for(self, instance: Instance) -> bool:
        if self.group_preserving is None:
            return instance.model.group_limited
        return self.group_preserving

    def report(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)


@dataclass(frozen=True)
class SolveResult:
    """What every solver returns.

    status : ``optimal`` (proved), ``feasible`` (time limit hit or gap left), ``heuristic`` (no
        bound attempted).
    objective_bytes : the solver's objective on the sampled tokens, bytes per step, in the cost
        model's units (the evaluator is rerun by the caller; the two must agree for ``total``).
    bound_bytes : a proved lower bound on that objective for the solver's search space, if any.
    params : the parameters that, with the seed, reproduce the placement.
    details : per-layer and per-phase facts (JSON-serialisable, deterministic).
    """

    placement: Placement
    solver: str
    status: Literal["optimal", "feasible", "heuristic"]
    objective_bytes: float
    bound_bytes: float | None = None
    params: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    group_preserving: bool = False
    consumer: Consumer = "none"
    metrics: dict = field(default_factory=dict)  # the evaluator's report, filled by placement.api.solve
    wall_s: float = 0.0  # wall time of the whole solve call, filled by placement.api.solve

    @property
    def gap(self) -> float | None:
        if self.bound_bytes is None:
            return None
        if self.objective_bytes <= 0:
            return 0.0
        return max(0.0, (self.objective_bytes - self.bound_bytes) / self.objective_bytes)


class Solver(Protocol):
    def __call__(self, instance: Instance, options: SolveOptions) -> SolveResult: ...
