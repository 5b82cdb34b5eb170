"""The rank layout's work budget: deterministic decisions, the wall clock as a safety net.

Every decision to start a step (price a shape, solve a MILP round, move replicas, run the
evaluator) is taken on *predicted* costs alone: functions of the instance's sizes and of counts of
work done, never of the clock, so the same instance, options and seed do the same work on a fast
or a busy machine.  The deadline and stop requests are polled between steps and between the
layers of a scoring; when one ends a step, :attr:`WorkBudget.cut` records it (the only way the
result can depend on the clock).
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from solvers.base import SolveOptions

__all__ = ["Stopped", "WorkBudget", "milp_predict_s", "SCORE_BASE_S", "SCORE_S_PER_PAIR"]

#: Predicted seconds of one expert placement on the parts of one EP group in one layer
#: (:func:`solvers.layout.experts_on_parts.place_on_parts`):
#: ``SCORE_BASE_S + SCORE_S_PER_PAIR * pairs * (parts - 1) ** 1.3``, ``pairs`` the group's
#: (token, expert) pairs.  Used for the deterministic work budget only (docs/layout.md).
SCORE_BASE_S = 1e-3
SCORE_S_PER_PAIR = 1e-7
#: Predicted seconds of one footprint MILP: ``MILP_BASE_S + MILP_S_PER_NNZ_1_5 * nonzeros ** 1.5``.
MILP_BASE_S = 0.02
MILP_S_PER_NNZ_1_5 = 8e-7
#: The min-max (``bottleneck``) model leaves HiGHS a weak LP bound: its rounds take several times
#: longer than the ``total`` ones.
MILP_BOTTLENECK_FACTOR = 4.0


def milp_predict_s(nnz: int, objective: str) -> float:
    """Predicted seconds of one footprint MILP with ``nnz`` nonzeros (see :data:`MILP_BASE_S`)."""
    factor = MILP_BOTTLENECK_FACTOR if objective == "bottleneck" else 1.0
    return factor * (MILP_BASE_S + MILP_S_PER_NNZ_1_5 * float(nnz) ** 1.5)


class Stopped(Exception):
    """The wall-clock deadline passed, or the caller asked to stop, inside a step."""


class _CountsWork(Protocol):
    work_s: float


class WorkBudget:
    """The layout's work budget in predicted seconds, and the wall-clock safety net.

    Parameters
    ----------
    work_s : the budget, predicted seconds.
    deadline : ``time.monotonic()`` instant of the safety net.
    options : for :meth:`SolveOptions.stop_requested`.
    finish_s : wall seconds kept before ``deadline`` for the finish (the evaluator's check): steps
        are cut that much earlier.
    """

    def __init__(self, work_s: float, deadline: float, options: SolveOptions, finish_s: float = 0.0):
        self.work_s = float(work_s)
        self.deadline = float(deadline) - max(0.0, float(finish_s))
        self.options = options
        self.charged_s = 0.0  # predicted seconds of MILP solves and evaluator runs
        self.scorers: list[_CountsWork] = []  # their expert placements count too
        self.cut = False  # the wall clock or a stop request ended a step
        self.exhausted = False  # a step was skipped because the budget could not afford it

    def add_scorers(self, scorers: Sequence[_CountsWork]) -> None:
        """Count the expert placements of ``scorers`` (their ``work_s``) as spent."""
        self.scorers.extend(scorers)

    def spent_s(self) -> float:
        return self.charged_s + sum(sc.work_s for sc in self.scorers)

    def affords(self, predicted_s: float) -> bool:
        """True when ``predicted_s`` fits in what is left (deterministic); records when it does not."""
        ok = self.spent_s() + predicted_s <= self.work_s
        self.exhausted = self.exhausted or not ok
        return ok

    def charge(self, predicted_s: float) -> None:
        self.charged_s += float(predicted_s)

    def stopped(self) -> bool:
        """True once the deadline has passed or a stop was requested (and :attr:`cut` is set)."""
        if self.options.stop_requested() or time.monotonic() >= self.deadline:
            self.cut = True
        return self.cut

    def check(self) -> None:
        """Raise :class:`Stopped` when :meth:`stopped`."""
        if self.stopped():
            raise Stopped

    def wall_left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())
