"""All layers of one rank layout: budgets, the layer workers (in this process or a process pool),
and the plan checked against the evaluator.

Determinism: layers run in a process pool (spawned, one CP-SAT worker each) or in this process and
are gathered in layer order, so the same instance, seed, work budget and worker count give the
same placement.  Layers stop their work :data:`~solvers.experts.tuning.ANYTIME_GRACE_S` before the
deadline (or at a stop request, in this process) and return their best map so far, checked by the
validation guard; at the deadline or a stop request, layers not yet solved (or whose worker has not
answered) keep the map the rank layout was scored with (else the default map).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import signal
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from placement.predict.cost import LayoutIndex, evaluate
from placement.core.model import InfeasibleError, Instance, InvalidInputError, MoEModel, Placement, SolverError
from solvers.base import SolveOptions
from solvers.experts.bounds import sum_bounds
from solvers.experts.budget import LayerBudget, StopCheck, deterministic_budget, layer_work_s, search_net_limit
from solvers.experts.layer import LayerOutcome, solve_layer
from solvers.experts.moves import MOVE_RESERVE_SHARE, LayerMoves, MovePlan, allocate_moves, move_frontier
from solvers.experts.problem import LayerProblem, build_layer_problem
from solvers.experts.tuning import (
    ANYTIME_GRACE_S,
    CLASS_LOAD_TOLERANCE,
    CLASS_LOAD_TOLERANCE_GROUP_PRESERVING,
    DET_PER_WALL_S,
    GPU_LOAD_TOLERANCE,
    POOL_MIN_PAIRS,
    STOP_GRACE_S,
    VALIDATION_FRACTION,
)
from solvers.kernels import bytes_per_crossing, domain_classes

__all__ = ["ExpertPlan", "LayerWorker", "LayerTask", "place_experts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertPlan:
    """The expert maps of every MoE layer for one rank layout.

    phy2log : (num_moe_layers, num_experts) logical expert of each physical slot.
    objective_bytes : the evaluator's ``cross_domain_bytes_per_step`` on the sampled tokens (the
        instance's cost mode) of ``Placement(rank2gpu, phy2log)``.
    bound_bytes : sum of the per-layer proved lower bounds (bytes per step) for this rank layout, if
        every layer has one.
    details : ``{"layers": [per-layer dict, ...], ...}`` (status, objective, bound, candidate scores
        on the fit / validation / all tokens, chosen candidate, load tolerance, CP-SAT runs).
    """

    phy2log: np.ndarray
    objective_bytes: float
    bound_bytes: float | None
    details: dict = field(default_factory=dict)

    @property
    def proved(self) -> bool:
        return all(d.get("status") in ("optimal", "trivial") for d in self.details.get("layers", []))


@dataclass(frozen=True)
class LayerTask:
    """One layer's work order (picklable: it travels to pool workers)."""

    layer: int
    budget: LayerBudget
    model_groups: int
    class_tolerance: float
    hint_row: np.ndarray | None
    moves: LayerMoves | None = None  # move-aware re-placement: the layer's move prices
    fit: str = "mean"  # over several sampled windows (solvers.experts.windows); one window: no effect


class LayerWorker:
    """What every layer of one rank layout shares, built once per process: the instance, the layout
    and its index, the mode.  ``options`` is given only in the calling process (stop requests)."""

    def __init__(self, instance: Instance, rank2gpu: np.ndarray, group_preserving: bool, validation_fraction: float,
                 options: SolveOptions | None = None):
        self.instance = instance
        self.rank2gpu = rank2gpu
        self.layout = LayoutIndex(instance, rank2gpu, instance.routing.tokens_per_source)
        self.group_preserving = group_preserving
        self.validation_fraction = validation_fraction
        self.options = options

    def problem(self, layer: int, fit: str = "mean") -> LayerProblem:
        return build_layer_problem(self.instance, self.rank2gpu, layer, group_preserving=self.group_preserving,
                                   validation_fraction=self.validation_fraction, layout=self.layout, fit=fit)

    def solve(self, task: LayerTask) -> LayerOutcome:
        if StopCheck(task.budget.deadline, self.options)():
            return self.fallback(task.layer, "stopped before the layer started", task.hint_row)
        problem = self.problem(task.layer, task.fit)
        outcome = solve_layer(problem, task.budget, model_groups=task.model_groups,
                              class_tolerance=task.class_tolerance, hint_phy2log=task.hint_row, options=self.options)
        if task.moves is not None:  # move-aware re-placement: candidates between the previous map and this one
            outcome.move_frontier = move_frontier(problem, outcome.expert2slot, task.moves,
                                                  outcome.details.get("load_tolerance"))
        return outcome

    def fallback(self, layer: int, reason: str, hint_row: np.ndarray | None = None) -> LayerOutcome:
        """The map of a layer left unsolved at a stop or the deadline, with no work at all.

        The map the rank layout was scored with (``hint_row``) when there is a valid one: the layout
        was chosen with it, and on a layout other than the default the identity map was never
        scored.  Otherwise the default (identity) map.  Crossings come from the evaluator later.
        """
        model = self.instance.model
        E = model.num_experts
        row, chosen = np.arange(E, dtype=np.int64), "default"
        if hint_row is not None and _valid_map(np.asarray(hint_row, dtype=np.int64), model, self.group_preserving):
            row = np.empty(E, dtype=np.int64)  # hint_row is phy2log (slot -> expert); invert it
            row[np.asarray(hint_row, dtype=np.int64)] = np.arange(E, dtype=np.int64)
            chosen = "layout_hint"
        details = {"layer": layer, "status": "heuristic", "chosen": chosen, "fallback_reason": reason,
                   "objective_crossings": None, "bound_crossings": None}
        return LayerOutcome(layer, row, -1, None, False, details)


def _valid_map(row: np.ndarray, model: MoEModel, group_preserving: bool) -> bool:
    """``row`` (a phy2log row) is a permutation of the experts and, when required, keeps groups whole."""
    E = model.num_experts
    if row.shape != (E,) or not np.array_equal(np.sort(row), np.arange(E)):
        return False
    if not group_preserving:
        return True
    size = model.experts_per_group
    positions = (row // size).reshape(-1, size)  # expert group of every slot, per group position
    return bool((positions == positions[:, :1]).all())


# The pool's child processes build their LayerWorker once, in the initializer (the instance and the
# layout are sent once per process, not once per layer); only _pool_task reads it, only in a child.
_CHILD_WORKER: list[LayerWorker] = []


def _init_pool_worker(payload_path: str, stop_flag: Any = None) -> None:
    """Pool initializer: leave SIGINT/SIGTERM to the parent (it stops the solve and kills us), then
    build this process's :class:`LayerWorker` from the payload file the parent wrote
    (:func:`_write_worker_payload`).

    ``stop_flag`` (a ``multiprocessing`` event of the pool's context) is the parent's stop request
    relayed to this process: the layers poll it as they poll their deadline and return their best
    map so far."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(payload_path, "rb") as f:
        instance, rank2gpu, group_preserving, validation_fraction = pickle.load(f)
    options = SolveOptions(stop_event=stop_flag) if stop_flag is not None else None
    _CHILD_WORKER[:] = [LayerWorker(instance, rank2gpu, group_preserving, validation_fraction, options)]


def _write_worker_payload(worker: LayerWorker) -> str:
    """Write what every pool worker needs (the instance, the rank layout, the map rules) to a private
    temporary file, once, and return its path; the workers' initializer reads it.

    Why a file and not the initializer's arguments: "spawn" sends a new process its arguments
    through a pipe whose read end the parent itself keeps open until the write ends.  A child that
    dies before it has read them all (the pool breaking while it starts, a worker killed from
    outside) then leaves the parent blocked in that write for ever, inside ``submit``, past any
    deadline.  The instance pickles to 7.6 MB for dsv3_256, far beyond a pipe's 64 KiB; a stress
    loop of pools whose workers exit at once, with a 1 MB argument, hung 3 times in about 400
    pools.  With a path the pipe carries 1.9 KB per child (measured on dsv3_256), which it takes
    without blocking."""
    fd, path = tempfile.mkstemp(prefix="placement-experts-", suffix=".pickle")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump((worker.instance, worker.rank2gpu, worker.group_preserving, worker.validation_fraction),
                        f, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


def _pool_task(task: LayerTask) -> LayerOutcome:
    return _CHILD_WORKER[0].solve(task)


def _spawn_can_start() -> bool:
    """Whether "spawn" children can re-create ``__main__``: not when it was read from stdin or ``-c``
    (its ``__file__`` is not a file).  There a child dies in its preparation and the parent can block
    writing the task payload to it, so such callers are served in-process."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return True  # interactive (spawn does not re-run it) or ``python -m``
    return os.path.isfile(path)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's own worker processes, by object (they ignore SIGINT and SIGTERM)."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.kill()


#: Environment variables that cap the BLAS / OpenMP threads of a process that reads them at start.
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _one_blas_thread_env() -> Iterator[None]:
    """One BLAS thread for the worker processes started inside (variables the caller set are kept).

    Each worker already is one of ``num_workers`` parallel processes; a multi-threaded BLAS in each
    only spins against the others.  Measured on the 2-core project machine at load 13: a
    (487, 8) x (8, 512) float32 product took 20 ms with OpenBLAS's default threads, 0.4 ms with one.
    The variables are restored when the block ends (this process keeps its own BLAS as it was).
    """
    saved = {k: os.environ.get(k) for k in _BLAS_THREAD_VARS}
    for k in _BLAS_THREAD_VARS:
        os.environ.setdefault(k, "1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _submit(pool: ProcessPoolExecutor, task: LayerTask) -> Any:
    """``pool.submit`` of one layer.  A worker that dies while ``submit`` starts another one can leave
    the executor with its queues closed before it is marked broken; starting the new process then
    fails (CPython 3.11; python/cpython#80462 and #83279 are the same family) in one of two ways:
    ``OSError: handle is closed``, or, when a new pipe has already reused a closed queue's file
    descriptor number, ``ValueError: bad value(s) in fds_to_keep`` (the same number passed to the
    child twice; seen in a CI run with an initializer that exits).  Either is a broken pool: raised
    as :class:`BrokenProcessPool`, so the caller's in-process fallback takes over, as for every other
    way a worker dies.  Any other ``ValueError`` is a bug and propagates."""
    try:
        return pool.submit(_pool_task, task)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) and "fds_to_keep" not in str(exc):
            raise
        raise BrokenProcessPool(f"a worker died while the pool started another ({exc})") from exc


def _solve_unsolved_here(tasks: list[LayerTask], worker: LayerWorker, finished: Callable[[LayerOutcome], None],
                         outcomes: dict[int, LayerOutcome]) -> None:
    """The layers of ``tasks`` no outcome holds yet, solved in this process (each checks the deadline
    first: past it, the layer keeps its fallback map)."""
    for task in tasks:
        if task.layer not in outcomes:
            finished(worker.solve(task))


def _run_pool(tasks: list[LayerTask], workers: int, deadline: float, worker: LayerWorker,
              finished: Callable[[LayerOutcome], None], outcomes: dict[int, LayerOutcome],
              options: SolveOptions, initializer: Callable[..., None] | None = None) -> None:
    """Run layer tasks in a pool of ``workers`` spawned processes (:func:`_run_pool_from`) with the
    workers' payload in a temporary file, removed when the pool has ended; when that file cannot be
    written (a full or read-only temporary folder) the layers are solved in this process."""
    try:
        payload = _write_worker_payload(worker)
    except OSError as exc:
        log.warning("expert placement: cannot write the pool workers' payload (%s); solving in-process", exc)
        _solve_unsolved_here(tasks, worker, finished, outcomes)
        return
    try:
        _run_pool_from(payload, tasks, workers, deadline, worker, finished, outcomes, options, initializer)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(payload)


def _run_pool_from(payload: str, tasks: list[LayerTask], workers: int, deadline: float, worker: LayerWorker,
                   finished: Callable[[LayerOutcome], None], outcomes: dict[int, LayerOutcome],
                   options: SolveOptions, initializer: Callable[..., None] | None = None) -> None:
    """Run layer tasks in a pool of ``workers`` spawned processes until done, the deadline or a stop.

    The parent polls :meth:`SolveOptions.should_stop` while it waits.  At a stop request it relays
    the request to the workers (an event of the pool's context) and waits up to
    :data:`STOP_GRACE_S` for the layers in flight to return their best maps so far (a layer polls
    the stop between units of work; layers not started return at once).  At the deadline (the
    layers have already returned theirs :data:`~solvers.experts.tuning.ANYTIME_GRACE_S` before it)
    or when that grace ends, our own workers (which ignore SIGINT/SIGTERM) are killed and the layers
    still unsolved keep their fallback map; if the pool breaks (a worker died or its ``initializer``
    failed), the workers are killed and the remaining layers are solved in this process, each up to
    the deadline.
    """
    ctx = get_context("spawn")
    stop_flag = ctx.Event()
    init_args = (payload, stop_flag)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                               initializer=initializer or _init_pool_worker, initargs=init_args)
    futures: dict = {}
    reason = None
    try:
        with _one_blas_thread_env():  # the workers start at the first submit and read it then
            for task in tasks:  # submit itself raises BrokenProcessPool once a worker has died
                futures[_submit(pool, task)] = task.layer
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: futures[f]):
                finished(fut.result())
            if pending and (time.monotonic() >= deadline or options.should_stop()):
                reason = "stop requested" if options.stop_requested() else "deadline reached"
                if reason == "stop requested":
                    stop_flag.set()
                    grace_end = min(deadline, time.monotonic() + STOP_GRACE_S)
                    while pending and time.monotonic() < grace_end:
                        done, pending = wait(pending, timeout=min(0.05, max(0.0, grace_end - time.monotonic())),
                                             return_when=FIRST_COMPLETED)
                        for fut in sorted(done, key=lambda f: futures[f]):
                            finished(fut.result())
                break
    except BrokenProcessPool as exc:
        # A worker died (killed from outside, out of memory, an unguarded __main__ under "spawn").
        # The executor's own clean-up only sends SIGTERM, which our workers ignore, and then joins
        # them: a surviving worker would keep it (and the interpreter's exit) waiting.  Kill them.
        log.warning("expert placement: the process pool broke (%s); solving the rest in-process", exc)
        _kill_workers(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        _solve_unsolved_here(tasks, worker, finished, outcomes)
        return
    if reason is None:
        pool.shutdown(wait=True)
        return
    unsolved = sum(1 for t in tasks if t.layer not in outcomes)
    if unsolved:
        log.warning("expert placement: %s with %d layers unsolved; they keep the layout's map (else the default)",
                    reason, unsolved)
    _kill_workers(pool)
    pool.shutdown(wait=False, cancel_futures=True)
    for task in tasks:
        if task.layer not in outcomes:
            finished(worker.fallback(task.layer, reason, task.hint_row))


def _layer_weight(instance: Instance, layout: LayoutIndex, layer: int) -> tuple[float, float]:
    """``(weight, pairs)`` of a layer, known without building it: its sampled (token, expert) pairs
    (0 for a trivial layer), and those times its classes beyond the first (its relative difficulty)."""
    C = domain_classes(layout.group_node[int(instance.moe_layer2stage[layer])])[0].shape[0]
    dp, T, k = instance.routing.topk.shape[1:]
    pairs = float(dp * T * k) if C > 1 else 0.0
    return pairs * (C - 1), pairs


def _check_request(instance: Instance, rank2gpu: np.ndarray, layers: Sequence[int] | None) -> list[int]:
    """The layers to solve, after checking the layout and the model (one-line errors naming the parameter)."""
    L, E = instance.model.num_moe_layers, instance.model.num_experts
    if rank2gpu.shape != (instance.parallel.world_size,):
        raise InvalidInputError(f"rank2gpu: expected {instance.parallel.world_size} ranks, found shape {rank2gpu.shape}")
    if E % instance.parallel.ep:
        raise InfeasibleError(f"model.num_experts: {E} experts do not fill {instance.parallel.ep} EP ranks evenly")
    todo = list(range(L)) if layers is None else sorted({int(x) for x in layers})
    for li in todo:
        if not 0 <= li < L:
            raise InvalidInputError(f"layers: MoE layer {li} does not exist (the model has {L})")
    return todo


def _budgets(instance: Instance, layout: LayoutIndex, options: SolveOptions, todo: list[int], deadline: float,
             deterministic_time: float | None) -> tuple[dict[int, LayerBudget], dict[int, float], list[float], float]:
    """Per layer: its budget and weight; also the per-layer deterministic times and the pairs total."""
    weights, pairs = zip(*[_layer_weight(instance, layout, li) for li in todo]) if todo else ((), ())
    if deterministic_time is None:
        dets = deterministic_budget(options.resolved_work_budget_s(), options.num_workers, weights, pairs)
    else:
        w = np.asarray(weights) if sum(weights) > 0 else np.ones(len(todo))
        dets = [float(deterministic_time * x / w.sum()) for x in w]
    # Anytime (issue 16): layers stop a little before the deadline and return their best map so far.
    deadline = deadline - min(ANYTIME_GRACE_S, max(0.0, deadline - time.monotonic()) / 5.0)
    # Scalable search (issue 16): the nets each layer's search may see, from its share of the work.
    works = layer_work_s(options.resolved_work_budget_s(), options.num_workers, weights)
    limits = [search_net_limit(wk, p, instance.model.top_k, int(round(w / p)) + 1) if p > 0 else None
              for wk, w, p in zip(works, weights, pairs)]
    budgets = {li: LayerBudget(d, (options.seed * 1_000_003 + li) % (2**31 - 1), deadline, search_nets=lim)
               for li, d, lim in zip(todo, dets, limits)}
    return budgets, dict(zip(todo, weights)), dets, float(sum(pairs))


def _solve_all(tasks: list[LayerTask], weight_of: dict[int, float], worker: LayerWorker, deadline: float,
               options: SolveOptions, use_pool: bool, finished: Callable[[LayerOutcome], None],
               outcomes: dict[int, LayerOutcome], pool_initializer: Callable[..., None] | None = None) -> None:
    """Trivial layers here; the others heaviest first, in a pool when it pays, else here."""
    for t in tasks:
        if weight_of[t.layer] == 0:
            finished(worker.solve(t))
    hard = sorted((t for t in tasks if weight_of[t.layer] > 0), key=lambda t: (-weight_of[t.layer], t.layer))
    workers = max(1, min(int(options.num_workers), len(hard)))
    if use_pool and workers > 1 and not _spawn_can_start():
        log.warning("expert placement: worker processes cannot re-import this __main__ (stdin or -c); "
                    "solving in this process")
        use_pool = False
    if workers == 1 or not use_pool:
        for t in hard:
            finished(worker.solve(t))
    else:
        _run_pool(hard, workers, deadline, worker, finished, outcomes, options, pool_initializer)


def _checked_plan(instance: Instance, rank2gpu: np.ndarray, layout: LayoutIndex, todo: list[int],
                  outcomes: dict[int, LayerOutcome]) -> tuple[np.ndarray, float, float]:
    """``(phy2log, objective bytes, bytes per crossing)``, every layer's crossings checked against the evaluator."""
    model = instance.model
    L, E = model.num_moe_layers, model.num_experts
    bpc = bytes_per_crossing(instance, instance.routing.tokens_per_source)
    phy2log = np.tile(np.arange(E, dtype=np.int64), (L, 1))
    for li, o in outcomes.items():
        phy2log[li, o.expert2slot] = np.arange(E)
    metrics = evaluate(instance, Placement(rank2gpu, phy2log), window="sampled", layout=layout)
    for li in todo:  # layers left at a fallback map: their cost from the evaluator
        o = outcomes[li]
        if o.crossings < 0:
            o.crossings = int(round(metrics.cross_domain_bytes_per_layer[li] / bpc))
            o.details["objective_crossings"] = o.crossings
    for li in todo:
        got, want = outcomes[li].crossings * bpc, metrics.cross_domain_bytes_per_layer[li]
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-3):
            raise SolverError(f"layer {li}: internal cost {got} disagrees with the evaluator {want}")
    return phy2log, metrics.cross_domain_bytes_per_step, bpc


def _plan_details(outcomes: list[LayerOutcome], bpc: float, *, gp: bool, validation_fraction: float,
                  class_tolerance: float, deterministic_time_total: float) -> dict:
    """The plan's deterministic details: every layer's, and the totals."""
    layer_details = [o.details for o in outcomes]
    return {
        "layers": layer_details,
        "group_preserving": gp,
        "validation_fraction": validation_fraction,
        "class_load_tolerance": class_tolerance,
        "gpu_load_tolerance": GPU_LOAD_TOLERANCE,
        "deterministic_time_total": round(deterministic_time_total, 6),
        "det_per_wall_s": DET_PER_WALL_S,
        # A valid bound on the total even when some layers have none (they count 0 in it).
        "partial_bound_bytes": float(sum((o.bound or 0) * bpc for o in outcomes)),
        "layers_without_bound": sum(1 for o in outcomes if o.bound is None),
        "layers_proved": sum(1 for d in layer_details if d["status"] in ("optimal", "trivial")),
        "layers_total": len(outcomes),
    }


def place_experts(
    instance: Instance,
    rank2gpu: np.ndarray,
    options: SolveOptions,
    *,
    deadline: float,
    layers: Sequence[int] | None = None,
    validation_fraction: float = VALIDATION_FRACTION,
    class_tolerance: float | None = None,
    deterministic_time: float | None = None,
    hint_phy2log: np.ndarray | None = None,
    use_pool: bool | None = None,
    pool_initializer: Callable[..., None] | None = None,
    moves: MovePlan | None = None,
) -> ExpertPlan:
    """Optimise every MoE layer's expert map for a FIXED rank layout ``rank2gpu``.

    Parameters
    ----------
    instance : the problem (the solver view; the held-out window is never read).
    rank2gpu : (world,) GPU of each global rank.
    options : seed, workers (processes), group preservation, progress callback; the deterministic
        work is sized by :meth:`SolveOptions.resolved_work_budget_s`.
    deadline : ``time.monotonic()`` instant by which to return (safety net only).
    layers : MoE layers to optimise (default all); the others keep the default (identity) map.
    validation_fraction : share of each source's last sampled tokens held back to choose between
        candidates (0 disables the guard: every candidate is fitted and judged on all tokens).
    class_tolerance : starting per-class load tolerance (default: ``CLASS_LOAD_TOLERANCE``, or
        ``CLASS_LOAD_TOLERANCE_GROUP_PRESERVING`` for group-preserving maps).
    deterministic_time : total CP-SAT deterministic budget (default: from the work budget).
    hint_phy2log : (num_moe_layers, num_experts) an expert map to start from as well (e.g. the one the
        rank layout was scored with); used where it meets the load caps.
    use_pool : solve layers in a process pool (``None``: when the instance has at least
        ``POOL_MIN_PAIRS`` sampled (token, expert) pairs on straddling layers and more than one
        worker; starting processes costs seconds).  The maps do not depend on it.
    pool_initializer : the pool's worker initializer, called in each child with ``(payload_path,
        stop_flag)`` (default: the one that builds the child's :class:`LayerWorker` from the
        payload file); a parameter so that tests can make the workers fail to start.
    moves : move-aware re-placement (:mod:`solvers.experts.moves`): each layer also builds candidate
        maps between the previous map and its solved one, and one per layer is chosen under the
        budget or the move cost; layers left at a fallback map keep ``hint_phy2log`` (pass the
        previous maps there).
    """
    t0 = time.monotonic()
    model = instance.model
    L, E = model.num_moe_layers, model.num_experts
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    todo = _check_request(instance, rank2gpu, layers)
    gp = bool(options.fit_groups_whole(instance)) and model.num_groups > 1
    if class_tolerance is None:
        class_tolerance = CLASS_LOAD_TOLERANCE_GROUP_PRESERVING if gp else CLASS_LOAD_TOLERANCE
    if hint_phy2log is not None:
        hint_phy2log = np.asarray(hint_phy2log, dtype=np.int64)
        if hint_phy2log.shape != (L, E):
            raise InvalidInputError(f"hint_phy2log: expected shape {(L, E)}, found {hint_phy2log.shape}")
    worker = LayerWorker(instance, rank2gpu, gp, validation_fraction, options)  # this process
    final_deadline = deadline
    if moves is not None:  # keep time for the cheap candidates of layers the deadline leaves unsolved
        deadline = t0 + (deadline - t0) * (1.0 - MOVE_RESERVE_SHARE)
    budgets, weight_of, dets, pairs_total = _budgets(instance, worker.layout, options, todo, deadline,
                                                     deterministic_time)
    outcomes: dict[int, LayerOutcome] = {}

    def finished(o: LayerOutcome) -> None:
        outcomes[o.layer] = o
        d = o.details
        options.report(f"layer {o.layer + 1}/{L}: {d['status']}, {d['chosen']}, "
                       f"{d['objective_crossings']} crossings (bound {o.bound}), {o.wall_s:.1f} s  "
                       f"[{len(outcomes)}/{len(todo)}]")
        if options.on_progress is not None:  # observes only: called here, in the calling process
            options.on_progress(len(outcomes), len(todo))

    tasks = [LayerTask(li, budgets[li], model.num_groups, class_tolerance,
                       None if hint_phy2log is None else hint_phy2log[li],
                       None if moves is None else moves.layers[li], options.fit) for li in todo]
    _solve_all(tasks, weight_of, worker, deadline, options,
               pairs_total >= POOL_MIN_PAIRS if use_pool is None else use_pool, finished, outcomes, pool_initializer)
    moves_summary = None
    if moves is not None:  # the cheap candidates stop early enough to leave time for the allocation
        cheap_deadline = t0 + (final_deadline - t0) * (1.0 - MOVE_RESERVE_SHARE / 3.0)
        t_moves = time.monotonic()
        moves_summary = _apply_moves(instance, rank2gpu, outcomes, todo, moves, options, worker, cheap_deadline)
        log.info("expert placement: move allocation in %.1f s", time.monotonic() - t_moves)
    phy2log, objective_bytes, bpc = _checked_plan(instance, rank2gpu, worker.layout, todo, outcomes)
    bound_bytes = None
    if layers is None or len(todo) == L:
        bound_bytes = sum_bounds([None if (b := outcomes[li].bound) is None else b * bpc for li in todo])
    details = _plan_details([outcomes[li] for li in todo], bpc, gp=gp, validation_fraction=validation_fraction,
                            class_tolerance=class_tolerance, deterministic_time_total=float(sum(dets)))
    if moves_summary is not None:
        details["moves"] = moves_summary
    if instance.routing.num_windows > 1:  # several sampled windows; absent for one (files unchanged)
        details["fit"] = {"objective": options.fit, "window_tokens": list(instance.routing.window_tokens or ()),
                          "guard": "latest window" if validation_fraction > 0 else "none"}
    log.info("expert placement: %d layers in %.1f s", len(todo), time.monotonic() - t0)
    return ExpertPlan(phy2log=phy2log, objective_bytes=objective_bytes, bound_bytes=bound_bytes, details=details)


def _apply_moves(instance: Instance, rank2gpu: np.ndarray, outcomes: dict[int, LayerOutcome], todo: list[int],
                 moves: MovePlan, options: SolveOptions, worker: LayerWorker, deadline: float) -> dict:
    """Move-aware re-placement: replace every solved layer's map by the candidate :func:`allocate_moves`
    chooses; returns the summary.  Layers the deadline left unsolved get the cheap candidates (the
    previous map and its rebalanced variants) while time is left before ``deadline``, else keep
    their fallback map.  Under a budget with the ``step_time`` objective the budget buys predicted
    step time."""
    from solvers.experts.moves import cheap_frontier

    bpc = bytes_per_crossing(instance, instance.routing.tokens_per_source)
    for li in todo:
        o = outcomes[li]
        if not o.move_frontier and o.details.get("fallback_reason") and time.monotonic() < deadline \
                and not options.stop_requested():
            o.move_frontier = cheap_frontier(worker.problem(li), moves.layers[li])
            o.crossings = o.move_frontier[0].crossings  # the fallback map is the previous map
            o.details["objective_crossings"] = o.crossings
    frontiers = {li: outcomes[li].move_frontier for li in todo if outcomes[li].move_frontier}
    step = None
    if moves.max_moved_replicas is not None and options.objective == "step_time" and instance.performance is not None:
        from placement.predict.performance import StepTimeModel
        from solvers.experts.moves import StepCurrency

        E = instance.model.num_experts
        prev = np.tile(np.arange(E, dtype=np.int64), (instance.model.num_moe_layers, 1))
        for li, lm in moves.layers.items():
            prev[li, lm.prev_expert2slot] = np.arange(E)
        met = evaluate(instance, Placement(rank2gpu, prev), window="sampled")
        step = StepCurrency(StepTimeModel(instance), np.asarray(met.alltoall_time_s_per_layer, dtype=np.float64),
                            np.asarray(met.expert_load_max_over_mean_per_layer, dtype=np.float64),
                            np.asarray(rank2gpu, dtype=np.int64))
    chosen = allocate_moves(frontiers, moves, bpc, step)
    for li, c in chosen.items():
        o = outcomes[li]
        solved = o.crossings
        o.details["moves"] = {"chosen": c.name, "candidates": len(frontiers[li]), "crossings": c.crossings,
                              "solved_crossings": solved, "previous_crossings": frontiers[li][0].crossings,
                              "moved_replicas_cross_rack": c.cross, "moved_replicas_nvlink": c.nvlink}
        o.expert2slot, o.crossings = c.expert2slot, c.crossings
        o.details["objective_crossings"] = c.crossings
        if o.bound is not None and o.bound > c.crossings:  # the previous map may lie outside the load caps
            o.bound = c.crossings
            o.details["bound_crossings"] = c.crossings
        o.proved = o.bound is not None and o.bound == c.crossings
        if o.details.get("status") in ("optimal", "feasible"):
            o.details["status"] = "optimal" if o.proved else "feasible"
        o.move_frontier = []
    used = sum(c.replicas for c in chosen.values())
    return {"rule": "max_moved_bytes" if moves.max_moved_replicas is not None else "move_cost",
            "currency": "predicted_step_time" if step is not None else "crossings",
            "max_moved_replicas": moves.max_moved_replicas, "move_cost": moves.move_cost,
            "bytes_per_replica": moves.bytes_per_replica, "moved_replicas": used,
            "layers_without_candidates": sorted(set(todo) - set(frontiers))}

