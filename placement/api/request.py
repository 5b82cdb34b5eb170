"""What a solve is asked: one typed, frozen options object, and its checks.

:class:`SolveRequest` holds every option of :func:`placement.api.solve` with its default;
``solve(instance, request)`` and ``solve(instance, **options)`` are the same call
(:func:`solve_request` builds the object from keywords).  The checks here name the bad field in
one line (:class:`~placement.core.model.InvalidInputError`); those that need the instance run in
:func:`check_request`, in the order ``solve`` always ran them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, TYPE_CHECKING

from placement.api.budget import DEFAULT_SOLVER, MAX_SEED, MAX_WORKERS
from placement.core.model import Apply, Instance, InvalidInputError, Placement

if TYPE_CHECKING:  # solvers imports placement: import it lazily at run time
    from placement.predict.moves import MoveRequest
    from solvers.base import Consumer, Fit, LayoutMode, Objective

__all__ = ["SolveRequest", "solve_request", "check_request", "move_request"]


@dataclass(frozen=True)
class SolveRequest:
    """Every option of :func:`placement.api.solve`, typed, with its default.

    Attributes
    ----------
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
    replica_rule : how the ``redundant_experts`` replicas are chosen: ``search`` (default),
        ``hottest`` or ``eplb`` (DeepSeek EPLB's ``replicate_experts``).
    replica_memory_budget_bytes : the bytes per GPU the redundant slots may take (the instance
        carries no HBM size): ``auto`` skips the counts over it, a fixed count over it is refused;
        None: no budget.
    pipeline_split : with the ``step_time`` objective, a performance block, ``pp > 1`` and no
        ``previous``, choose the pipeline layer split for the answer's placement
        (:func:`placement.predict.pipeline_split.choose_layout`; never slower than the instance's split on
        the sampled window); ``details["pipeline_layout"]`` reports the candidates and the metrics
        are those of the chosen layout.  False keeps the instance's split.
    """

    solver: str = DEFAULT_SOLVER
    time_limit_s: float = 60.0
    wall_limit_s: float | None = None
    seed: int = 0
    num_workers: int | None = None
    consumer: Consumer | None = None
    group_preserving: bool | None = None
    apply: Apply | None = None
    objective: Objective = "step_time"
    layout: LayoutMode = "optimize"
    progress: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    started_at: float | None = None
    stop_event: threading.Event | None = None
    finish_reserve_s: float | None = None
    previous: Placement | None = None
    max_moved_bytes: float | None = None
    move_cost: float | None = None
    expert_params: int | None = None
    sharded_optimizer: bool = True
    fit: Fit = "robust"
    redundant_experts: int | Literal["auto"] = 0
    replica_rule: str = "search"
    replica_memory_budget_bytes: float | None = None
    pipeline_split: bool = True


#: The option names, in declaration order (what ``solve`` accepts as keywords).
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SolveRequest))


def solve_request(options: SolveRequest | None, keywords: Mapping[str, Any]) -> SolveRequest:
    """``options`` (default: :class:`SolveRequest` ``()``) with ``keywords`` replacing its fields.

    Raises
    ------
    TypeError
        A keyword that is no option (as Python raises for an unknown keyword argument), or
        ``options`` that is not a :class:`SolveRequest`.
    """
    unknown = [k for k in keywords if k not in OPTION_NAMES]
    if unknown:
        raise TypeError(f"solve() got an unexpected keyword argument {unknown[0]!r}")
    if options is None:
        return SolveRequest(**keywords)
    if not isinstance(options, SolveRequest):
        raise TypeError(f"solve() options: expected a SolveRequest, found {type(options).__name__}")
    return dataclasses.replace(options, **keywords) if keywords else options


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


def check_request(instance: Instance, request: SolveRequest, consumer: str) -> Apply:
    """Check every option of ``request`` against ``instance``; return the ``apply`` mode it resolves to.

    ``consumer`` is the rank-layout rule already resolved (:func:`placement.api.solving.choose_consumer`).

    Raises
    ------
    InvalidInputError
        The first bad option, named (one line).
    """
    r = request
    _check_arguments(r.solver, r.time_limit_s, r.seed, r.num_workers, consumer, r.group_preserving, r.objective,
                     r.layout, r.finish_reserve_s, r.apply)
    from solvers.base import FITS, resolve_apply

    apply = resolve_apply(instance, r.apply)
    if r.group_preserving is False and apply == "checkpoint" and instance.model.group_limited:
        raise InvalidInputError("group_preserving: free maps cannot be applied by a checkpoint permutation under "
                                "group-limited routing (apply checkpoint); use apply runtime (placement.consumers.runtime hooks)")
    wall_limit_s = r.wall_limit_s
    if wall_limit_s is not None and (isinstance(wall_limit_s, bool) or not isinstance(wall_limit_s, (int, float))
                                     or not (math.isfinite(wall_limit_s) and wall_limit_s > 0)):
        raise InvalidInputError(f"wall_limit_s: expected a positive, finite number of seconds, found {wall_limit_s!r}")
    if not isinstance(r.fit, str) or r.fit not in FITS:
        raise InvalidInputError(f"fit: expected one of {', '.join(FITS)}, found {r.fit!r}")
    from placement.core.checker import etp_violations

    etp_problems = etp_violations(instance)  # the reader refuses these too; an in-memory instance may not
    if etp_problems:
        raise InvalidInputError(etp_problems[0])
    if r.redundant_experts or r.replica_rule != "search":
        from placement.core.replicas import REPLICA_RULES, check_redundant_experts

        if r.redundant_experts != "auto":
            check_redundant_experts(instance.model.num_experts, instance.parallel.ep, r.redundant_experts)
        from placement.app.replica_block import check_memory_budget

        check_memory_budget(r.replica_memory_budget_bytes, instance, r.redundant_experts)
        if r.replica_rule not in REPLICA_RULES:
            raise InvalidInputError(f"replica_rule: expected one of {', '.join(REPLICA_RULES)}, found {r.replica_rule!r}")
    return apply


def move_request(instance: Instance, request: SolveRequest, apply: Apply) -> MoveRequest | None:
    """The checked re-placement of ``request`` (``previous`` and its budget or price), or None.

    Raises
    ------
    InvalidInputError
        ``max_moved_bytes`` or ``move_cost`` without ``previous``, another solver than ``cpsat``,
        a previous placement of another shape, or one that breaks expert groups when the solve is
        group-preserving.
    """
    r = request
    if r.previous is None and r.max_moved_bytes is None and r.move_cost is None:
        return None
    return _move_request(instance, r.solver, r.previous, r.max_moved_bytes, r.move_cost, r.expert_params,
                         r.sharded_optimizer, r.group_preserving, apply)


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
