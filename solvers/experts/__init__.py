"""The expert placer: every MoE layer's expert map for a FIXED rank layout.

Once ``rank2gpu`` is fixed, every layer is an independent problem (:mod:`.problem`): experts go to
domain *classes* (the cross-domain part) and then to GPUs inside each class (load balance).  Per
layer (:mod:`.layer`): a greedy assignment with load prices (:mod:`.greedy`), a swap search with
exact deltas (:mod:`.swap`), then group-preserving layers a branch and bound over whole expert
groups (:mod:`.groups`) and free layers the CP-SAT model (:mod:`.cpsat_model`), a validation guard
against fitting the sample, and balancing (:mod:`.balance`).  Bounds: :mod:`.bounds`.  All layers,
their budgets (:mod:`.budget`) and the process pool: :mod:`.pool`.  Tunables: :mod:`.tuning`.
``docs/experts.md`` is the newcomer's guide and holds the measurements behind the tunables.

Units: inside this package costs are *crossings*, integers; bytes are crossings times
:attr:`LayerProblem.bytes_per_crossing` (from :func:`placement.predict.cost.fabric_bytes_per_crossing`), and
:func:`place_experts` checks every layer against the evaluator.

Determinism: nothing reads the clock to decide anything except the safety nets.  CP-SAT runs single
threaded with ``max_deterministic_time`` (a budget derived from the work budget,
:func:`deterministic_budget`) and a fixed ``random_seed``; ``max_time_in_seconds`` is a safety net
only (``wall_clock_cut`` in the details when it fires); swap searches, restarts and the iterated
local search count moves, never seconds.
"""

from solvers.experts.balance import balance_ranks, rank_load_floor, rank_load_ratio
from solvers.experts.bounds import ClassBound, per_pair_class_bound, sum_bounds, transport_optimum
from solvers.experts.budget import LayerBudget, StopCheck, deterministic_budget
from solvers.experts.cpsat_model import CpsatModel, CpsatRun, build_cpsat_model, run_cpsat
from solvers.experts.greedy import GreedyDomains, assign_classes, capped_greedy, greedy_expert_domains
from solvers.experts.groups import GroupSearchResult, group_search, num_group_assignments
from solvers.experts.layer import LayerOutcome, solve_layer
from solvers.experts.pool import ExpertPlan, LayerTask, LayerWorker, place_experts
from solvers.experts.problem import LayerProblem, NetSet, build_layer_problem, linear_costs, net_crossings
from solvers.experts.swap import SwapSearch, iterated_local_search
from solvers.experts import tuning
from solvers.experts.tuning import *  # noqa: F403  (the tunable constants, see tuning.__all__)

__all__ = [
    "NetSet",
    "LayerProblem",
    "LayerBudget",
    "StopCheck",
    "LayerOutcome",
    "LayerTask",
    "LayerWorker",
    "ExpertPlan",
    "GreedyDomains",
    "GroupSearchResult",
    "CpsatModel",
    "CpsatRun",
    "ClassBound",
    "build_layer_problem",
    "net_crossings",
    "linear_costs",
    "assign_classes",
    "capped_greedy",
    "greedy_expert_domains",
    "SwapSearch",
    "iterated_local_search",
    "num_group_assignments",
    "group_search",
    "balance_ranks",
    "rank_load_ratio",
    "rank_load_floor",
    "build_cpsat_model",
    "run_cpsat",
    "solve_layer",
    "place_experts",
    "deterministic_budget",
    "transport_optimum",
    "per_pair_class_bound",
    "sum_bounds",
] + list(tuning.__all__)
