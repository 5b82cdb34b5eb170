"""What a layer may spend, and when it must stop.

The deterministic fields decide the result; the wall clock (the deadline) and stop requests are a
safety net only.  :func:`deterministic_budget` turns the work budget into CP-SAT deterministic time
per layer without reading the clock, so the same budget gives the same results on a busy or an idle
machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from solvers.base import SolveOptions
from solvers.experts.tuning import CPSAT_SHARE, DET_PER_WALL_S, FIXED_OVERHEAD_S, OVERHEAD_S_PER_10K_NETS

__all__ = ["LayerBudget", "StopCheck", "deterministic_budget"]


@dataclass(frozen=True)
class LayerBudget:
    """How much one layer may spend.

    deterministic_time : CP-SAT deterministic-time budget of the layer (both phases together).
    seed : CP-SAT ``random_seed`` of the layer.
    deadline : ``time.monotonic()`` instant after which the layer returns its best at once.
    wall_factor : a CP-SAT call may run ``wall_factor * budget / DET_PER_WALL_S`` wall seconds.
    """

    deterministic_time: float
    seed: int
    deadline: float
    wall_factor: float = 4.0


@dataclass(frozen=True)
class StopCheck:
    """Whether a layer's work must end now: its deadline passed or (in the calling process, where
    ``options`` is given) the caller asked to stop.  Calling it returns the answer."""

    deadline: float
    options: SolveOptions | None = None

    def __call__(self) -> bool:
        if time.monotonic() >= self.deadline:
            return True
        return bool(self.options is not None and self.options.should_stop())

    def wall_left_s(self) -> float:
        """Seconds until the deadline (may be negative)."""
        return self.deadline - time.monotonic()


def deterministic_budget(work_budget_s: float, num_workers: int, weights: Sequence[float],
                         pairs: Sequence[float] | None = None) -> list[float]:
    """CP-SAT deterministic time per layer from the solver's work budget (deterministic).

    Of the budget less :data:`~solvers.experts.tuning.FIXED_OVERHEAD_S`,
    :data:`~solvers.experts.tuning.CPSAT_SHARE` is meant for CP-SAT (the rest is slack for a loaded
    machine); the estimated non-CP-SAT work (greedy, local search, enumeration, balancing:
    :data:`~solvers.experts.tuning.OVERHEAD_S_PER_10K_NETS` per 10,000 sampled tokens of top-8,
    scaled by ``pairs``) comes off that, and what is left, times the workers and
    :data:`~solvers.experts.tuning.DET_PER_WALL_S`, is shared in proportion to ``weights``.  It
    depends only on its arguments, never on the clock.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        return [0.0] * len(w)
    workers = max(1, int(num_workers))
    tokens_equiv = (np.asarray(pairs, dtype=np.float64) if pairs is not None else w) / 8.0
    overhead = OVERHEAD_S_PER_10K_NETS * float(tokens_equiv.sum()) / 1e4 / workers
    wall = max(0.0, (work_budget_s - FIXED_OVERHEAD_S) * CPSAT_SHARE - overhead)
    total = wall * workers * DET_PER_WALL_S
    return [float(x) for x in total * w / w.sum()]
