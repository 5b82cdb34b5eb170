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
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import numpy as np

from placement.core.checker import check, check_or_raise
from placement.predict.cost import Window, evaluate
from placement.predict.report import report
from placement.formats import placement_document, read_instance, read_placement, write_placement
from placement.sources.discovery import cluster_from_kubernetes, cluster_from_nvidia_smi, cluster_from_slurm, write_cluster
from placement.core.model import (Apply, Cluster, InfeasibleError, Instance, InvalidInputError, Placement, PlacementError,
                             SolverError)
from placement.predict.performance import Prediction, StepTimeModel

if TYPE_CHECKING:  # solvers imports placement: import it lazily at run time
    from placement.predict.calibration import Calibration
    from placement.app.verify import VerifyReport
    from solvers.base import Consumer, Fit, LayoutMode, Objective, SolveResult

__all__ = [
    "DEFAULT_SOLVER",
    "FINISH_RESERVE_S",
    "SCORING_S_PER_EXPERT_ID",
    "MAX_SEED",
    "MAX_WORKERS",
    "load_instance",
    "load_placement",
    "check_placement",
    "evaluate_placement",
    "predict_performance",
    "calibrate",
    "solver_names",
    "estimate_finish_s",
    "SPLIT_SCORING_RUNS",
    "solver_budget_s",
    "STARTUP_RESERVE_S",
    "solve",
    "result_document",
    "save_result",
    "verify_placement",
    "export_placement",
    "Interrupted",
    "SignalStop",
    "import_routing",
    "save_instance",
    "routing_stats",
    "allocate",
    "allocate_cluster",
    "allocation_hosts",
    "cluster_from_slurm",
    "cluster_from_kubernetes",
    "cluster_from_nvidia_smi",
    "write_cluster",
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


def load_instance(path: str | os.PathLike[str]) -> Instance:
    """Read and validate an instance file and its routing ``.npz``.

    Parameters
    ----------
    path : the instance JSON; its ``routing.file`` is resolved inside the same folder.

    Returns
    -------
    Instance, with ``sha256`` identifying its files.

    Raises
    ------
    InvalidInputError
        One line naming the file and the field (malformed JSON, wrong types, sizes out of range,
        a missing, truncated or pickled ``.npz``, a path escaping the folder, ...).
    """
    return read_instance(path)


def load_placement(instance: Instance, path: str | os.PathLike[str]) -> Placement:
    """Read a placement file and check it against ``instance``.

    Raises
    ------
    InvalidInputError
        The file is malformed, or the checker finds a violation (the first is named).
    """
    placement, _ = read_placement(path)
    check_or_raise(instance, placement)
    return placement


def check_placement(instance: Instance, placement: Placement) -> list[str]:
    """Every structural violation of ``placement`` against ``instance`` (empty: valid)."""
    return check(instance, placement)


def evaluate_placement(instance: Instance, placement: Placement) -> dict[str, Any]:
    """The evaluator's report on the sampled and the held-out window.

    Returns
    -------
    dict of :class:`placement.predict.cost.Metrics` fields (per optimizer step); held-out twins carry the
    prefix ``heldout_``.

    Raises
    ------
    InvalidInputError
        The placement violates the instance (checked first).
    """
    check_or_raise(instance, placement)
    return report(instance, placement)


def predict_performance(instance: Instance, placement: Placement, *, window: Window = "heldout") -> Prediction:
    """Predicted step time, tokens/s and TFLOP/s per GPU of ``placement`` on one routing window.

    The same figures as the report's ``predicted_*`` keys (:mod:`placement.predict.performance`), typed.

    Raises
    ------
    InvalidInputError
        The placement violates the instance, or the instance has no ``performance`` block.
    """
    check_or_raise(instance, placement)
    if instance.performance is None:
        raise InvalidInputError(f"{instance.name}: performance: the instance has no performance block")
    metrics = evaluate(instance, placement, window=window)
    return StepTimeModel(instance).predict_metrics(metrics, placement.rank2gpu)


def calibrate(
    rows: str | os.PathLike[str] | None = None,
    fit: Sequence[str] = ("gemm_efficiency", "gemm_half_shape", "fp8_gemm_ratio", "elementwise_bytes"),
) -> Calibration:
    """Predict the measured runs of a ladder file and fit the step-time model on its ``fit`` rows.

    Parameters
    ----------
    rows : a ladder file (docs/formats.md); ``None`` = the published ladder shipped with the package.
    fit : parameters to fit (:data:`placement.predict.calibration.FITTABLE`).

    Returns
    -------
    :class:`placement.predict.calibration.Calibration`: every row's prediction and error, the fitted values,
    the median absolute error of the rows not fitted and the fitted ``performance`` block.
    """
    from placement.predict.calibration import calibrate as _calibrate, default_ladder_path, read_ladder

    return _calibrate(read_ladder(default_ladder_path() if rows is None else rows), fit)


def solver_names() -> list[str]:
    """The registered solver names, sorted (what ``solver=`` accepts)."""
    from solvers import SOLVERS

    return sorted(SOLVERS)


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


def _check_arguments(
    solver: str,
    time_limit_s: float,
    seed: int,
    num_workers: int | None,
    consumer: str,
    group_preserving: bool | None,
    objective: str,
    layout: str,
    finish_reserve_s: float | None,
    apply: str | None = None,
) -> None:
    from placement.core.model import APPLY_MODES
    from solvers import CONSUMERS, LAYOUT_MODES, OBJECTIVES, SOLVERS

    def choice(name: str, value: object, choices: tuple[str, ...] | list[str]) -> None:
        if not isinstance(value, str) or value not in choices:
            raise InvalidInputError(f"{name}: expected one of {', '.join(choices)}, found {value!r}")

    choice("solver", solver, sorted(SOLVERS))
    choice("consumer", consumer, CONSUMERS)
    choice("objective", objective, OBJECTIVES)
    choice("layout", layout, LAYOUT_MODES)
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
        math.isfinite(time_limit_s) and time_limit_s > 0
    ):
        raise InvalidInputError(f"time_limit_s: expected a positive, finite number of seconds, found {time_limit_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InvalidInputError(f"seed: expected an integer in [0, {MAX_SEED}], found {seed!r}")
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or not 1 <= num_workers <= MAX_WORKERS
    ):
        raise InvalidInputError(f"num_workers: expected an integer in [1, {MAX_WORKERS}] or None, found {num_workers!r}")
    if group_preserving not in (None, True, False):
        raise InvalidInputError(f"group_preserving: expected True, False or None, found {group_preserving!r}")
    if apply is not None:
        choice("apply", apply, APPLY_MODES)
    if finish_reserve_s is not None and not (math.isfinite(finish_reserve_s) and finish_reserve_s >= 0):
        raise InvalidInputError(f"finish_reserve_s: expected a non-negative number of seconds, found {finish_reserve_s!r}")


def solve(
    instance: Instance,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float = 60.0,
    wall_limit_s: float | None = None,
    seed: int = 0,
    num_workers: int | None = None,
    consumer: Consumer | None = None,
    group_preserving: bool | None = None,
    apply: Apply | None = None,
    objective: Objective = "step_time",
    layout: LayoutMode = "optimize",
    progress: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    started_at: float | None = None,
    stop_event: threading.Event | None = None,
    finish_reserve_s: float | None = None,
    previous: Placement | None = None,
    max_moved_bytes: float | None = None,
    move_cost: float | None = None,
    expert_params: int | None = None,
    sharded_optimizer: bool = True,
    fit: Fit = "robust",
    redundant_experts: int | Literal["auto"] = 0,
    replica_rule: str = "search",
    replica_memory_budget_bytes: float | None = None,
    pipeline_split: bool = True,
) -> SolveResult:
    """Solve ``instance`` with a registered solver, check the answer and score it.

    Parameters
    ----------
    instance : the problem; the solver sees :meth:`~placement.core.model.Instance.for_solver` (no
        held-out window), the evaluator scores both windows.
    solver : a name from :func:`solver_names`.
    time_limit_s : wall-clock budget of the whole call, counted from ``started_at``; the solver
        works for :func:`solver_budget_s` and returns by the wall deadline at the latest.
    wall_limit_s : the wall-clock safety net when it should differ from ``time_limit_s`` (default:
        ``time_limit_s``): the call returns by ``started_at + wall_limit_s`` while its work is still
        sized by ``time_limit_s`` alone (:func:`solver_budget_s`).  ``placement.plan`` gives its
        solves a net a few times their budget, so that a loaded machine does not cut them; when the
        net does cut some work, ``SolveResult.wall_clock_cut`` says so.
    seed : random seed in ``[0, MAX_SEED]``; the same instance, seed and options give the same
        placement when the solver finishes before its deadline.
    num_workers : solver threads/processes, ``[1, MAX_WORKERS]``; default: the cores available to
        this process (CPU affinity, capped by a cgroup CPU quota).
    consumer : ``none``, ``deepep`` or ``hybridep``: the rank-layout rule of the dispatcher;
        ``None`` (the default) follows the instance's ``performance.dispatcher``
        (:func:`solvers.base.default_consumer`: ``hybridep``/``deepep`` -> that rule, else ``none``).
    apply : how the expert maps reach the job: ``runtime`` (a dispatch-time map:
        :mod:`placement.consumers.runtime` hooks for Megatron-Core and TorchTitan with a keep-router checkpoint
        permutation, SGLang's and vLLM's expert maps; any map is valid) or ``checkpoint`` (router and
        experts renumbered offline; under group-limited routing the maps keep expert groups whole);
        ``None``: the instance's ``apply`` field, else ``runtime``.
    group_preserving : an explicit override of the expert-map mode (``None``, the default, follows
        ``apply``: group-preserving exactly under ``checkpoint`` and group-limited routing).  True
        restricts a ``runtime`` solve to group-preserving maps; False with ``checkpoint`` under
        group-limited routing is refused (the checkpoint permutation would change the routing);
        False with ``runtime`` fits free maps (by default a ``runtime`` solve under group-limited
        routing fits group-preserving maps, then weighs free ones in the step-time check:
        :meth:`solvers.base.SolveOptions.fit_groups_whole`).
    objective : ``step_time`` (default: predicted step time, bytes break ties; ``total`` on an
        instance without a ``performance`` block), ``total`` cross-domain bytes or the
        ``bottleneck`` (slowest stage's busiest NIC).
    layout : ``optimize`` the rank -> GPU map, or keep the default one (``fixed``).
    progress : called with one-line progress messages (never printed by the library).
    on_progress : called with ``(MoE layers whose expert map is finished, MoE layers to place)`` as
        layers finish (``cpsat``; a :data:`placement.core.progress.ProgressCallback`, e.g. a bar's
        ``report``); it only observes, the placement does not depend on it.
    started_at : ``time.monotonic()`` instant the budget started (default: now).
    stop_event : when set (by another thread, a signal handler), the solver returns the best
        placement found so far; ``details["interrupted"]`` is then True.
    finish_reserve_s : seconds kept back for checking and scoring; default
        :func:`estimate_finish_s`.
    previous : re-place against this placement (same instance shape; ``cpsat`` only): the rank
        layout stays ``previous.rank2gpu`` (``layout`` is not searched) and only expert maps change,
        each moved expert replica costing its weights and optimizer state (:mod:`placement.predict.moves`).
        ``details["moves"]`` reports what moves and the steps to pay it back.
    max_moved_bytes : with ``previous``, a hard budget on the bytes moved (cross-rack plus NVLink)
        over the whole placement; 0 returns ``previous`` itself.
    move_cost : with ``previous``, the weight ``W`` of a moved byte in per-step all-to-all bytes
        (``1/N`` amortises the move over ``N`` steps; NVLink bytes weigh ``scaleout/nvlink`` as
        much).  Neither given: moves are free but ties keep experts in place.
    expert_params : parameters per routed expert (default: from the ``performance`` block).
    sharded_optimizer : the optimizer state is sharded over each expert's replicas (Megatron's
        distributed optimizer); False: every replica holds it whole.
    fit : over several time-ordered sampled windows (``routing.window_tokens``), the expert maps'
        objective: ``robust`` (default) the worst window, ``mean`` their sum, ``latest`` the latest
        window only; the guard against the default map judges on the latest window.  No effect on
        an instance with one sampled window.
    redundant_experts : ``N`` extra expert slots per MoE layer (SGLang's
        ``--ep-num-redundant-experts``), ``N / ep`` per GPU; ``E + N`` must divide over ``ep``.  The
        replicas are chosen after the permutation by ``replica_rule`` (``search``, the default:
        :mod:`solvers.replica_search`; ``hottest`` or ``eplb``: :mod:`placement.core.replicas`) and
        returned in ``details["replicas"]``, which the placement file holds as its ``replicas``
        block, with the evaluator's figures priced with them under ``priced``
        (:func:`placement.predict.report.report` with ``replicas=``; ``metrics`` stay the permutation's).
        ``"auto"``: the count among 0, ``ep`` and ``2 ep`` whose map predicts the fastest step on the
        sampled window (:func:`placement.app.replica_block.choose_redundant_experts`; 0 when no
        replica pays), each candidate's priced step under ``details["replicas"]["search"]["auto"]``.
    replica_memory_budget_bytes : the bytes per GPU the redundant slots may take (the instance
        carries no HBM size): ``auto`` skips the counts over it, a fixed count over it is refused;
        None: no budget.
    pipeline_split : with the ``step_time`` objective, a performance block, ``pp > 1`` and no
        ``previous``, choose the pipeline layer split for the answer's placement
        (:func:`placement.predict.pipeline_split.choose_layout`; never slower than the instance's split on
        the sampled window); ``details["pipeline_layout"]`` reports the candidates and the metrics
        are those of the chosen layout.  False keeps the instance's split.

    Returns
    -------
    solvers.SolveResult with ``metrics`` (the evaluator's report, sampled and ``heldout_`` keys)
    and ``wall_s`` (seconds since ``started_at``) filled in.

    Raises
    ------
    InvalidInputError
        A bad argument (the message names it).
    InfeasibleError
        The request cannot be met (too few GPUs, a consumer rule that cannot hold).
    SolverError
        The solver failed or returned an invalid placement.
    """
    from solvers import SolveOptions, get_solver
    from solvers.base import default_workers

    start = time.monotonic() if started_at is None else started_at
    from solvers.base import default_consumer

    consumer_defaulted = consumer is None
    consumer = default_consumer(instance) if consumer is None else consumer
    consumer_fallback: str | None = None
    if consumer_defaulted and consumer == "hybridep":
        from solvers.layout.rules import equal_slices_possible

        if layout == "fixed" or previous is not None:
            consumer_fallback = ("performance.dispatcher hybridep: the rank layout is kept, so HybridEP runs each EP "
                                 "group with the nodes it forms")
            consumer = "none"
        elif not equal_slices_possible(instance):
            # Laid out freely instead of refused (docs/design.md, "The dispatcher's node rule"): HybridEP
            # runs an unequal EP group with nodes of the gcd of its runs, which the evaluator prices and
            # ``export --format hybridep`` writes per rank.  Decided before the solve, on the instance
            # alone, so the solve's work budget is not split.
            consumer_fallback = ("performance.dispatcher hybridep: no layout of the free GPUs gives every EP group "
                                 "equal consecutive slices per NVLink domain, so the layout is free and HybridEP runs "
                                 "unequal groups with smaller nodes")
            consumer = "none"
    _check_arguments(
        solver, time_limit_s, seed, num_workers, consumer, group_preserving, objective, layout, finish_reserve_s,
        apply,
    )
    from solvers.base import resolve_apply

    apply = resolve_apply(instance, apply)
    if group_preserving is False and apply == "checkpoint" and instance.model.group_limited:
        raise InvalidInputError("group_preserving: free maps cannot be applied by a checkpoint permutation under "
                                "group-limited routing (apply checkpoint); use apply runtime (placement.consumers.runtime hooks)")
    from solvers.base import FITS

    if wall_limit_s is not None and (isinstance(wall_limit_s, bool) or not isinstance(wall_limit_s, (int, float))
                                     or not (math.isfinite(wall_limit_s) and wall_limit_s > 0)):
        raise InvalidInputError(f"wall_limit_s: expected a positive, finite number of seconds, found {wall_limit_s!r}")

    if not isinstance(fit, str) or fit not in FITS:
        raise InvalidInputError(f"fit: expected one of {', '.join(FITS)}, found {fit!r}")
    from placement.core.checker import etp_violations

    etp_problems = etp_violations(instance)  # the reader refuses these too; an in-memory instance may not
    if etp_problems:
        raise InvalidInputError(etp_problems[0])
    if redundant_experts or replica_rule != "search":
        from placement.core.replicas import REPLICA_RULES, check_redundant_experts

        if redundant_experts != "auto":
            check_redundant_experts(instance.model.num_experts, instance.parallel.ep, redundant_experts)
        from placement.app.replica_block import check_memory_budget

        check_memory_budget(replica_memory_budget_bytes, instance, redundant_experts)
        if replica_rule not in REPLICA_RULES:
            raise InvalidInputError(f"replica_rule: expected one of {', '.join(REPLICA_RULES)}, found {replica_rule!r}")
    fn = get_solver(solver)
    move_request = None
    if previous is not None or max_moved_bytes is not None or move_cost is not None:
        move_request = _move_request(instance, solver, previous, max_moved_bytes, move_cost, expert_params,
                                     sharded_optimizer, group_preserving, apply)
        layout = "fixed"  # the previous rank layout is kept (solvers/cpsat.py choose_rank2gpu)
    reserve = estimate_finish_s(instance) if finish_reserve_s is None else finish_reserve_s
    options = SolveOptions(
        time_limit_s=time_limit_s,
        work_budget_s=solver_budget_s(instance, time_limit_s),
        seed=seed,
        num_workers=num_workers or default_workers(),
        consumer=consumer,
        group_preserving=group_preserving,
        apply=apply,
        objective=objective,
        layout=layout,
        # May already have passed (loading ate the budget): solvers then return what they have.
        deadline=start + (time_limit_s if wall_limit_s is None else wall_limit_s) - reserve,
        progress=progress,
        on_progress=on_progress,
        stop_event=stop_event,
        moves=move_request,
        fit=fit,
    )
    try:
        result = fn(instance.for_solver(), options)
    except InfeasibleError as exc:
        if consumer_defaulted and consumer != "none":
            # Refused, not laid out freely: see docs/design.md ("The dispatcher's node rule").
            raise InfeasibleError(f"{exc} (consumer {consumer} follows performance.dispatcher; pass consumer "
                                  "none to lay the job out freely: HybridEP then runs unequal EP groups with "
                                  "smaller nodes, priced and exported as such)") from exc
        raise
    except PlacementError:
        raise
    except Exception as exc:  # noqa: BLE001 - a solver bug must still reach the caller as a PlacementError
        raise SolverError(f"solver {solver!r} failed: {type(exc).__name__}: {exc}") from exc
    problems = check(instance, result.placement)
    if problems:
        raise SolverError(f"solver {solver!r} returned an invalid placement: {problems[0]}")
    details = dict(result.details)
    if (pipeline_split and objective == "step_time" and instance.performance is not None and instance.parallel.pp > 1
            and move_request is None):
        from placement.predict.pipeline_split import choose_layout

        choice = choose_layout(instance, result.placement)
        details["pipeline_layout"] = choice.to_dict()
        result = dataclasses.replace(result, placement=dataclasses.replace(result.placement, pipeline_layout=choice.chunks))
    metrics = report(instance, result.placement)
    params = {**result.params, "seed": seed, "time_limit_s": time_limit_s}
    if consumer_fallback is not None:
        params["consumer_fallback"] = consumer_fallback
    if instance.routing.num_windows > 1:  # the fit matters only with several sampled windows
        params["fit"] = fit
    if stop_event is not None and stop_event.is_set():
        details["interrupted"] = True
    if redundant_experts:  # the replica block of the placement file (placement/formats/replicas.py)
        from placement.app.replica_block import replicas_block

        details["replicas"] = replicas_block(instance, result.placement, redundant_experts, replica_rule, seed=seed,
                                             memory_budget_bytes=replica_memory_budget_bytes)
    if move_request is not None:  # what the re-placement moves and gains (placement/predict/moves.py)
        from placement.predict.moves import move_report, replica_state_bytes

        bpr = replica_state_bytes(instance, params=expert_params, sharded_optimizer=sharded_optimizer)
        details["moves"] = {**details.get("moves", {}), **move_report(
            instance, move_request.previous, result.placement, bytes_per_replica=bpr, metrics=metrics)}
        params.update(previous=True, max_moved_bytes=max_moved_bytes, move_cost=move_cost,
                      sharded_optimizer=sharded_optimizer, bytes_per_replica=bpr)
    return dataclasses.replace(
        result, params=params, details=details, metrics=metrics, wall_s=time.monotonic() - start
    )


def _move_request(instance: Instance, solver: str, previous: Placement | None, max_moved_bytes: float | None,
                  move_cost: float | None, expert_params: int | None, sharded_optimizer: bool,
                  group_preserving: bool | None, apply: Apply) -> Any:
    """The checked :class:`placement.predict.moves.MoveRequest` of a re-placement (one-line errors naming the field)."""
    from placement.predict.moves import MoveRequest, check_previous, replica_state_bytes
    from solvers.kernels import keeps_expert_groups

    if previous is None:
        raise InvalidInputError("previous: max_moved_bytes and move_cost need the previous placement")
    if solver != "cpsat":
        raise InvalidInputError(f"solver: only cpsat re-places against a previous placement, found {solver!r}")
    if not isinstance(previous, Placement):
        raise InvalidInputError(f"previous: expected a Placement, found {type(previous).__name__}")
    check_previous(instance, previous, "previous")
    if sharded_optimizer not in (True, False):
        raise InvalidInputError(f"sharded_optimizer: expected True or False, found {sharded_optimizer!r}")
    request = MoveRequest(previous, max_moved_bytes, move_cost, expert_params, bool(sharded_optimizer))
    replica_state_bytes(instance, params=expert_params)  # the expert size must be known
    from solvers.base import group_preserving_default

    gp = group_preserving_default(instance, apply) if group_preserving is None else group_preserving
    if gp and instance.model.num_groups > 1 and not keeps_expert_groups(previous.phy2log,
                                                                       instance.model.experts_per_group):
        raise InvalidInputError("previous: phy2log: the previous expert maps break expert groups and this solve "
                                "is group-preserving (apply checkpoint); re-place with apply runtime")
    return request


def verify_placement(instance_path: str | os.PathLike[str], placement_path: str | os.PathLike[str]) -> VerifyReport:
    """Verify a placement file against its instance, independently of the solvers.

    Returns a :class:`placement.app.verify.VerifyReport`: ``violations`` (empty when valid), the
    ``checks`` run and ``notes``; see :mod:`placement.app.verify` for the checks.

    Raises
    ------
    InvalidInputError
        A file cannot be read or parsed.
    """
    from placement.app.verify import verify_files

    return verify_files(instance_path, placement_path)


def export_placement(
    fmt: str,
    placement_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    instance_path: str | os.PathLike[str] | None = None,
    *,
    keep_router: bool = False,
    apply: Apply | None = None,
) -> dict[Path, str]:
    """Check a placement file and write it, atomically, in a format a stack reads.

    ``apply`` (megatron, torchtitan): ``runtime`` writes the keep-router permutation that is also the
    map of :mod:`placement.consumers.runtime` (any map), ``checkpoint`` the permutation of router and experts;
    default: the placement's ``apply`` (what it was solved for), else the instance's (``runtime``).
    ``keep_router`` is the older spelling of ``apply="runtime"``.

    ``fmt``: one of :data:`placement.consumers.export.FORMATS` (sglang, vllm, vllm-ascend, megatron,
    torchtitan, slurm, hybridep, maxtext); every format but vllm needs the instance.  Returns
    ``{path: text}`` of the files written (``slurm`` writes a per-host GPU file and a launcher
    script beside the host file, and warns with ``LaunchWarning`` when torchrun cannot launch it).

    Raises
    ------
    InvalidInputError
        Unreadable files, a placement made for another instance, or one the checker rejects.
    InfeasibleError
        The stack cannot take this placement.
    """
    from placement.consumers.export import export_file

    return export_file(fmt, placement_path, output_path, instance_path, keep_router=keep_router, apply=apply)


class Interrupted(KeyboardInterrupt):
    """A signal arrived when there was nothing worth saving (or a second one arrived).

    ``signum`` is the signal; ``exit_code`` the shell convention ``128 + signum`` (130 for
    SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class SignalStop:
    """While active, SIGINT and SIGTERM ask a solve to stop instead of killing the process.

    A context manager for the main thread of a program that embeds :func:`solve` (the CLI uses
    it).  Pass :attr:`event` as ``solve(stop_event=...)`` and set :attr:`armed` just before
    solving.  Then:

    - a signal before the solve (``armed`` False) raises :class:`Interrupted` at once: nothing has
      been found that is worth saving;
    - the first signal once armed only sets :attr:`event`: the solver returns the best complete
      placement found so far and the caller checks, scores and writes it;
    - a second signal raises :class:`Interrupted` wherever the main thread is (an atomic write in
      progress removes its temporary file, so no partial file appears).

    Python runs signal handlers only between bytecodes of the main thread, which may sit in C
    code for a long time (CP-SAT's ``solve``).  So a helper thread also reads the signal numbers
    from :func:`signal.set_wakeup_fd` and sets :attr:`event` at once; solvers relay it to C code
    with :func:`solvers.base.call_on_stop`.  Outside the main thread the handlers cannot be
    installed and only :attr:`event` is provided.  Previous handlers are restored on exit.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.event = threading.Event()
        self.armed = False
        self.signum: int | None = None  # the first signal received
        self._count = 0
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd = -1
        self._socks: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.signals:
            self._old_handlers[s] = signal.signal(s, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._socks = (reader, writer)
        self._old_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="placement-signal-watch", daemon=True)
        self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._socks is None:
            return
        signal.set_wakeup_fd(self._old_wakeup_fd)
        for s, old in self._old_handlers.items():
            signal.signal(s, old)
        reader, writer = self._socks
        try:
            writer.send(b"\0")  # wakes the watcher: no signal has number 0
        except OSError:
            pass
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        reader.close()
        writer.close()
        self._socks = None

    @property
    def exit_code(self) -> int:
        """``128 + signum`` of the first signal (0 if none arrived)."""
        return 0 if self.signum is None else 128 + self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._count += 1
        if self.signum is None:
            self.signum = signum
        self.event.set()
        if not self.armed or self._count > 1:
            raise Interrupted(self.signum)

    def _watch(self) -> None:
        assert self._socks is not None
        reader = self._socks[0]
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for byte in data:
                if byte == 0:
                    return
                if byte in self.signals and self.armed:
                    self.event.set()


def result_document(instance: Instance, result: SolveResult) -> dict[str, Any]:
    """The placement-file document of a solve result (deterministic: no wall-clock values)."""
    solve_info = {
        "status": result.status,
        "objective_bytes": float(result.objective_bytes),
        "bound_bytes": None if result.bound_bytes is None else float(result.bound_bytes),
        "gap": result.gap,
        "details": {k: v for k, v in result.details.items() if k != "replicas"},
    }
    return placement_document(
        instance,
        result.placement,
        solver=result.solver,
        params=result.params,
        seed=int(result.params.get("seed", 0)),
        consumer=result.consumer,
        group_preserving=result.group_preserving,
        apply=result.params.get("apply"),
        metrics=result.metrics,
        solve=solve_info,
        replicas=result.details.get("replicas"),
        pipeline_layout=result_pipeline_layout(instance, result),
    )


def result_pipeline_layout(instance: Instance, result: SolveResult) -> tuple[str, ...]:
    """The chunk list a solve result was scored with: its placement's, else the instance's layout."""
    return result.placement.pipeline_layout or instance.parallel.pipeline_layout


def save_result(instance: Instance, result: SolveResult, path: str | os.PathLike[str]) -> None:
    """Write the placement file of ``result`` atomically (a reader never sees a partial file)."""
    write_placement(path, result_document(instance, result))


# ---------------------------------------------------------------------------------------------
# Recorded routing statistics (placement import / placement stats)
# ---------------------------------------------------------------------------------------------
def import_routing(
    source: str,
    traces: Sequence[str | os.PathLike[str]],
    *,
    base: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    parallel: str | os.PathLike[str] | None = None,
    cluster: str | os.PathLike[str] | None = None,
    name: str | None = None,
    cost_mode: str | None = None,
    heldout_steps: int | None = None,
    max_tokens_per_source: int | None = None,
    windows: int = 1,
    on_progress: Callable[[int, int], None] | None = None,
) -> Instance:
    """An instance whose routing windows come from a stack's recorded traces.

    Parameters
    ----------
    source : ``megatron``, ``torchtitan``, ``sglang`` or ``vllm`` (README: "Bring your own
        routing statistics").
    traces : every rank's trace files, in any order.
    base : an instance JSON whose ``model``, ``parallel`` and ``cluster`` sections are used (its
        routing file is not read); ``model``, ``parallel``, ``cluster`` override one section each
        (a JSON of that section, or an instance file).
    name, cost_mode : default: the base's, else ``imported`` and ``per_domain``.
    heldout_steps : the last steps (forward passes, requests) that form the held-out window;
        default a quarter of them, at least one.
    max_tokens_per_source : cap on the tokens kept per source and window
        (default :data:`placement.sources.importers.DEFAULT_MAX_TOKENS_PER_SOURCE`).
    windows : cut the fit steps into this many time-ordered sampled windows
        (``routing.window_tokens``, what ``solve(fit=...)`` weighs); 1 = one sampled window.
    on_progress : called with ``(bytes of trace files read, bytes of all trace files)`` as they are
        scanned (a :data:`placement.core.progress.ProgressCallback`); it only observes.

    Returns
    -------
    Instance, ready for :func:`solve` and :func:`save_instance`.

    Raises
    ------
    InvalidInputError
        One line naming the file and record or field at fault (malformed or truncated traces, ids
        outside the experts, ranks outside the layout, steps with different layer sets, counts-only
        inputs).
    """
    from placement.sources.importers import DEFAULT_MAX_TOKENS_PER_SOURCE, import_instance

    return import_instance(
        source,
        traces,
        base=base,
        model=model,
        parallel=parallel,
        cluster=cluster,
        name=name,
        cost_mode=cost_mode,
        heldout_steps=heldout_steps,
        max_tokens_per_source=DEFAULT_MAX_TOKENS_PER_SOURCE if max_tokens_per_source is None else max_tokens_per_source,
        windows=windows,
        on_progress=on_progress,
    )


def save_instance(instance: Instance, path: str | os.PathLike[str]) -> None:
    """Write an instance as ``path`` (JSON) and ``path`` with suffix ``.npz``, each atomically."""
    from placement.formats import write_instance

    write_instance(instance, path)


def routing_stats(instance: Instance, *, distance: int = 1) -> dict[str, Any]:
    """The routing statistics ``placement stats`` prints (see :func:`placement.core.stats.routing_stats`)."""
    from placement.core.stats import routing_stats as _stats

    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 1:
        raise InvalidInputError(f"distance: expected a positive integer, found {distance!r}")
    return _stats(instance, distance=distance)


def allocation_hosts(allocation: str | Sequence[str]) -> list[str]:
    """The host names of an allocation: a Slurm host list (``gb[001-018,025]``, as in
    ``SLURM_JOB_NODELIST``) or a sequence of names."""
    from placement.sources.discovery import expand_hostlist

    if isinstance(allocation, str):
        hosts = expand_hostlist(allocation)
    else:
        hosts = [str(h) for h in allocation]
    if not hosts:
        raise InvalidInputError("--allocation: empty host list")
    return hosts


def allocate(instance: Instance, allocation: str | Sequence[str]) -> Instance:
    """``instance`` restricted to the hosts of ``allocation``: every other host's GPUs unavailable.

    The instance keeps its ``sha256``: a placement solved for the allocation is a valid placement
    of the instance file (it uses a subset of its available GPUs), so ``placement export`` and
    ``placement verify`` take the instance file as it is.  Hosts of the allocation that the
    instance marks unavailable stay unavailable.

    Raises
    ------
    InvalidInputError
        A host the cluster does not have (named), or an empty allocation.
    """
    return dataclasses.replace(instance, cluster=allocate_cluster(instance.cluster, allocation))


def allocate_cluster(cluster: Cluster, allocation: str | Sequence[str]) -> Cluster:
    """``cluster`` with only the hosts of ``allocation`` available (see :func:`allocate`)."""
    hosts = allocation_hosts(allocation)
    index = cluster.host_index
    unknown = [h for h in hosts if h not in index]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise InvalidInputError(f"--allocation: host {unknown[0]!r} is not in the cluster{more}")
    keep = np.zeros(cluster.num_domains * cluster.trays_per_domain, dtype=bool)
    keep[[index[h] for h in hosts]] = True
    available = np.asarray(cluster.available) & np.repeat(keep, cluster.gpus_per_tray)
    return dataclasses.replace(cluster, available=available)
