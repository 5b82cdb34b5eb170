"""``placement plan``: pick the job's parallel layout and placement for the GPUs that are free.

One module per concern: :mod:`~placement.formats.job` (job and cluster files, their checks),
:mod:`~placement.plan.memory` (memory per GPU), :mod:`~placement.plan.candidates` (enumeration
and its rules), :mod:`~placement.plan.bounds` (compute-bound upper bounds), :mod:`~placement.plan.evaluate`
(placing and scoring one candidate, in a worker), :mod:`~placement.plan.planner` (the schedule:
bound, prune, solve best-bound first) and :mod:`~placement.plan.report` (JSON, table, files).
``docs/plan.md`` states the formulas and rules.

``placement.plan`` (the attribute of the package ``placement``) is the function :func:`plan`:

>>> import placement
>>> job = placement.read_job("instances/dsv3_job.json")                           # doctest: +SKIP
>>> cluster = placement.read_cluster("instances/dsv3_1024_cluster.json")           # doctest: +SKIP
>>> result = placement.plan(job, cluster, time_limit_s=300)                        # doctest: +SKIP
>>> result.recommendation.key, result.recommendation.job_tokens_per_s              # doctest: +SKIP
"""

from placement.plan.candidates import DEFAULT_SPACE, Candidate, CandidateSpace, parse_candidates
from placement.formats.job import ClusterSpec, Job, RoutingSource, Training, read_cluster, read_job
from placement.plan.memory import MemoryEstimate
from placement.plan.planner import DEFAULT_PLAN_TIME_LIMIT_S, PlanResult, PlanRow, plan
from placement.plan.report import plan_document, plan_table, write_plan

__all__ = [
    "Candidate",
    "CandidateSpace",
    "ClusterSpec",
    "DEFAULT_PLAN_TIME_LIMIT_S",
    "DEFAULT_SPACE",
    "Job",
    "MemoryEstimate",
    "PlanResult",
    "PlanRow",
    "RoutingSource",
    "Training",
    "parse_candidates",
    "plan",
    "plan_document",
    "plan_table",
    "read_cluster",
    "read_job",
    "write_plan",
]
