"""The Python API: what job schedulers and notebooks call.  Nothing here prints.

Every error a caller can cause is a :class:`~placement.core.model.PlacementError` (``InvalidInputError``,
``InfeasibleError``, ``SolverError``), whose ``exit_code`` is what the CLI would exit with; a bug
inside a solver surfaces as ``SolverError`` too.

>>> import placement
>>> inst = placement.load_instance("instances/tiny.json")                  # doctest: +SKIP
>>> result = placement.solve(inst, time_limit_s=10, seed=0)                 # doctest: +SKIP
>>> result.metrics["heldout_cross_domain_bytes_per_step"]                   # doctest: +SKIP
>>> placement.save_result(inst, result, "tiny.placement.json")              # doctest: +SKIP

Deadlines
---------
``solve(..., time_limit_s=T, started_at=t0)`` returns by ``t0 + T`` (a ``time.monotonic()``
instant; default: when ``solve`` is called) within a small margin: the solver gets the budget less
a reserve for checking and scoring its answer, :data:`FINISH_RESERVE_S` plus the scoring time
(estimated from the instance's size, or passed as ``finish_reserve_s`` by a caller that measured
it).  Pass the instant before :func:`load_instance` as ``started_at`` to count loading as well.

Two clocks: the solver's *work budget* (``SolveOptions.work_budget_s``, which solvers with
deterministic budgets size their work by) is :func:`solver_budget_s`: the limit less overheads
estimated from the instance's size alone, so the same limit gives the same placement on a busy
or an idle machine.  The wall-clock ``SolveOptions.deadline`` is the safety net that holds the
limit when the machine is slower than estimated.
Setting ``stop_event`` (a :class:`threading.Event`) from another thread or a signal handler makes
the solver return the best complete placement it has found so far; the result then carries
``details["interrupted"] = True``.

Modules
-------
:mod:`~placement.api.solving` ``solve`` as named steps over one :class:`SolveRequest`
(:mod:`~placement.api.request`: the options, their defaults and checks); :mod:`~placement.api.budget` the time
reserves and the work budget; :mod:`~placement.api.placements` load, check, score, verify and
export placements; :mod:`~placement.api.results` a solve result as a placement file;
:mod:`~placement.api.routing` recorded routing in; :mod:`~placement.api.calibration` the
step-time model against measured runs; :mod:`~placement.api.cluster` discovery and
allocations; :mod:`~placement.api.signals` SIGINT/SIGTERM around a solve.  Import names from
``placement.api`` (or ``placement``), not from these modules.
"""

from placement.api.budget import (
    DEFAULT_SOLVER,
    FINISH_RESERVE_S,
    LOAD_HEADROOM,
    MAX_SEED,
    MAX_WORKERS,
    SCORING_S_PER_EXPERT_ID,
    SPLIT_SCORING_RUNS,
    STARTUP_RESERVE_S,
    answer_reserve_s,
    estimate_finish_s,
    solver_budget_s,
)
from placement.api.calibration import LogLadder, calibrate, cross_validate, ladder_from_logs
from placement.api.cluster import (
    allocate,
    allocate_cluster,
    allocation_hosts,
    cluster_from_kubernetes,
    cluster_from_nvidia_smi,
    cluster_from_slurm,
    write_cluster,
)
from placement.api.placements import (
    DefaultLayoutReport,
    check_placement,
    default_layout_report,
    default_placement,
    evaluate_placement,
    export_placement,
    load_instance,
    load_placement,
    predict_performance,
    show_placement,
    solver_names,
    verify_placement,
)
from placement.api.results import result_document, result_pipeline_layout, save_result
from placement.api.routing import import_routing, routing_drift, routing_stats, save_instance
from placement.api.request import SolveRequest
from placement.api.signals import Interrupted, SignalStop
from placement.api.solving import solve

__all__ = [
    "DEFAULT_SOLVER",
    "FINISH_RESERVE_S",
    "SCORING_S_PER_EXPERT_ID",
    "LOAD_HEADROOM",
    "MAX_SEED",
    "MAX_WORKERS",
    "load_instance",
    "load_placement",
    "check_placement",
    "evaluate_placement",
    "predict_performance",
    "calibrate",
    "cross_validate",
    "ladder_from_logs",
    "LogLadder",
    "default_placement",
    "default_layout_report",
    "DefaultLayoutReport",
    "answer_reserve_s",
    "solver_names",
    "estimate_finish_s",
    "SPLIT_SCORING_RUNS",
    "solver_budget_s",
    "STARTUP_RESERVE_S",
    "solve",
    "SolveRequest",
    "result_document",
    "result_pipeline_layout",
    "save_result",
    "verify_placement",
    "export_placement",
    "show_placement",
    "Interrupted",
    "SignalStop",
    "import_routing",
    "save_instance",
    "routing_stats",
    "routing_drift",
    "allocate",
    "allocate_cluster",
    "allocation_hosts",
    "cluster_from_slurm",
    "cluster_from_kubernetes",
    "cluster_from_nvidia_smi",
    "write_cluster",
]
