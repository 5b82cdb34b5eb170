"""The solve's time budget: the reserves kept back from a time limit and the solver's work budget.

See :mod:`placement.api` ("Deadlines") for the two clocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from placement.core.model import Instance

__all__ = [
    "DEFAULT_SOLVER",
    "FINISH_RESERVE_S",
    "SCORING_S_PER_EXPERT_ID",
    "STARTUP_RESERVE_S",
    "LOAD_HEADROOM",
    "SPLIT_SCORING_RUNS",
    "MAX_SEED",
    "MAX_WORKERS",
    "estimate_finish_s",
    "answer_reserve_s",
    "solver_budget_s",
]

DEFAULT_SOLVER = "cpsat"
# Seconds kept back from the time limit, beyond the scoring estimate, for checking the answer,
# building its document and writing the file.  Measured overruns are in the README.
FINISH_RESERVE_S = 0.5
# Scoring cost per routed expert id (both windows), used to reserve time for scoring the answer:
# a conservative figure (a dsv3_1024 report, 5.7 M ids, takes 0.16 s of CPU, 28 ns per id, and up
# to 3x that in wall time on the loaded 2-core build machine), so the estimate errs early.
SCORING_S_PER_EXPERT_ID = 1e-7
# Interpreter start-up, imports and reading the instance, as the solver's work budget assumes them
# (0.3-0.7 s measured for dsv3_1024 under load); slower starts are caught by the wall deadline.
STARTUP_RESERVE_S = 1.0
# The deterministic work is sized for a machine this many times slower than its predictions (a load
# of 4 on two cores), so that the wall-clock deadline, a safety net, does not end the work and the
# file does not depend on how busy the machine is (tests/test_determinism_under_load.py).  It was 2
# until the dispatcher's node rule, the lasting-load estimate and the pipeline split made each
# scoring about 3x dearer than the work predictions assume: a dsv3_256 solve at 2 then took 96 s of
# its 100 s on an idle 2-core machine, so two of them beside a CPU hog were cut by the clock.
LOAD_HEADROOM = 4.0
# Sampled-window evaluations placement.predict.pipeline_split.choose_layout runs at most (item prices and
# four candidates).
SPLIT_SCORING_RUNS = 5
MAX_SEED = 2**31 - 1  # CP-SAT's random_seed is a 32-bit integer
MAX_WORKERS = 1024


def estimate_finish_s(instance: Instance) -> float:
    """Seconds to keep back for checking, scoring and writing a solver's answer.

    :data:`FINISH_RESERVE_S` plus :data:`SCORING_S_PER_EXPERT_ID` per routed expert id of both
    windows (about 1.1 s for dsv3_1024), plus :data:`SPLIT_SCORING_RUNS` sampled windows for the
    pipeline split when the instance has a pipeline and a performance block.
    """
    ids = instance.routing.topk.size
    if instance.routing.heldout_topk is not None:
        ids += instance.routing.heldout_topk.size
    if instance.performance is not None and instance.parallel.pp > 1:
        # The pipeline split's scoring (placement.predict.pipeline_split): up to five sampled-window runs.
        ids += SPLIT_SCORING_RUNS * instance.routing.topk.size
    return FINISH_RESERVE_S + SCORING_S_PER_EXPERT_ID * ids


def solver_budget_s(instance: Instance, time_limit_s: float) -> float:
    """The solver's work budget for a command limited to ``time_limit_s`` (deterministic).

    ``time_limit_s`` less :data:`STARTUP_RESERVE_S` (start-up and loading), one scoring estimate
    for the CLI's default-layout baseline and :func:`estimate_finish_s` (checking, scoring, writing
    the answer), never below 0, divided by :data:`LOAD_HEADROOM`.  It depends on the instance's
    size only, never on the clock.
    """
    scoring_s = estimate_finish_s(instance) - FINISH_RESERVE_S
    return max(0.0, time_limit_s - STARTUP_RESERVE_S - scoring_s - estimate_finish_s(instance)) / LOAD_HEADROOM


def answer_reserve_s(scoring_s: float) -> float:
    """The ``finish_reserve_s`` of a caller that timed one scoring on this machine (``scoring_s``
    wall seconds, e.g. :func:`placement.api.default_layout_report`): :data:`FINISH_RESERVE_S` plus
    1.5 scorings, for checking, scoring and writing the answer."""
    return FINISH_RESERVE_S + 1.5 * scoring_s
