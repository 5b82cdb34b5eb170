"""The CP-SAT model of one layer's experts -> classes problem, one function per variable or
constraint family, and one single-threaded solve under a deterministic budget.

``x[e, c]``: free expert ``e`` in class ``c``.  ``per_domain``: ``y[n, d] >= x[e, c]`` for every
expert ``e`` of aggregated net ``n`` and class ``c`` remote in ``d`` for the net's EP group;
minimise ``sum w_n y[n, d]``.  ``per_pair``: linear in ``x``.  Class capacities; per-EP-group load
caps; group-preserving structure, constructively: ``z[p, t]`` puts expert group ``p`` on a group
position of type ``t`` (each type exactly as often as positions of it exist) and the group's
experts take exactly that type's class make-up, so every solution keeps expert groups whole.  A
complete hint (``x``, ``y`` and ``z`` from one class map).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from placement.core.model import SolverError
from solvers.base import SolveOptions, call_on_stop
from solvers.experts.problem import LayerProblem, NetSet, group2type_of, linear_costs

if TYPE_CHECKING:
    from ortools.sat.python.cp_model import CpModel

__all__ = ["CpsatModel", "CpsatRun", "build_cpsat_model", "run_cpsat"]

log = logging.getLogger(__name__)

Link = tuple[int, int, int]  # (expert, class, remote local domain)


def _allowed_classes(problem: LayerProblem, fixed: np.ndarray, group2type: np.ndarray | None) -> list[list[int]]:
    """Classes each expert may take: its fixed class, its group's position type's classes, or any."""
    C = problem.num_classes
    out: list[list[int]] = []
    type_count = problem.position_types[1]
    for e in range(problem.num_experts):
        if fixed[e] >= 0:
            out.append([int(fixed[e])])
        elif group2type is not None:
            t = int(group2type[e // problem.expert_group_size])
            out.append([c for c in range(C) if type_count[t, c] > 0])
        else:
            out.append(list(range(C)))
    return out


def _add_assignment(m: CpModel, allowed: list[list[int]]) -> dict:
    """x[e, c] for every free expert and allowed class; each free expert in exactly one class."""
    x = {}
    for e, cls in enumerate(allowed):
        if len(cls) == 1:
            continue  # fixed: a constant, no variable
        for c in cls:
            x[e, c] = m.new_bool_var(f"x_{e}_{c}")
        m.add_exactly_one(x[e, c] for c in cls)
    return x


def _add_capacity(m: CpModel, problem: LayerProblem, x: dict, allowed: list[list[int]],
                  group2type: np.ndarray | None) -> None:
    """Class capacities, or with a fixed group -> type map each group's class make-up."""
    if group2type is not None:
        type_count = problem.position_types[1]
        gs = problem.expert_group_size
        for p in range(problem.num_group_positions):
            for c in range(problem.num_classes):
                terms = [x[e, c] for e in range(p * gs, (p + 1) * gs) if (e, c) in x]
                fixed_here = sum(1 for e in range(p * gs, (p + 1) * gs) if allowed[e] == [c])
                need = int(type_count[group2type[p], c]) - fixed_here
                if terms:
                    m.add(sum(terms) == need)
        return
    for c in range(problem.num_classes):
        terms = [x[e, c] for e in range(problem.num_experts) if (e, c) in x]
        fixed_here = sum(1 for cls in allowed if cls == [c])
        if terms:
            m.add(sum(terms) == int(problem.class_capacity[c]) - fixed_here)


def _add_load_caps(m: CpModel, problem: LayerProblem, x: dict, allowed: list[list[int]], cap: np.ndarray) -> None:
    """Each class's pairs within its cap, per EP group (fixed experts count as constants)."""
    for g in range(problem.num_ep_groups):
        ld = problem.load[g]
        for c in range(problem.num_classes):
            fixed_load = int(sum(int(ld[e]) for e, cls in enumerate(allowed) if cls == [c]))
            free = [e for e in range(problem.num_experts) if (e, c) in x and ld[e]]
            room = int(cap[g, c]) - fixed_load
            free_cap = int(problem.class_capacity[c]) - sum(1 for cls in allowed if cls == [c])
            if int(np.sort(ld[free])[::-1][:max(free_cap, 0)].sum()) <= room:
                continue  # cannot bind
            m.add(sum(int(ld[e]) * x[e, c] for e in free) <= room)


def _add_group_positions(m: CpModel, problem: LayerProblem, x: dict) -> dict:
    """Group-preserving structure: each expert group takes one group position type's class make-up."""
    _, type_count, mult = problem.position_types
    gs = problem.expert_group_size
    P, T = problem.num_group_positions, type_count.shape[0]
    z = {}
    for p in range(P):
        for t in range(T):
            z[p, t] = m.new_bool_var(f"z_{p}_{t}")
        m.add_exactly_one(z[p, t] for t in range(T))
    for t in range(T):
        m.add(sum(z[p, t] for p in range(P)) == int(mult[t]))
    for p in range(P):
        for c in range(problem.num_classes):
            m.add(sum(x[e, c] for e in range(p * gs, (p + 1) * gs))
                  == sum(int(type_count[t, c]) * z[p, t] for t in range(T)))
    return z


def _reduce_nets(problem: LayerProblem, nets: NetSet, allowed: list[list[int]]) -> tuple[int, list[tuple[int, tuple]]]:
    """per_domain nets as ``(constant crossings, [(weight, links) ...])``, aggregated.

    ``links`` are ``(e, c, d)``: free expert ``e`` in class ``c`` puts the net in remote domain ``d``.  A
    remote domain already reached by a fixed expert is a constant; a net that can reach no further
    remote domain through a free expert contributes only its constant.  Identical reduced nets
    (same links) are merged by adding their weights.
    """
    sig = problem.class_sig
    constant = 0
    merged: dict[tuple, int] = {}
    for n in range(nets.num_nets):
        g, s, w = int(nets.group[n]), int(nets.src[n]), int(nets.weight[n])
        forced = set()
        free = []
        for e in nets.experts[n]:
            cls = allowed[int(e)]
            if len(cls) == 1:
                d = int(sig[cls[0], g])
                if d != s:
                    forced.add(d)
            else:
                free.append(int(e))
        constant += w * len(forced)
        links = tuple(sorted((e, c, int(sig[c, g])) for e in free for c in allowed[e]
                             if int(sig[c, g]) != s and int(sig[c, g]) not in forced))
        if links:
            merged[links] = merged.get(links, 0) + w
    return constant, [(w, links) for links, w in sorted(merged.items())]


@dataclass
class CpsatModel:
    """A built model and its variable dicts (keys are tuples, names carry the indices).

    The model's objective plus ``objective_offset`` is the crossings on the nets.
    """

    model: CpModel
    x: dict  # (e, c) -> bool: free expert e sits in class c
    y: dict  # (n, d) -> bool: reduced net n reaches remote local domain d (per_domain only)
    z: dict  # (p, t) -> bool: expert group p sits on a group position of type t
    allowed: list
    objective_offset: int = 0


def _add_objective(m: CpModel, problem: LayerProblem, nets: NetSet, x: dict, allowed: list[list[int]]) -> tuple[dict, int]:
    """The crossings objective; returns ``(y, objective_offset)``."""
    y: dict = {}
    if problem.cost_mode == "per_domain":
        offset, reduced = _reduce_nets(problem, nets, allowed)
        terms = []
        for n, (w, links) in enumerate(reduced):
            for e, c, d in links:
                if (n, d) not in y:
                    y[n, d] = m.new_bool_var(f"y_{n}_{d}")
                    terms.append(w * y[n, d])
                m.add_implication(x[e, c], y[n, d])
        m.minimize(sum(terms) if terms else 0)
        return y, offset
    lin = linear_costs(problem, nets).astype(np.int64)
    offset = int(sum(int(lin[e, cls[0]]) for e, cls in enumerate(allowed) if len(cls) == 1))
    m.minimize(sum(int(lin[e, c]) * v for (e, c), v in x.items() if lin[e, c] and len(allowed[e]) > 1))
    return y, offset


def build_cpsat_model(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray | None,
    hint: np.ndarray | None,
    *,
    fixed: np.ndarray | None = None,
    group2type: np.ndarray | None = None,
) -> CpsatModel:
    """The CP-SAT model of one layer's experts -> classes problem on ``nets``.

    Parameters
    ----------
    problem, nets : the layer and the tokens to fit.
    cap : (G, C) class load caps (None: no load constraint).
    hint : (E,) a complete map handed over as a complete hint (``x``, ``y`` and ``z`` derived).
    fixed : (E,) class of each expert fixed in advance, -1 where free (default: all free).
    group2type : (num_groups,) position type of each expert group, fixed (group-preserving
        subproblems; default: decided by the model through ``z``).

    The objective is in crossings (integer net weights) less ``objective_offset``; multiply by
    ``problem.bytes_per_crossing`` for bytes.
    """
    from ortools.sat.python import cp_model

    fixed = np.full(problem.num_experts, -1, dtype=np.int64) if fixed is None else np.asarray(fixed)
    allowed = _allowed_classes(problem, fixed, group2type)
    m = cp_model.CpModel()
    x = _add_assignment(m, allowed)
    z: dict = {}
    if problem.group_preserving and group2type is None:
        for e, cls in enumerate(allowed):  # the z-model needs every x; fixed ones become constants
            for c in range(problem.num_classes):
                if (e, c) not in x:
                    x[e, c] = m.new_constant(int(cls == [c]))
        z = _add_group_positions(m, problem, x)
    else:
        _add_capacity(m, problem, x, allowed, group2type)
    if cap is not None:
        _add_load_caps(m, problem, x, allowed, cap)
    y, offset = _add_objective(m, problem, nets, x, allowed)
    built = CpsatModel(m, x, y, z, allowed, offset)
    if hint is not None:
        _add_hints(built, problem, nets, hint)
    return built


def _add_hints(built: CpsatModel, problem: LayerProblem, nets: NetSet, hint: np.ndarray) -> None:
    """A complete hint: every x, y and z from the class map ``hint`` (E,)."""
    m = built.model
    for (e, c), v in built.x.items():
        if len(built.allowed[e]) > 1:
            m.add_hint(v, bool(hint[e] == c))
    if built.y:
        # y[n, d] is 1 when some link (e, c, d) of reduced net n has hint[e] == c.
        _, reduced = _reduce_nets(problem, nets, built.allowed)
        for n, (_, links) in enumerate(reduced):
            on = {d for e, c, d in links if hint[e] == c}
            for d in {d for _, _, d in links}:
                m.add_hint(built.y[n, d], d in on)
    if built.z:
        g2t = group2type_of(problem, hint)
        assert g2t is not None  # z exists only in group-preserving mode
        for (p, t), v in built.z.items():
            m.add_hint(v, bool(g2t[p] == t))


@dataclass(frozen=True)
class CpsatRun:
    """What one CP-SAT call returned (deterministic fields only, but ``wall_s``)."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    expert2class: np.ndarray | None
    objective: int | None  # crossings
    bound: int | None  # proved lower bound, crossings (ceil of CP-SAT's best bound)
    deterministic_time: float
    wall_clock_cut: bool  # the safety-net wall limit stopped it (result may differ between runs)
    wall_s: float


def _solver(problem: LayerProblem, deterministic_time: float, wall_limit_s: float, seed: int) -> Any:
    """A single-threaded CpSolver with the deterministic budget, the wall safety net and the seed."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = int(seed) % (2**31 - 1)
    prm.max_deterministic_time = float(max(deterministic_time, 1e-3))
    prm.presolve_probing_deterministic_time_limit = float(max(0.1 * deterministic_time, 1e-3))
    prm.max_time_in_seconds = float(wall_limit_s)
    if log.isEnabledFor(logging.DEBUG):
        prm.log_search_progress = True
        prm.log_to_stdout = False
        solver.log_callback = lambda line: log.debug("layer %d: %s", problem.layer, line)
    return solver


def _bound_of(solver: Any, offset: int) -> int | None:
    b = solver.best_objective_bound
    return int(math.ceil(b - 1e-6)) + offset if math.isfinite(b) else None


def run_cpsat(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray | None,
    hint: np.ndarray | None,
    *,
    deterministic_time: float,
    wall_limit_s: float,
    seed: int,
    fixed: np.ndarray | None = None,
    group2type: np.ndarray | None = None,
    options: SolveOptions | None = None,
) -> CpsatRun:
    """Build and solve a layer's model (or a subproblem) single-threaded under a deterministic budget.

    ``max_deterministic_time`` bounds the work (reproducible), ``max_time_in_seconds`` is a safety
    net only, ``random_seed`` is fixed, presolve probing gets at most a tenth of the budget, and the
    search log goes to this module's logger.  With ``options`` (only in the calling process), a stop
    request interrupts the solve (:func:`solvers.base.call_on_stop`).  Objective and bound are in
    crossings on ``nets``.
    """
    from ortools.sat.python import cp_model

    t0 = time.monotonic()
    built = build_cpsat_model(problem, nets, cap, hint, fixed=fixed, group2type=group2type)
    wall_left = max(0.05, wall_limit_s - (time.monotonic() - t0))
    solver = _solver(problem, deterministic_time, wall_left, seed)
    if options is not None:
        solver.parameters.catch_sigint_signal = False  # the caller owns SIGINT
        with call_on_stop(options, solver.stop_search):
            status = solver.solve(built.model)
    else:
        status = solver.solve(built.model)
    name = solver.status_name(status)
    wall = time.monotonic() - t0
    det_limit = solver.parameters.max_deterministic_time
    cut = bool(status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and solver.wall_time >= wall_left * 0.98
               and solver.deterministic_time < det_limit * 0.98)
    if status == cp_model.MODEL_INVALID:
        raise SolverError(f"layer {problem.layer}: CP-SAT rejected the model ({built.model.validate()})")
    off = built.objective_offset
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        e2c = np.empty(problem.num_experts, dtype=np.int64)
        for e, cls in enumerate(built.allowed):
            e2c[e] = cls[0] if len(cls) == 1 else next(c for c in cls if solver.boolean_value(built.x[e, c]))
        obj = int(round(solver.objective_value)) + off
        bound = _bound_of(solver, off)
        bound = obj if bound is None else min(max(bound, 0), obj)
        return CpsatRun(name, e2c, obj, bound, solver.deterministic_time, cut, wall)
    if status == cp_model.INFEASIBLE:
        return CpsatRun(name, None, None, None, solver.deterministic_time, cut, wall)
    bound = _bound_of(solver, off)
    return CpsatRun(name, None, None, None if bound is None else max(bound, 0), solver.deterministic_time, cut, wall)
