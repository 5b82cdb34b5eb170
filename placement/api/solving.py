"""``solve`` as named steps over one :class:`~placement.api.request.SolveRequest`.

The flow, in the order :func:`solve` runs it::

    request -> choose_consumer -> check_request -> move_request -> solver_options   (the plan)
            -> run_solver                                                          (the search)
            -> check_answer -> choose_pipeline_split -> score -> record_params
            -> mark_interrupted -> add_replicas -> add_moves                       (ANSWER_STEPS)

Each step takes typed values and returns one; the answer steps share one signature
``step(instance, plan, result) -> result`` and are listed once, in :data:`ANSWER_STEPS`.  Nothing
here prints; every error is a :class:`~placement.core.model.PlacementError`.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from placement.api.budget import estimate_finish_s, solver_budget_s
from placement.api.request import SolveRequest, check_request, move_request, solve_request
from placement.core.checker import check
from placement.core.model import Apply, InfeasibleError, Instance, PlacementError, SolverError
from placement.predict.report import report

if TYPE_CHECKING:  # solvers imports placement: import it lazily at run time
    from placement.predict.moves import MoveRequest
    from solvers.base import Consumer, SolveOptions, SolveResult

__all__ = [
    "ConsumerChoice",
    "SolvePlan",
    "ANSWER_STEPS",
    "solve",
    "choose_consumer",
    "solver_options",
    "run_solver",
    "check_answer",
    "choose_pipeline_split",
    "score",
    "record_params",
    "mark_interrupted",
    "add_replicas",
    "add_moves",
]


@dataclass(frozen=True)
class ConsumerChoice:
    """The rank-layout rule of the dispatcher a solve uses.

    consumer : ``none``, ``deepep`` or ``hybridep``.
    defaulted : True when it follows the instance's ``performance.dispatcher`` (no ``consumer`` asked).
    fallback : why HybridEP's equal-slice rule was dropped for ``none`` (recorded in the result's
        ``params["consumer_fallback"]``), else None.
    """

    consumer: Consumer
    defaulted: bool
    fallback: str | None = None


@dataclass(frozen=True)
class SolvePlan:
    """A request resolved against its instance: what the solver is handed, and what the answer steps read.

    request : the options as asked.
    started_at : the ``time.monotonic()`` instant the budget counts from.
    consumer : the rank-layout rule (:func:`choose_consumer`).
    apply : how the expert maps reach the job, resolved (``runtime`` or ``checkpoint``).
    moves : the checked re-placement, or None.
    options : the solver's :class:`solvers.base.SolveOptions` (work budget, deadline, ...).
    """

    request: SolveRequest
    started_at: float
    consumer: ConsumerChoice
    apply: Apply
    moves: MoveRequest | None
    options: SolveOptions


def solve(instance: Instance, options: SolveRequest | None = None, **kwargs: Any) -> SolveResult:
    """Solve ``instance`` with a registered solver, check the answer and score it.

    Parameters
    ----------
    instance : the problem; the solver sees :meth:`~placement.core.model.Instance.for_solver` (no
        held-out window), the evaluator scores both windows.
    options : a :class:`~placement.api.request.SolveRequest` (default: every option at its default).
    **kwargs : any field of :class:`~placement.api.request.SolveRequest` (``solver``,
        ``time_limit_s``, ``seed``, ``objective``, ...; see its docstring for each), replacing the
        field of ``options``.

    Returns
    -------
    solvers.SolveResult with ``metrics`` (the evaluator's report, sampled and ``heldout_`` keys)
    and ``wall_s`` (seconds since ``started_at``) filled in.

    Raises
    ------
    TypeError
        A keyword that is not an option.
    InvalidInputError
        A bad argument (the message names it).
    InfeasibleError
        The request cannot be met (too few GPUs, a consumer rule that cannot hold).
    SolverError
        The solver failed or returned an invalid placement.
    """
    request = solve_request(options, kwargs)
    started_at = time.monotonic() if request.started_at is None else request.started_at
    # Step 1: the request, checked and resolved against the instance.
    consumer = choose_consumer(instance, request)
    apply = check_request(instance, request, consumer.consumer)
    moves = move_request(instance, request, apply)
    plan = SolvePlan(request, started_at, consumer, apply, moves,
                     solver_options(instance, request, consumer, apply, moves, started_at))
    # Step 2: the search.
    result = run_solver(instance, plan)
    # Step 3: the answer, checked, completed and scored.
    for step in ANSWER_STEPS:
        result = step(instance, plan, result)
    return dataclasses.replace(result, wall_s=time.monotonic() - started_at)


def _signature() -> inspect.Signature:
    """``solve``'s signature with every option as a keyword (what ``help`` and ``inspect`` show)."""
    own = inspect.signature(solve)
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in dataclasses.fields(SolveRequest)]
    return own.replace(parameters=[own.parameters["instance"], own.parameters["options"], *keywords])


setattr(solve, "__signature__", _signature())  # setattr: mypy knows no __signature__ on a function


def choose_consumer(instance: Instance, request: SolveRequest) -> ConsumerChoice:
    """The dispatcher's rank-layout rule: ``request.consumer``, else the instance's dispatcher.

    HybridEP's equal-slice rule is dropped for ``none`` when it was not asked for and either the
    rank layout is kept (``layout fixed`` or a re-placement) or no layout of the free GPUs can
    hold it (decided on the instance alone, so that the solve's work budget is not split).
    """
    from solvers.base import default_consumer

    if request.consumer is not None:
        return ConsumerChoice(request.consumer, defaulted=False)
    consumer = default_consumer(instance)
    if consumer == "hybridep":
        from solvers.layout.rules import equal_slices_possible

        if request.layout == "fixed" or request.previous is not None:
            return ConsumerChoice("none", True, "performance.dispatcher hybridep: the rank layout is kept, so HybridEP "
                                                "runs each EP group with the nodes it forms")
        if not equal_slices_possible(instance):
            # Laid out freely instead of refused (docs/design.md, "The dispatcher's node rule"): HybridEP
            # runs an unequal EP group with nodes of the gcd of its runs, which the evaluator prices and
            # ``export --format hybridep`` writes per rank.
            return ConsumerChoice("none", True, "performance.dispatcher hybridep: no layout of the free GPUs gives "
                                                "every EP group equal consecutive slices per NVLink domain, so the "
                                                "layout is free and HybridEP runs unequal groups with smaller nodes")
    return ConsumerChoice(consumer, defaulted=True)


def solver_options(instance: Instance, request: SolveRequest, consumer: ConsumerChoice, apply: Apply,
                   moves: MoveRequest | None, started_at: float) -> SolveOptions:
    """The solver's options: the work budget (:func:`~placement.api.budget.solver_budget_s`, from the
    limit and the instance's size alone) and the wall deadline (the limit, or ``wall_limit_s``, less the
    finishing reserve).  A re-placement keeps the previous rank layout (``layout`` fixed)."""
    from solvers import SolveOptions
    from solvers.base import default_workers

    r = request
    reserve = estimate_finish_s(instance) if r.finish_reserve_s is None else r.finish_reserve_s
    return SolveOptions(
        time_limit_s=r.time_limit_s,
        work_budget_s=solver_budget_s(instance, r.time_limit_s),
        seed=r.seed,
        num_workers=r.num_workers or default_workers(),
        consumer=consumer.consumer,
        group_preserving=r.group_preserving,
        apply=apply,
        objective=r.objective,
        layout="fixed" if moves is not None else r.layout,  # solvers/cpsat.py choose_rank2gpu keeps previous's
        # May already have passed (loading ate the budget): solvers then return what they have.
        deadline=started_at + (r.time_limit_s if r.wall_limit_s is None else r.wall_limit_s) - reserve,
        progress=r.progress,
        on_progress=r.on_progress,
        stop_event=r.stop_event,
        moves=moves,
        fit=r.fit,
    )


def run_solver(instance: Instance, plan: SolvePlan) -> SolveResult:
    """Run the registered solver on the solver's view of ``instance`` (no held-out window).

    Raises
    ------
    InfeasibleError
        As the solver raised it; when the consumer rule came from the instance's dispatcher, the
        message says how to lay the job out freely.
    SolverError
        Any other exception of the solver (a bug still reaches the caller as a PlacementError).
    """
    from solvers import get_solver

    solver = plan.request.solver
    consumer = plan.consumer
    try:
        return get_solver(solver)(instance.for_solver(), plan.options)
    except InfeasibleError as exc:
        if consumer.defaulted and consumer.consumer != "none":
            # Refused, not laid out freely: see docs/design.md ("The dispatcher's node rule").
            raise InfeasibleError(f"{exc} (consumer {consumer.consumer} follows performance.dispatcher; pass "
                                  "consumer none to lay the job out freely: HybridEP then runs unequal EP groups "
                                  "with smaller nodes, priced and exported as such)") from exc
        raise
    except PlacementError:
        raise
    except Exception as exc:  # noqa: BLE001 - a solver bug must still reach the caller as a PlacementError
        raise SolverError(f"solver {solver!r} failed: {type(exc).__name__}: {exc}") from exc


def check_answer(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """The independent checker (:func:`placement.core.checker.check`) on the solver's placement.

    Raises
    ------
    SolverError
        The placement violates the instance (the first violation is named).
    """
    problems = check(instance, result.placement)
    if problems:
        raise SolverError(f"solver {plan.request.solver!r} returned an invalid placement: {problems[0]}")
    return result


def choose_pipeline_split(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """The pipeline layer split for the answer (:func:`placement.predict.pipeline_split.choose_layout`).

    Only with the ``step_time`` objective, a performance block, ``pp > 1``, no re-placement and
    ``pipeline_split`` asked; ``details["pipeline_layout"]`` reports the candidates.
    """
    r = plan.request
    if not (r.pipeline_split and r.objective == "step_time" and instance.performance is not None
            and instance.parallel.pp > 1 and plan.moves is None):
        return result
    from placement.predict.pipeline_split import choose_layout

    choice = choose_layout(instance, result.placement)
    return dataclasses.replace(result, details={**result.details, "pipeline_layout": choice.to_dict()},
                               placement=dataclasses.replace(result.placement, pipeline_layout=choice.chunks))


def score(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """The evaluator's report of the answer, both windows (:func:`placement.predict.report.report`)."""
    return dataclasses.replace(result, metrics=report(instance, result.placement))


def record_params(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """The parameters that, with the solver's own, reproduce the placement: seed, limit, the
    consumer fallback and (with several sampled windows) the fit."""
    r = plan.request
    params = {**result.params, "seed": r.seed, "time_limit_s": r.time_limit_s}
    if plan.consumer.fallback is not None:
        params["consumer_fallback"] = plan.consumer.fallback
    if instance.routing.num_windows > 1:  # the fit matters only with several sampled windows
        params["fit"] = r.fit
    return dataclasses.replace(result, params=params)


def mark_interrupted(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """``details["interrupted"] = True`` when the stop event was set: the best placement so far."""
    stop_event = plan.request.stop_event
    if stop_event is None or not stop_event.is_set():
        return result
    return dataclasses.replace(result, details={**result.details, "interrupted": True})


def add_replicas(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """With ``redundant_experts``, the replica block of the placement file
    (placement/formats/replicas.py) in ``details["replicas"]``, priced with the replicas."""
    r = plan.request
    if not r.redundant_experts:
        return result
    from placement.app.replica_block import replicas_block

    block = replicas_block(instance, result.placement, r.redundant_experts, r.replica_rule, seed=r.seed,
                           memory_budget_bytes=r.replica_memory_budget_bytes)
    return dataclasses.replace(result, details={**result.details, "replicas": block})


def add_moves(instance: Instance, plan: SolvePlan, result: SolveResult) -> SolveResult:
    """With a re-placement, what it moves and gains (placement/predict/moves.py) in
    ``details["moves"]``, and the move's options in ``params``."""
    moves = plan.moves
    if moves is None:
        return result
    from placement.predict.moves import move_report, replica_state_bytes

    r = plan.request
    bpr = replica_state_bytes(instance, params=r.expert_params, sharded_optimizer=r.sharded_optimizer)
    details = {**result.details, "moves": {**result.details.get("moves", {}), **move_report(
        instance, moves.previous, result.placement, bytes_per_replica=bpr, metrics=result.metrics)}}
    params = {**result.params, "previous": True, "max_moved_bytes": r.max_moved_bytes, "move_cost": r.move_cost,
              "sharded_optimizer": r.sharded_optimizer, "bytes_per_replica": bpr}
    return dataclasses.replace(result, details=details, params=params)


#: The steps every answer passes through, in order: ``step(instance, plan, result) -> result``.
ANSWER_STEPS: tuple[Callable[[Instance, SolvePlan, SolveResult], SolveResult], ...] = (
    check_answer,
    choose_pipeline_split,
    score,
    record_params,
    mark_interrupted,
    add_replicas,
    add_moves,
)
