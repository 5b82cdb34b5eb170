"""placement: topology-aware expert placement for Mixture-of-Experts training.

The public API (see :mod:`placement.api`): :func:`load_instance`, :func:`solve`,
:func:`evaluate_placement`, :func:`check_placement`, :func:`save_result`,
:func:`verify_placement`, :func:`export_placement`, :class:`SignalStop`; recorded routing in with
:func:`import_routing` / :func:`save_instance`, checked with :func:`routing_stats`; the cluster
as the scheduler sees it with :func:`cluster_from_slurm`, :func:`cluster_from_kubernetes`,
:func:`cluster_from_nvidia_smi` (:func:`write_cluster`), a job's hosts with :func:`allocate`;
the model in :mod:`placement.core.model`; the cost model in :mod:`placement.predict.cost`.  Every error raised
on purpose is a :class:`PlacementError`; its ``exit_code`` is what the CLI exits with.
"""

from typing import TYPE_CHECKING, Any

from placement import _moved

_moved.install()  # the old module paths (placement.cost, placement.runtime, ...) stay importable

from placement.api import (  # noqa: E402
    DEFAULT_SOLVER,
    allocate,
    allocate_cluster,
    allocation_hosts,
    cluster_from_kubernetes,
    cluster_from_nvidia_smi,
    cluster_from_slurm,
    write_cluster,
    FINISH_RESERVE_S,
    Interrupted,
    SignalStop,
    check_placement,
    estimate_finish_s,
    evaluate_placement,
    export_placement,
    import_routing,
    load_instance,
    load_placement,
    predict_performance,
    calibrate,
    result_document,
    routing_stats,
    save_instance,
    save_result,
    solve,
    SolveRequest,
    solver_budget_s,
    solver_names,
    verify_placement,
)
from placement.core.model import (
    InfeasibleError,
    Instance,
    InvalidInputError,
    Placement,
    PlacementError,
    SolverError,
)


# placement plan (placement/plan/): after this import the name ``placement.plan`` is the function
# (``placement.plan(job, cluster, ...)``); the subpackage stays importable as ``placement.plan.*``.
from placement.plan import (  # noqa: E402
    CandidateSpace,
    ClusterSpec,
    Job,
    PlanResult,
    PlanRow,
    parse_candidates,
    plan,
    plan_document,
    plan_table,
    read_cluster,
    read_job,
    write_plan,
)

if TYPE_CHECKING:
    from solvers.base import SolveOptions, SolveResult

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOLVER",
    "FINISH_RESERVE_S",
    "load_instance",
    "load_placement",
    "check_placement",
    "evaluate_placement",
    "predict_performance",
    "calibrate",
    "solver_names",
    "estimate_finish_s",
    "solver_budget_s",
    "solve",
    "SolveRequest",
    "save_result",
    "result_document",
    "verify_placement",
    "export_placement",
    "import_routing",
    "save_instance",
    "routing_stats",
    "cluster_from_slurm",
    "cluster_from_kubernetes",
    "cluster_from_nvidia_smi",
    "write_cluster",
    "allocate",
    "allocate_cluster",
    "allocation_hosts",
    "SignalStop",
    "Interrupted",
    "SolveOptions",
    "SolveResult",
    "Instance",
    "Placement",
    "PlacementError",
    "InvalidInputError",
    "InfeasibleError",
    "SolverError",
    "plan",
    "read_job",
    "read_cluster",
    "write_plan",
    "plan_table",
    "plan_document",
    "parse_candidates",
    "CandidateSpace",
    "ClusterSpec",
    "Job",
    "PlanResult",
    "PlanRow",
]


def __getattr__(name: str) -> Any:
    # The solver types live in the solvers package, which imports placement: resolve them lazily.
    if name in ("SolveOptions", "SolveResult"):
        import solvers.base

        return getattr(solvers.base, name)
    raise AttributeError(f"module 'placement' has no attribute {name!r}")
