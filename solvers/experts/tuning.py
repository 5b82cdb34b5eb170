"""The expert placer's tunable constants (the measurements behind them: ``docs/experts.md``)."""

from __future__ import annotations

__all__ = [
    "CLASS_LOAD_TOLERANCE",
    "CLASS_LOAD_TOLERANCE_GROUP_PRESERVING",
    "GPU_LOAD_TOLERANCE",
    "VALIDATION_FRACTION",
    "DET_PER_WALL_S",
    "OVERHEAD_S_PER_10K_NETS",
    "CPSAT_SHARE",
    "FIXED_OVERHEAD_S",
    "POOL_MIN_PAIRS",
    "MAX_SWAPS",
    "MAX_GROUP_ROUNDS",
    "CPSAT_DET_PER_LINK",
    "MAX_GROUP_ASSIGNMENTS",
    "SUBPROBLEM_MAX_FREE_EXPERTS",
    "MAX_REFINED_ASSIGNMENTS",
    "SEARCH_SHARE",
    "EXACT_S_PER_PAIR",
    "SEARCH_S_PER_LINK",
    "MIN_SEARCH_NETS",
    "ANYTIME_GRACE_S",
    "STOP_GRACE_S",
    "USE_KAHYPAR_START",
    "GROUP_START_SHARE",
]

#: A class's load may exceed its proportional share of each EP group's (token, expert) pairs by this
#: fraction in free mode: the GPU target's, so a class at its cap can still be balanced to the target
#: inside (relaxed per layer, and reported, only when no map meets it).
CLASS_LOAD_TOLERANCE = 0.10
#: The same in group-preserving mode, tighter: there per-GPU balance is set by whole groups' loads
#: and by which experts of a split group share a few ranks, and a looser class cap lets heavy
#: experts pile into split group positions.
CLASS_LOAD_TOLERANCE_GROUP_PRESERVING = 0.05
#: Target for every EP group's expert load max/mean per GPU after balancing (met where routing allows).
GPU_LOAD_TOLERANCE = 1.10
#: Share of each source's sampled tokens (the last ones) held back to validate candidates.
VALIDATION_FRACTION = 0.25
#: CP-SAT deterministic-time units per wall second of one worker (model building included), the
#: value measured on a loaded machine (``python benchmarks/solve_bench.py --calibrate``), so a busy
#: machine still fits the limit.  Budgets are set in deterministic time so results do not depend on
#: the load; this ratio only converts the work budget into such a budget.
DET_PER_WALL_S = 0.2
#: Wall seconds charged per layer for everything that is not CP-SAT (greedy, local search,
#: balancing, bookkeeping), per 10,000 aggregated nets; used only to size the CP-SAT budget.
OVERHEAD_S_PER_10K_NETS = 0.8
#: Share of the work budget (less the fixed reserve) planned for CP-SAT; the rest is slack.
CPSAT_SHARE = 0.6
#: Fixed wall seconds kept for process start-up, the final evaluation and writing.
FIXED_OVERHEAD_S = 6.0
#: Sampled (token, expert) pairs on straddling layers from which a process pool pays for its start.
POOL_MIN_PAIRS = 200_000
#: Local-search limits (deterministic: counted in swaps and rounds, never in seconds).
MAX_SWAPS = 400
MAX_GROUP_ROUNDS = 8
#: CP-SAT needs about this much deterministic time per (net, expert, remote class) link of a full
#: model to return more than its hint; with less, the model is not built.
CPSAT_DET_PER_LINK = 2e-5
#: Most group -> position-type assignments enumerated per layer (beyond it, the free-mode path with
#: group-preserving moves).
MAX_GROUP_ASSIGNMENTS = 3000
#: CP-SAT gets an assignment's subproblem only when at most this many experts are free in it.
SUBPROBLEM_MAX_FREE_EXPERTS = 20
#: Assignments whose split-group bound is computed (lowest forced crossings first); the others keep
#: their forced crossings as bound.
MAX_REFINED_ASSIGNMENTS = 300
#: Share of a layer's planned work (``solvers.experts.budget.layer_work_s``) meant for its search; the
#: rest is slack for a loaded machine.
SEARCH_SHARE = 0.6
#: Wall seconds per sampled (token, expert) pair of what runs on all of a layer's nets whatever the
#: search (aggregation, exact scoring of the candidates, balancing); sizes the search only.
EXACT_S_PER_PAIR = 2e-6
#: Wall seconds per (net, expert, class) link of a layer's search (swap search from every start, the
#: layer's search, the refit); beyond the nets that fit, the search sees a seeded unbiased sample.
SEARCH_S_PER_LINK = 5e-6
#: The search always sees at least this many nets (or all of them).
MIN_SEARCH_NETS = 2_000
#: Layers stop their work this many seconds (at most a fifth of the time left) before the expert
#: placer's deadline and return their best map so far, so that a process pool's results arrive before
#: the parent stops waiting for them.
ANYTIME_GRACE_S = 3.0
#: At a stop request (not the deadline), how long the process pool waits for the layers in flight
#: to return their best maps so far (they poll the relayed request between units of work) before
#: its workers are killed and the rest keep their fallback map.
STOP_GRACE_S = 1.0
#: Also start the swap search from Mt-KaHyPar's partition (the ``peers`` extra) when installed.  Off:
#: the multilevel coarsening start (no extra) matched it on the real routing instances, and with it
#: off a placement does not depend on whether the extra is installed (``docs/experts.md``).
USE_KAHYPAR_START = False
#: Free mode on a model with expert groups: share of a layer's deterministic budget for the group
#: search (group-preserving mode's search, within the free caps) whose map is one more start, so a
#: free map is never worse on the fit tokens than the group-preserving search's.
GROUP_START_SHARE = 0.2
