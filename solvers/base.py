"""The one interface every placement algorithm implements, and its result type.

A solver is a callable ``solve(instance, options) -> SolveResult``.  It receives the instance's
solver view (:meth:`placement.core.model.Instance.for_solver`: no held-out window), must honour
``options.deadline`` (a ``time.monotonic()`` instant) and return the best placement it has by then.
It never prints: progress goes to ``options.progress`` when given, logs to the ``logging`` module.

Stopping early: a solver polls ``options.should_stop()`` (true once the deadline has passed or the
caller has set ``options.stop_event``, e.g. on SIGINT/SIGTERM) between units of work and then
returns the best complete placement it has.  Code that blocks in C (CP-SAT's ``solve``) wraps the
call in ``with call_on_stop(options, solver.stop_search):`` so that a stop request interrupts it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Protocol

from placement.core.executor import default_workers  # noqa: F401  (re-exported)
from placement.core.model import Apply, Instance, MoveRequest, Placement

__all__ = [
    "Consumer",
    "CONSUMERS",
    "Objective",
    "OBJECTIVES",
    "LayoutMode",
    "LAYOUT_MODES",
    "Fit",
    "FITS",
    "SolveOptions",
    "SolveResult",
    "Solver",
    "default_workers",
    "group_preserving_default",
    "resolve_apply",
    "default_consumer",
    "call_on_stop",
    "heuristic_result",
]

Consumer = Literal["none", "deepep", "hybridep"]
CONSUMERS: tuple[Consumer, ...] = ("none", "deepep", "hybridep")
Objective = Literal["step_time", "total", "bottleneck"]
OBJECTIVES: tuple[Objective, ...] = ("step_time", "total", "bottleneck")
LayoutMode = Literal["optimize", "fixed"]
LAYOUT_MODES: tuple[LayoutMode, ...] = ("optimize", "fixed")
Fit = Literal["robust", "mean", "latest"]
FITS: tuple[Fit, ...] = ("robust", "mean", "latest")


@dataclass(frozen=True)
class SolveOptions:
    """What every solver accepts.

    time_limit_s : wall-clock budget of the call, counted from its start (``deadline``, when not
        given, is the start plus this).
    work_budget_s : the deterministic work budget, in seconds of planned work: solvers with
        deterministic budgets size their work by it, never by the clock, so the same budget gives
        the same placement on a busy or an idle machine (``None``: ``time_limit_s``; see
        :meth:`resolved_work_budget_s`).
    seed : random seed; the same instance, seed and options give the same placement.
    num_workers : CP-SAT workers / processes; defaults to the cores available.
    consumer : layout rule the rank placement must obey (``deepep``/``hybridep``: equal
        consecutive slices of each EP group per NVLink domain).
    apply : how the expert maps reach the job, ``runtime`` (dispatch-time map: any map) or
        ``checkpoint`` (offline renumbering of router and experts); ``None``: the instance's ``apply``
        field, else ``runtime`` (:func:`resolve_apply`).
    group_preserving : only group-preserving expert permutations (required for checkpoint
        permutations under group-limited routing); ``None``: :func:`group_preserving_default`
        (group-limited routing and ``apply`` ``checkpoint``).
    objective : ``step_time`` (the default): the predicted step time of
        :class:`placement.predict.performance.StepTimeModel` on the evaluator's metrics, bytes as the
        tie-break (the rank layout ranks the candidates of both byte objectives by it; an instance
        without a ``performance`` block falls back to ``total``, and the details say so);
        ``total`` cross-domain bytes, subject (in the rank layout) to no pipeline stage's
        all-to-all time exceeding the default layout's slowest stage; or the ``bottleneck``
        (slowest stage / busiest NIC), total bytes as a tie-breaker.
    layout : ``optimize`` the rank -> GPU map, or keep it ``fixed`` at the default layout (when the
        launcher decides where ranks run, as for SGLang or vLLM serving).
    deadline : ``time.monotonic()`` instant by which the solver returns; derived if not given.
    progress : called with one-line progress messages (the CLI prints them on a terminal).
    on_progress : called in the calling process with ``(MoE layers whose expert map is finished,
        MoE layers to place)`` each time a layer finishes (from the pool's answers as they arrive);
        it only observes: the placement does not depend on it (the CLI draws it as a bar).
    stop_event : set by the caller to ask for the best placement found so far now (the CLI sets
        it on SIGINT/SIGTERM); solvers poll :meth:`should_stop`, which also covers the deadline.
    moves : a move-aware re-placement (:class:`placement.core.model.MoveRequest`: the previous placement,
        a moved-bytes budget or a move cost); only ``cpsat`` reads it.
    fit : how the expert maps weigh several time-ordered sampled windows (``routing.window_tokens``):
        ``robust`` the worst window, ``mean`` their sum, ``latest`` the latest only; the guard
        against the default judges on the latest window (:mod:`solvers.experts.windows`).  With one
        sampled window every value gives the same placement.
    """

    time_limit_s: float = 60.0
    work_budget_s: float | None = None
    seed: int = 0
    num_workers: int = field(default_factory=default_workers)
    consumer: Consumer = "none"
    group_preserving: bool | None = None
    apply: Apply | None = None
    objective: Objective = "step_time"
    layout: LayoutMode = "optimize"
    deadline: float | None = None
    progress: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = field(default=None, compare=False)
    stop_event: threading.Event | None = field(default=None, compare=False)
    moves: MoveRequest | None = field(default=None, compare=False)
    fit: Fit = "robust"

    def resolved_deadline(self) -> float:
        return self.deadline if self.deadline is not None else time.monotonic() + self.time_limit_s

    def resolved_work_budget_s(self) -> float:
        """The deterministic work budget: :attr:`work_budget_s`, or :attr:`time_limit_s` when unset."""
        return self.time_limit_s if self.work_budget_s is None else self.work_budget_s

    def stop_requested(self) -> bool:
        """True once the caller has set :attr:`stop_event` (a signal, a scheduler's cancel)."""
        return self.stop_event is not None and self.stop_event.is_set()

    def should_stop(self) -> bool:
        """True when the solver must return its best placement now: deadline passed or stop asked."""
        return self.stop_requested() or (self.deadline is not None and time.monotonic() >= self.deadline)

    def time_left_s(self) -> float:
        """Seconds until the deadline (0 once a stop was requested), never negative."""
        if self.stop_requested():
            return 0.0
        return max(0.0, self.resolved_deadline() - time.monotonic())

    def group_preserving_for(self, instance: Instance) -> bool:
        """Whether this solve keeps expert groups whole: :attr:`group_preserving` when given, else
        :func:`group_preserving_default` of :attr:`apply`."""
        if self.group_preserving is None:
            return group_preserving_default(instance, self.apply)
        return self.group_preserving

    def fit_groups_whole(self, instance: Instance) -> bool:
        """Whether the expert search fits group-preserving maps: always where they are required
        (:meth:`group_preserving_for`), and by default under group-limited routing even where any map
        is valid (``apply`` ``runtime``); an explicit ``group_preserving=False`` fits free maps.

        Under group-limited routing the expert groups are the co-activation structure the router
        keeps in every window; which experts of a group run hot and which fire together drifts
        with training.  Free maps fitted to one window's co-activation lose on a later window what
        they gained when the routing drifts far (docs/experts.md, "Which maps the search fits").
        With one sampled window the drift cannot be measured and groups are fitted whole; with
        several, free maps are fitted when the windows' own drift keeps at least
        :data:`solvers.experts.windows.FREE_FIT_MIN_GAIN_KEPT` of a fitted gain
        (:func:`solvers.experts.windows.gain_kept`).  The step-time check still weighs free
        candidates (balanced packings, the solved map rebalanced inside each domain) where any
        map is valid.
        """
        if self.group_preserving is not None:
            return bool(self.group_preserving)
        if group_preserving_default(instance, self.apply):
            return True
        if not instance.model.group_limited:
            return False
        # Several sampled windows measure the drift: free fits where their gain holds.
        from solvers.kernels.drift import FREE_FIT_MIN_GAIN_KEPT, gain_kept

        bounds = instance.routing.window_bounds()
        if len(bounds) < 2:
            return True
        return gain_kept(instance.routing.topk, bounds, instance.model.num_experts) < FREE_FIT_MIN_GAIN_KEPT

    def apply_for(self, instance: Instance) -> Apply:
        """How this solve's maps are applied: :attr:`apply`, else the instance's, else ``runtime``."""
        return resolve_apply(instance, self.apply)

    def report(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)


def default_consumer(instance: Instance) -> Consumer:
    """The consumer rule a solve follows unless the caller names one: the instance's
    ``performance.dispatcher`` when it is ``hybridep`` or ``deepep`` (their equal-slice rule), else
    ``none`` (``alltoall``, or no performance block)."""
    dispatcher = getattr(instance.performance, "dispatcher", None) if instance.performance is not None else None
    return "hybridep" if dispatcher == "hybridep" else "deepep" if dispatcher == "deepep" else "none"


def group_preserving_default(instance: Instance, apply: Apply | None = None) -> bool:
    """The expert-map mode when the caller gives no explicit ``group_preserving``: from how the map is applied.

    ``apply`` (default: the instance's ``apply`` field, else ``runtime``):

    - ``runtime``: the consumer maps logical to physical experts at dispatch time
      (:mod:`placement.consumers.runtime` hooks for Megatron-Core and TorchTitan, with the checkpoint permuted
      with ``keep_router``; SGLang's ``--init-expert-location``; vLLM's expert maps): any map is
      valid, so free maps.
    - ``checkpoint``: the map is applied by renumbering router and experts in the checkpoint
      (``placement export --format megatron|torchtitan|maxtext`` without ``--keep-router``), which
      changes the routing unless every expert group stays whole under group-limited routing:
      group-preserving there, free without group-limited routing.

    Examples
    --------
    ``group_preserving_default(dsv3, "checkpoint")`` is True, ``group_preserving_default(dsv3, "runtime")``
    is False, and both are False for a model without group-limited routing.
    """
    mode = resolve_apply(instance, apply)
    return bool(instance.model.group_limited and mode == "checkpoint")


def resolve_apply(instance: Instance, apply: Apply | None = None) -> Apply:
    """``apply`` when given, else the instance's ``apply`` field, else :data:`placement.core.model.DEFAULT_APPLY`."""
    if apply is not None:
        return apply
    return instance.apply_mode


@dataclass(frozen=True)
class SolveResult:
    """What every solver returns.

    status : ``optimal`` (proved), ``feasible`` (time limit hit or gap left), ``heuristic`` (no
        bound attempted).
    objective_bytes : the solver's objective on the sampled tokens, bytes per step, in the cost
        model's units (the evaluator is rerun by the caller; the two must agree for ``total``).
    bound_bytes : a proved lower bound on that objective for the solver's search space, if any.
    params : the parameters that, with the seed, reproduce the placement.
    details : per-layer and per-phase facts (JSON-serialisable, deterministic).
    """

    placement: Placement
    solver: str
    status: Literal["optimal", "feasible", "heuristic"]
    objective_bytes: float
    bound_bytes: float | None = None
    params: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    group_preserving: bool = False
    consumer: Consumer = "none"
    metrics: dict = field(default_factory=dict)  # the evaluator's report, filled by placement.api.solve
    wall_s: float = 0.0  # wall time of the whole solve call, filled by placement.api.solve
    # The wall-clock safety net (or a stop request) ended some of the work, so the placement may
    # depend on the machine's speed.  A wall-clock fact: never written into a placement file.
    wall_clock_cut: bool = field(default=False, compare=False)

    @property
    def gap(self) -> float | None:
        if self.bound_bytes is None:
            return None
        if self.objective_bytes <= 0:
            return 0.0
        return max(0.0, (self.objective_bytes - self.bound_bytes) / self.objective_bytes)


def heuristic_result(
    instance: Instance,
    placement: Placement,
    solver: str,
    *,
    group_preserving: bool,
    params: dict | None = None,
    details: dict | None = None,
) -> SolveResult:
    """The result of a solver without a search or a bound (``default`` and the peers), its objective
    from the evaluator (:func:`placement.predict.cost.evaluate`, sampled tokens)."""
    from placement.predict.cost import evaluate

    return SolveResult(
        placement=placement,
        solver=solver,
        status="heuristic",
        objective_bytes=evaluate(instance, placement).cross_domain_bytes_per_step,
        params={} if params is None else params,
        details={} if details is None else details,
        group_preserving=group_preserving,
        consumer="none",
    )


@contextmanager
def call_on_stop(options: SolveOptions, stop: Callable[[], None], poll_s: float = 0.05) -> Iterator[None]:
    """Call ``stop()`` once from a helper thread if a stop is requested while the block runs.

    For solver code that blocks in C and cannot poll (``CpSolver.solve``: pass
    ``solver.stop_search``).  The deadline itself is the solver's own time limit; this only relays
    :attr:`SolveOptions.stop_event`.
    """
    if options.stop_event is None:
        yield
        return
    done = threading.Event()
    event = options.stop_event

    def watch() -> None:
        while not done.is_set():
            if event.wait(poll_s):
                if not done.is_set():
                    stop()
                return

    thread = threading.Thread(target=watch, name="placement-stop-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class Solver(Protocol):
    def __call__(self, instance: Instance, options: SolveOptions) -> SolveResult: ...
