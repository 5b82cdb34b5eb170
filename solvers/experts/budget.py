"""What a layer may spend, and when it must stop.

The deterministic fields decide the result; the wall clock (the deadline) and stop requests are a
safety net only.  :func:`deterministic_budget` turns the work budget into CP-SAT deterministic time
per layer without reading the clock, so the same budget gives the same results on a busy or an idle
machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from solvers.base import SolveOptions
from solvers.experts.tuning import (
    CPSAT_SHARE,
    DET_PER_WALL_S,
    EXACT_S_PER_PAIR,
    FIXED_OVERHEAD_S,
    MIN_SEARCH_NETS,
    OVERHEAD_S_PER_10K_NETS,
    SEARCH_S_PER_LINK,
    SEARCH_SHARE,
)

__all__ = ["LayerBudget", "StopCheck", "deterministic_budget", "layer_work_s", "search_net_limit"]


@dataclass(frozen=True)
class LayerBudget:
    """How much one layer may spend.

    deterministic_time : CP-SAT deterministic-time budget of the layer (both phases together).
    seed : CP-SAT ``random_seed`` of the layer.
    deadline : ``time.monotonic()`` instant after which the layer returns its best at once.
    wall_factor : a CP-SAT call may run ``wall_factor * budget / DET_PER_WALL_S`` wall seconds.
    search_nets : most nets the layer's searches see (beyond it a seeded unbiased sample;
        :func:`search_net_limit`); None: all of them.
    """

    deterministic_time: float
    seed: int
    deadline: float
    wall_factor: float = 4.0
    search_nets: int | None = None


@dataclass(frozen=True)
class StopCheck:
    """Whether a layer's work must end now: its deadline passed or (in the calling process, where
    ``options`` is given) the caller asked to stop.  Calling it returns the answer."""

    deadline: float
    options: SolveOptions | None = None
    fired: list = field(default_factory=list, compare=False)  # one entry per call that said stop

    def __call__(self) -> bool:
        stop = time.monotonic() >= self.deadline or bool(self.options is not None and self.options.should_stop())
        if stop:
            self.fired.append(True)
        return stop

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


def layer_work_s(work_budget_s: float, num_workers: int, weights: Sequence[float]) -> list[float]:
    """Wall seconds of work each layer may plan (deterministic: a function of its arguments only).

    The layers (heaviest first, ties by index) are dealt to ``num_workers`` workers, each to the
    least loaded one (by weight); a layer gets its weight's share of its worker's
    ``work_budget_s - FIXED_OVERHEAD_S``, so every worker's layers together fit that.  A layer of
    weight 0 (trivial) gets 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    out = [0.0] * len(w)
    avail = max(0.0, float(work_budget_s) - FIXED_OVERHEAD_S)
    workers = max(1, int(num_workers))
    load = np.zeros(workers)
    worker_of: dict[int, int] = {}
    for i in sorted(range(len(w)), key=lambda i: (-w[i], i)):
        if w[i] <= 0:
            continue
        j = int(np.argmin(load))
        load[j] += w[i]
        worker_of[i] = j
    for i, j in worker_of.items():
        out[i] = float(avail * w[i] / load[j])
    return out


def search_net_limit(work_s: float, pairs: float, top_k: int, num_classes: int) -> int | None:
    """Most nets one layer's search may see, from its planned work and its sizes (deterministic).

    Of ``work_s`` (:func:`layer_work_s`), :data:`~solvers.experts.tuning.SEARCH_SHARE` is meant for
    the search (the rest is slack for a loaded machine), less what runs on all ``pairs`` sampled
    (token, expert) pairs whatever the search (aggregation, exact scoring, balancing:
    :data:`~solvers.experts.tuning.EXACT_S_PER_PAIR` each).  The search (the swap search from every
    start, the layer's search, the refit) costs about :data:`~solvers.experts.tuning.SEARCH_S_PER_LINK`
    per (net, expert, class) link.  Returns the nets that fit, at least
    :data:`~solvers.experts.tuning.MIN_SEARCH_NETS`, or None when a layer this size fits whole
    (every net's expert set distinct: ``pairs / top_k`` nets).

    Examples
    --------
    >>> search_net_limit(1000.0, 8e4, 8, 4) is None     # a small layer: all of its nets
    True
    >>> search_net_limit(5.0, 1e6, 8, 4) < 1e6 / 8      # a big layer on a small budget: a sample
    True
    """
    k, C = max(1, int(top_k)), max(2, int(num_classes))
    search_s = max(0.0, float(work_s) * SEARCH_SHARE - EXACT_S_PER_PAIR * float(pairs))
    limit = max(MIN_SEARCH_NETS, int(search_s / (SEARCH_S_PER_LINK * k * C)))
    return None if limit >= pairs / k else limit
