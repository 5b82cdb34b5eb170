"""The planner: peers' layouts, candidate shapes, the footprint search, replicas, and the choice
(the package docstring has the method)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from placement.predict.cost import evaluate
from placement.core.dispatch import node_labels, node_rule
from placement.core.model import InfeasibleError, Instance, Placement, SolverError
from solvers.base import Objective, SolveOptions
from solvers.kernels.classes import domain_classes
from solvers.kernels.packing import lpt_pack
from solvers.layout.blocks import (Block, block_footprints, free_per_domain, layout_blocks, part_units,
                                   stage_footprints, split_atoms)
from solvers.layout.budget import Stopped, WorkBudget
from solvers.layout.candidates import (Candidate, ExactScores, assign_gpus, estimate_from_metrics, first_fit,
                                       offer_exact, public_estimate, rank_key, summarise)
from solvers.layout.pricing import Footprints, FootprintSearch
from solvers.layout.replicas import MAX_SOURCE_ROUNDS, place_sources
from solvers.layout.rules import atoms_in_ep_order, equal_slice_breaks, equal_slice_footprints, infeasible_reason
from solvers.layout.scorer import BlockScorer
from solvers.layout.shapes import shape_candidates, shape_of

__all__ = ["LayoutPlan", "LayoutPlanner", "plan_layout", "LAYOUT_TIME_SHARE", "LAYOUT_WORK_SHARE"]

log = logging.getLogger(__name__)

#: Share of the remaining wall time that ``solvers.cpsat`` gives the rank layout as its safety
#: net, and of the solver's work budget (``SolveOptions.time_limit_s``) that it leaves to the
#: expert placer (``1 - LAYOUT_TIME_SHARE``).
LAYOUT_TIME_SHARE = 0.5
#: Share of the solver's work budget that the rank layout may spend (predicted seconds): a fifth
#: of its wall share, so that a machine running steps 2-3x slower than predicted (a 2-core machine
#: at load 4) still ends the work before the safety net fires (docs/layout.md has the measurements).
LAYOUT_WORK_SHARE = 0.1
#: Upper bound on candidate shapes per block; beyond it the number of parts is capped.
MAX_SHAPES_PER_BLOCK = 2500
#: Share of the layout's work budget kept for the replicas <-> experts alternation.
FINISH_SHARE = 0.2
#: Predicted seconds of one run of :func:`placement.predict.cost.evaluate` per routed expert id of the
#: sampled window (the API's own scoring estimate, ``placement.api.SCORING_S_PER_EXPERT_ID``).
EVAL_S_PER_EXPERT_ID = 1e-7
#: Under ``step_time``: evaluator runs kept in the budget for ranking the candidates by predicted
#: step time (every candidate of both byte objectives, the peers and the default with contiguous experts).
STEP_TIME_RANK_EVALS = 6
#: Under ``step_time``: share of the layout's work left after the peers that the ``total`` footprint
#: search may spend; the ``bottleneck`` search gets the rest (what ``total`` left unspent included).
STEP_TIME_TOTAL_SHARE = 0.5
METHOD = ("footprints by a MILP over lazily priced shapes, experts placed per shape (joint at domain "
          "granularity); replicas <-> experts alternation on straddling blocks; default, packed, "
          "first-fit and (group-preserving) whole-group first-fit layouts as candidates")


@dataclass(frozen=True)
class LayoutPlan:
    """What :func:`plan_layout` returns.

    rank2gpu : (world,) int64, physical GPU of each global rank.
    details : JSON-serialisable, deterministic facts (no wall-clock values): per-stage footprints
        over domains, the estimated total cross-domain bytes per step and slowest-stage all-to-all
        time of every candidate (``candidates``, named as estimates) and of the chosen one, the
        stage-time cap, the evaluator's check, solver status, the work budget and what it paid for.
    phy2log : (num_moe_layers, num_experts) int64 expert map the layout was scored with (domain
        level: which experts sit in which domain; inside a domain the order is by expert id).  A
        valid placement together with ``rank2gpu``; the expert placer refines it.
    wall_clock_cut : the deadline or a stop request ended a step, so the result may depend on the
        machine's speed (a wall-clock fact: logged, never written into ``details``).
    """

    rank2gpu: np.ndarray
    details: dict
    phy2log: np.ndarray | None = None
    wall_clock_cut: bool = False


def balance_within_classes(instance: Instance, rank2gpu: np.ndarray, phy2log: np.ndarray, *,
                           group_size: int | None = None) -> np.ndarray:
    """The expert map with each layer's experts re-dealt inside every class, loads balanced.

    A class here is a set of physical slots whose EP rank has the same node (the dispatcher's,
    :mod:`placement.core.dispatch`; the NVLink domain under an equal-slice layout) in every EP
    group of the stage (and, with ``group_size``, the same group position): moving experts among
    them changes no token's domain, so the cross-domain bytes stay, and group positions keep their
    expert groups.  Inside each class, heaviest expert first (load: its (token, expert) pairs in the
    sampled window) goes to the EP rank with the least load that has a free slot; the layout's
    estimate orders experts by id inside a domain, while the expert placer balances GPU load, so
    this is the map a step-time ranking should see.

    Parameters
    ----------
    rank2gpu : (world,) int64.
    phy2log : (num_moe_layers, E) int64.
    group_size : E/G when the map must keep expert groups on group positions, else None.

    Returns
    -------
    (num_moe_layers, E) int64, a valid expert map.
    """
    m, par = instance.model, instance.parallel
    E, epr = m.num_experts, instance.experts_per_rank
    r2g = np.asarray(rank2gpu, dtype=np.int64)
    # the dispatcher's node of every EP rank (its domain under an equal-slice layout)
    stage_node = node_labels(instance.cluster.gpu2domain[r2g[par.stage_ep_groups]], node_rule(instance))[0]
    out = np.asarray(phy2log, dtype=np.int64).copy()
    stage_of = {int(layer): s for s, layers in enumerate(par.stage_layers) for layer in layers}
    slot_rank = np.arange(E) // epr
    for li, layer in enumerate(m.moe_layers):
        _, rank2class = domain_classes(stage_node[stage_of[int(layer)]])  # (ep,) class of every EP rank
        load = np.bincount(instance.routing.topk[li].ravel(), minlength=E).astype(np.float64)
        slot_class = rank2class[slot_rank] * (E // group_size if group_size else 1)
        if group_size:
            slot_class = slot_class + np.arange(E) // group_size  # and the slot's group position
        row = out[li]
        new = row.copy()
        for c in np.unique(slot_class):
            slots = np.flatnonzero(slot_class == c)
            experts = np.sort(row[slots])
            ranks, per_rank = np.unique(slot_rank[slots], return_counts=True)
            # Heaviest expert first (ties: lower id) onto the least-loaded EP rank with a free slot,
            # which then fills its slots in increasing order.
            rank_of, _ = lpt_pack(load[experts], per_rank)
            next_slot = {int(r): list(slots[slot_rank[slots] == r]) for r in ranks}
            for i in np.argsort(-load[experts], kind="stable"):
                new[next_slot[int(ranks[rank_of[i]])].pop(0)] = experts[i]
        out[li] = new
    return out


class LayoutPlanner:
    """One run of the rank layout (see :func:`plan_layout` for the parameters).

    State that outlives a step (candidates, exact block scores, the cap, the budget) lives here.
    """

    def __init__(self, instance: Instance, options: SolveOptions, *, deadline: float, work_s: float | None):
        from solvers.default import default_rank2gpu

        self.instance, self.options = instance, options
        m = instance.model
        self.default_r2g = default_rank2gpu(instance)  # raises InfeasibleError on too few GPUs
        self.consumer = options.consumer
        # ``rank_objective`` orders the candidates in :meth:`choose`; ``objective`` is the byte
        # objective of the footprint search running now (under ``step_time`` both passes run).
        self.rank_objective: str = options.objective
        self.step_model = None
        self.setting_models: dict = {}
        self.step_fallback: str | None = None
        if self.rank_objective == "step_time":
            from placement.predict.performance import StepTimeModel

            try:
                self.step_model = StepTimeModel(instance)
                from placement.predict.report import setting_step_models

                self.setting_models = setting_step_models(instance)
            except ValueError:
                self.rank_objective = "total"
                self.step_fallback = ("the instance has no performance block, so no step time can be predicted: "
                                      "step_time falls back to total")
        self.objective: Objective = "total" if options.objective == "step_time" else options.objective
        if self.step_fallback is not None:
            self.objective = "total"
        self.pass_prefix = ""
        self.equal_only = self.consumer in ("deepep", "hybridep")
        self.gp = options.fit_groups_whole(instance)
        self.blocks = layout_blocks(instance)
        self.free = free_per_domain(instance)
        self.scorer = BlockScorer(instance, group_preserving=self.gp)
        self.identity = np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))
        self.eval_s = EVAL_S_PER_EXPERT_ID * float(np.prod(instance.routing.topk.shape))
        work = LAYOUT_WORK_SHARE * options.time_limit_s if work_s is None else work_s
        # the evaluator's check (the default's and the pick's; under step_time every candidate's)
        # runs after the steps: keep its time
        self.finish_evals = STEP_TIME_RANK_EVALS if self.step_model is not None else 2
        self.budget = WorkBudget(work, deadline, options, finish_s=self.finish_evals * self.eval_s)
        self.budget.add_scorers([self.scorer])
        self.cands: list[Candidate] = []
        self.exact: ExactScores = {}
        self.offers: list[tuple[Sequence[dict[int, int]], Sequence[np.ndarray], dict]] = []
        self.cap_s: float | None = None
        self.est_default: dict | None = None
        self.infeasible_units = 0
        self._equal_fit: Footprints | None = None
        self._equal_fit_done = False
        self._moe_fit: Footprints | None = None
        self._moe_fit_done = False
        self.default_ok = self.rule_ok(self.default_r2g)
        self.details: dict = {
            "method": METHOD,
            "objective": options.objective,
            "consumer": self.consumer,
            "group_preserving": bool(self.gp),
            "blocks": len(self.blocks),
            "free_gpus_per_domain": [int(x) for x in self.free],
            "work_budget_s": round(self.budget.work_s, 6),
        }
        if self.equal_only and not self.default_ok and all(atoms_in_ep_order(b) for b in self.blocks):
            # The default layout breaks the rule: the rule's own fewest-parts layout (contiguous
            # slices, deterministic) stands in for it as the baseline every search result must beat
            # and the answer when the clock stops the search before anything is scored.
            feet = self.equal_fit()
            if feet is not None:
                a2ps = [self.scorer.slices(blk, shape_of(f)) for blk, f in zip(self.blocks, feet)]
                self.default_r2g = assign_gpus(instance, self.blocks, feet, a2ps)[0]
                self.default_ok = self.rule_ok(self.default_r2g)
                self.details["baseline"] = "equal-slice fit (the default layout breaks the rule)"
        if self.equal_only and not all(atoms_in_ep_order(b) for b in self.blocks):
            raise InfeasibleError(
                f"consumer {self.consumer!r}: with parallel.order {instance.parallel.order!r} the TP x CP groups of an "
                "EP group are not consecutive EP ranks, so no layout gives equal consecutive slices per NVLink domain"
            )

    def rule_ok(self, r2g: np.ndarray) -> bool:
        """The consumer's equal-slice rule holds for ``r2g`` (always, without a consumer rule)."""
        return not self.equal_only or not equal_slice_breaks(self.instance, r2g)

    # ---- candidates ----------------------------------------------------------------------
    def add(self, name: str, r2g: np.ndarray, feet: Sequence[dict[int, int]], a2ps: Sequence[np.ndarray]) -> dict:
        """Score a complete layout, keep it as a candidate, and its blocks' scores as exact entries."""
        est = summarise(self.instance, self.blocks, a2ps, self.scorer, stop=self.budget.stopped)
        self.cands.append(Candidate(name, np.asarray(r2g, dtype=np.int64), est))
        if name == "default" and self.objective == "total":
            self.cap_s = est["slowest_stage_s"]
        self.offers.append((feet, a2ps, est))
        self.offer(feet, a2ps, est)
        return est

    def offer(self, feet: Sequence[dict[int, int]], a2ps: Sequence[np.ndarray], est: dict) -> None:
        """Keep a scored layout's straddling blocks as exact entries (by the current pass's objective)."""
        for b, (foot, a2p) in enumerate(zip(feet, a2ps)):
            if len(foot) > 1:
                offer_exact(self.exact, (b, shape_of(foot)), est["block_scores"][b], a2p, self.cap_s, self.objective)

    def score_peers(self) -> list[Footprints]:
        """The peers' layouts, scored first (whatever the budget): candidates, hints, and (default)
        the cap; packed first, the stronger fallback when the clock cuts in between.  Returns the
        hints."""
        from solvers.packed import packed_rank2gpu

        hints: list[Footprints] = []
        packed_r2g = packed_rank2gpu(self.instance)
        try:
            packed_feet, packed_a2p = block_footprints(self.instance, self.blocks, packed_r2g)
        except SolverError:  # a TP x CP group across domains: not a layout this package can score
            packed_feet = []
        if packed_feet and self.rule_ok(packed_r2g):
            self.add("packed", packed_r2g, packed_feet, packed_a2p)
            hints.append(packed_feet)
        default_feet, default_a2p = block_footprints(self.instance, self.blocks, self.default_r2g)
        if self.default_ok:
            self.est_default = self.add("default", self.default_r2g, default_feet, default_a2p)
            hints.insert(0, default_feet)
        aligned = self.add_group_aligned([packed_feet, default_feet])
        if aligned is not None:
            hints.append(aligned)
        return hints

    def group_unit(self) -> int | None:
        """GPUs of one group position (the EP ranks that host one expert group, times the TP x CP
        atom) when expert maps are group-preserving and every block is a whole number of them, else
        None."""
        if not self.gp or self.equal_only or not self.blocks:
            return None
        m, epr = self.instance.model, self.instance.experts_per_rank
        if m.experts_per_group % epr:
            return None
        unit = self.blocks[0].atom_size * (m.experts_per_group // epr)
        if unit <= 1 or any(b.size % unit or b.ep_groups.shape[0] != 1 for b in self.blocks):
            return None
        return unit

    def add_group_aligned(self, seen: Sequence[Footprints]) -> Footprints | None:
        """Group-preserving maps only: the first-fit layout in parts of whole group positions, a
        candidate scored with the peers.  Each domain then holds whole expert groups, so no group
        position straddles two domains (a straddling position costs crossings and leaves the group
        assignment bound loose); the ranking decides whether the bytes or the step time it gains
        beat the tighter packings.  Returns its footprints (a hint), or None."""
        unit = self.group_unit()
        if unit is None:
            return None
        feet = first_fit(self.blocks, self.free, unit)
        if feet is None or any(list(feet) == list(f) for f in seen if f):
            return None
        self.add_footprints("first_fit, whole expert groups", feet)
        return feet

    def add_footprints(self, name: str, feet: Footprints) -> None:
        """Score the layout of ``feet`` (each block's GPUs per domain) as the candidate ``name``."""
        a2ps = [self.scorer.slices(blk, shape_of(f)) for blk, f in zip(self.blocks, feet)]
        self.add(name, assign_gpus(self.instance, self.blocks, feet, a2ps)[0], feet, a2ps)

    def unit_shapes(self, unit: int) -> list[list[tuple[int, ...]]]:
        """Per block, the candidate shapes in parts of ``unit`` GPUs (or of its atoms)."""
        max_free = int(self.free.max()) if self.free.size else 0
        shapes: list[list[tuple[int, ...]]] = []
        for blk in self.blocks:
            unit_b = unit if blk.size % unit == 0 else blk.atom_size
            mp = int(np.count_nonzero(self.free >= unit_b))
            while True:
                cand = shape_candidates(blk.size, unit_b, min(max_free, blk.size), mp, equal_only=self.equal_only,
                                        limit=MAX_SHAPES_PER_BLOCK)
                if self.equal_only or len(cand) <= MAX_SHAPES_PER_BLOCK or mp <= 2:
                    break
                mp -= 1
            if self.equal_only:
                cand = [c for c in cand if all(v % blk.atom_size == 0 for v in c)]
            shapes.append(cand)
        return shapes

    def equal_fit(self) -> Footprints | None:
        """Under an equal-slice consumer, one layout that meets the rule (fewest parts;
        :func:`solvers.layout.rules.equal_slice_footprints`, deterministic), computed once."""
        if not self._equal_fit_done:
            self._equal_fit = equal_slice_footprints(self.instance)
            self._equal_fit_done = True
        return self._equal_fit

    def add_first_fit(self, unit: int, reserve_s: float) -> Footprints | None:
        """The first-fit layout in parts of ``unit`` GPUs: a hint, and a candidate when affordable.

        Without a consumer rule on a HybridEP/DeepEP instance it is the layout whose MoE stages all
        hold equal slices (``equal_fit``: :func:`solvers.layout.rules.equal_slice_footprints` with
        ``moe_only``, the last stage, which also holds the loss, kept in as few parts as possible)
        when one exists: the estimator counts whole domains, so it cannot see the small nodes an
        unequal split runs."""
        name, first = "first_fit", None
        if not self.equal_only and node_rule(self.instance) in ("hybridep", "deepep"):
            if not self._moe_fit_done:
                feet = equal_slice_footprints(self.instance, moe_only=True,
                                              avoid_block=self.blocks[-1].index if self.blocks else None)
                ok = feet is not None and all(sum(f.values()) == b.size for f, b in zip(feet, self.blocks))
                self._moe_fit, self._moe_fit_done = (feet if ok else None), True
            if self._moe_fit is not None:
                name, first = "equal_fit", self._moe_fit
        if first is None:
            first = first_fit(self.blocks, self.free, unit) if not self.equal_only else self.equal_fit()
        if first is not None and not any(c.name == name for c in self.cands):
            predicted = sum(self.scorer.predict_s(blk, len(f)) for blk, f in zip(self.blocks, first))
            if self.budget.affords(predicted + reserve_s):
                self.add_footprints(name, first)
        return first

    def search_footprints(self, hints: list[Footprints]) -> list[Footprints] | None:
        """The footprint search at the coarsest part unit that has a solution."""
        finish_s = self.finish_evals * self.eval_s
        reserve_s = finish_s + FINISH_SHARE * self.budget.work_s
        for unit in part_units(self.instance, self.blocks):
            shapes = self.unit_shapes(unit)
            unit_hints = list(hints)
            first = self.add_first_fit(unit, reserve_s)
            if first is not None:
                unit_hints.insert(0, first)
            for feet in unit_hints:
                for b, foot in enumerate(feet):
                    if shape_of(foot) not in shapes[b]:
                        shapes[b].append(shape_of(foot))
            if any(not s for s in shapes):
                self.infeasible_units += 1
                continue
            search_options = dataclasses.replace(self.options, objective=self.objective)
            search = FootprintSearch(self.blocks, shapes, self.free, self.scorer, search_options, unit_hints,
                                     self.budget, exact=self.exact, cap_s=self.cap_s, reserve_s=reserve_s,
                                     finish_s=finish_s)
            found, status = search.run()
            self.details.update(search.details())
            self.details["footprint_status"] = status
            if found is not None:
                self.details["part_unit_gpus"] = unit
                return found
            if status != "INFEASIBLE":
                return None
            self.infeasible_units += 1
        return None

    def score_picks(self, plan: list[Footprints]) -> tuple[Footprints, list[np.ndarray]]:
        """Score the search's footprints as candidates; the better one's (footprints, atom parts)."""
        picks = []
        for name, feet in zip((self.pass_prefix + "optimized", self.pass_prefix + "optimized, best scored pick"), plan):
            a2ps = []
            for b, (blk, foot) in enumerate(zip(self.blocks, feet)):
                sh = shape_of(foot)
                a2ps.append(self.exact[b, sh][1] if (b, sh) in self.exact else self.scorer.slices(blk, sh))
            self.add(name, assign_gpus(self.instance, self.blocks, feet, a2ps)[0], feet, a2ps)
            picks.append((self.cands[-1], feet, a2ps))
        _, feet, a2ps = min(picks, key=lambda p: rank_key(p[0].estimate, self.objective))
        return feet, a2ps

    def move_replicas(self, feet: Footprints, a2ps: list[np.ndarray]) -> None:
        """The replicas <-> experts alternation on the straddling blocks; a candidate if any moved."""
        blocks, scorer, budget = self.blocks, self.scorer, self.budget
        straddling = [b for b in range(len(blocks)) if len(feet[b]) > 1]
        src_info: dict[str, dict] = {}
        if not self.equal_only and straddling:
            fit = BlockScorer(self.instance, group_preserving=self.gp, tokens="fit")
            val = BlockScorer(self.instance, group_preserving=self.gp, tokens="val")
            budget.add_scorers([fit, val])
            moved = list(a2ps)
            try:
                for b in straddling:
                    P = len(feet[b])
                    # up to MAX_SOURCE_ROUNDS + 1 scorings on the fit tokens, two on the
                    # validation ones, one on all of them
                    predicted = ((MAX_SOURCE_ROUNDS + 1) * fit.predict_s(blocks[b], P)
                                 + 2 * val.predict_s(blocks[b], P) + scorer.predict_s(blocks[b], P))
                    if not budget.affords(predicted + 2.0 * self.eval_s):
                        src_info[str(b)] = {"skipped": "work budget"}
                        continue
                    moved[b], info = place_sources(fit, val, blocks[b], a2ps[b], stop=budget.stopped)
                    src_info[str(b)] = info
            except Stopped:
                pass
            if any(not np.array_equal(x, y) for x, y in zip(moved, a2ps)):
                self.add(self.pass_prefix + "optimized, replicas moved", assign_gpus(self.instance, blocks, feet, moved)[0], feet, moved)
        self.details["source_placement"] = src_info

    # ---- the choice ----------------------------------------------------------------------
    def within(self, c: Candidate) -> bool:
        return self.cap_s is None or c.estimate["slowest_stage_s"] <= self.cap_s * (1 + 1e-9) + 1e-12

    def evaluator_check(self, order: list[Candidate]) -> Candidate:
        """The evaluator has the last word on time: the layout with its expert map must not make
        the slowest stage slower than the default layout as the ``default`` solver gives it
        (contiguous experts); candidates are checked in order, the default with contiguous experts
        passes."""
        instance, budget, identity = self.instance, self.budget, self.identity
        budget.charge(self.eval_s)
        default_metrics = evaluate(instance, Placement(self.default_r2g, identity))
        default_s = default_metrics.alltoall_time_s_per_step
        checked: list[dict] = []
        chosen: Candidate | None = None
        for c in order[: 1 if budget.cut else 3]:  # cut by the clock: one try, then the default
            if c.name == "default" and np.array_equal(c.estimate["phy2log"], identity):
                chosen = c
                break
            budget.charge(self.eval_s)
            t = evaluate(instance, Placement(c.rank2gpu, c.estimate["phy2log"])).alltoall_time_s_per_step
            checked.append({"candidate": c.name, "alltoall_time_s_per_step": t})
            if t <= default_s * (1 + 1e-9) + 1e-12:
                chosen = c
                break
        if chosen is None:
            chosen = Candidate("default, contiguous experts", self.default_r2g,
                               estimate_from_metrics(default_metrics, identity))
        self.details["evaluator_check"] = {"default_alltoall_time_s_per_step": default_s, "checked": checked}
        return chosen

    def choose_step_time(self) -> Candidate:
        """Under ``step_time``: every candidate (and the default layout with contiguous experts)
        scored by the evaluator on its expert map at every setting of the step-time model, the
        max-min-regret one chosen (:func:`placement.predict.report.max_min_regret`; ties by predicted step
        time at the instance's own setting, then the evaluator's bytes, then the later, more
        refined candidate); the default with contiguous
        experts is one of them, so the pick's worst ratio over the settings is never below its.  When the clock
        cut the work, only the best candidate by the estimate's slowest stage and the peers' layouts
        (default and packed, scored first whatever the budget) are evaluated."""
        instance, budget, identity, model = self.instance, self.budget, self.identity, self.step_model
        assert model is not None
        cands = self.cands
        order = sorted(cands, key=lambda c: rank_key(c.estimate, "bottleneck") + (-cands.index(c),))
        if budget.cut:  # the best by the estimate, and the peers' layouts scored first (their maps balanced)
            order = order[:1] + [c for c in order[1:] if c.name in ("default", "packed")]
        pool: list[tuple[Candidate, dict]] = []
        if self.default_ok:
            order.append(Candidate("default, contiguous experts", self.default_r2g, {"phy2log": identity}))
        seen: dict[tuple[bytes, bytes], dict] = {}
        gs = self.instance.model.experts_per_group if self.gp else None
        for i, c in enumerate(order):
            if c.name != "default, contiguous experts":  # the map the expert placer would refine
                est = dict(c.estimate, phy2log=balance_within_classes(instance, c.rank2gpu, c.estimate["phy2log"],
                                                                      group_size=gs))
                c = order[i] = Candidate(c.name, c.rank2gpu, est)
            key = (c.rank2gpu.tobytes(), np.asarray(c.estimate["phy2log"]).tobytes())
            if key not in seen:
                budget.charge(self.eval_s)
                metrics = evaluate(instance, Placement(c.rank2gpu, c.estimate["phy2log"]))
                seen[key] = {"predicted_step_time_s": model.step_time_s(metrics, c.rank2gpu),
                             "by_setting": {s: float(sm.step_time_s(metrics, c.rank2gpu))
                                            for s, sm in self.setting_models.items()},
                             "total_bytes": float(metrics.cross_domain_bytes_per_step),
                             "metrics": metrics}
            pool.append((c, seen[key]))
        if not pool:
            raise SolverError("rank layout: no footprint found for the free GPUs within the time limit")
        rank = {c.name: i for i, c in enumerate(cands)}

        def key_of(item: tuple[Candidate, dict]) -> tuple[float, float, int]:
            c, ev = item
            return (ev["predicted_step_time_s"], ev["total_bytes"], -rank.get(c.name, -1))

        # The max-min-regret choice over the model's settings (placement.predict.report.max_min_regret), ties
        # to the faster at the instance's own setting, then fewer bytes, then the later candidate.
        from placement.predict.report import max_min_regret

        ranked = sorted(pool, key=key_of)
        choice = max_min_regret([e["by_setting"] for _, e in ranked])
        best, ev = ranked[choice.index]
        if best.name == "default, contiguous experts":
            best = Candidate(best.name, best.rank2gpu, estimate_from_metrics(ev["metrics"], identity))
        cand_info = {c.name: {"estimated_total_bytes": c.estimate["total_bytes"],
                              "estimated_slowest_stage_s": c.estimate["slowest_stage_s"]} for c in cands}
        for c, e in pool:
            cand_info.setdefault(c.name, {}).update({"predicted_step_time_s": e["predicted_step_time_s"],
                                                     "total_bytes": e["total_bytes"]})
        self.details["candidates"] = cand_info
        self.details["stage_time_cap_s"] = None
        default_s = next((e["predicted_step_time_s"] for c, e in pool if c.name == "default, contiguous experts"), None)
        self.details["evaluator_check"] = {
            "default_predicted_step_time_s": default_s,
            "chosen_predicted_step_time_s": ev["predicted_step_time_s"],
            "candidates_evaluated": len(seen),
            "choice_by_setting": {s: ranked[i][0].name for s, i in choice.best_by_setting.items()},
            "choice_differs": choice.differs,
        }
        return best

    def choose(self) -> Candidate:
        """Among the candidates within the cap, the best on the objective (on a tie the later, more
        refined one), then the evaluator's check."""
        cands = self.cands
        if self.step_model is not None and (cands or self.default_ok):
            return self.choose_step_time()
        self.details["candidates"] = {c.name: {"estimated_total_bytes": c.estimate["total_bytes"],
                                               "estimated_slowest_stage_s": c.estimate["slowest_stage_s"],
                                               "within_cap": self.within(c)} for c in cands}
        self.details["stage_time_cap_s"] = self.cap_s
        order = sorted((c for c in cands if self.within(c)),
                       key=lambda c: rank_key(c.estimate, self.objective) + (-cands.index(c),))
        if self.default_ok and not order:  # stopped before anything was scored
            return Candidate("default, contiguous experts", self.default_r2g, {})
        if self.default_ok:
            return self.evaluator_check(order)
        if order:
            return order[0]
        raise SolverError("rank layout: no footprint found for the free GPUs within the time limit")

    def finish(self, chosen: Candidate, t_start: float) -> LayoutPlan:
        """The plan of ``chosen``, with the deterministic facts in ``details`` (the wall clock's
        only in the log)."""
        instance, budget, details = self.instance, self.budget, self.details
        rank2gpu, est = chosen.rank2gpu.copy(), chosen.estimate
        phy2log = est.get("phy2log", self.identity)
        if self.equal_only:
            bad = equal_slice_breaks(instance, rank2gpu)
            if bad:  # the shapes and slices make this impossible: a bug, not a user error
                raise SolverError(f"rank layout broke the {self.consumer} rule: {bad[0]}")
        if self.est_default is not None:
            details["default_estimate"] = public_estimate(self.est_default)
        details["chosen"] = chosen.name
        details["estimate"] = public_estimate(est) if est else None
        details["estimated_total_bytes"] = est.get("total_bytes")
        details["estimated_slowest_stage_s"] = est.get("slowest_stage_s")
        details["stage_footprints"] = stage_footprints(instance, rank2gpu)
        details["tp_cp_groups_split_across_trays"] = split_atoms(instance, self.blocks, rank2gpu)
        details["work_spent_s"] = round(budget.spent_s(), 6)
        details["work_budget_exhausted"] = bool(budget.exhausted)
        if budget.cut:
            log.warning("rank layout: the wall clock or a stop request cut the work short; the layout may "
                        "depend on the machine's speed")
        log.info("rank layout: %s chosen in %.2f s wall (%.2f of %.2f predicted seconds of work%s)", chosen.name,
                 time.monotonic() - t_start, budget.spent_s(), budget.work_s, ", cut by the clock" if budget.cut else "")
        return LayoutPlan(rank2gpu=rank2gpu, details=details, phy2log=phy2log, wall_clock_cut=bool(budget.cut))

    def search_pass(self, hints: list[Footprints]) -> None:
        """The footprint search on :attr:`objective`, its picks scored, replicas moved."""
        plan = self.search_footprints(hints)
        if plan is not None:
            self.move_replicas(*self.score_picks(plan))

    def search_both(self, hints: list[Footprints]) -> None:
        """Under ``step_time``: the ``total`` search (with its cap) on :data:`STEP_TIME_TOTAL_SHARE`
        of the work left, then the ``bottleneck`` search (no cap, the exact entries re-offered by
        its objective) on the rest; each pass's facts under ``details["search_<objective>"]``."""
        budget, full_s = self.budget, self.budget.work_s
        saved = self.details
        try:
            passes: tuple[Objective, ...] = ("total", "bottleneck")
            for objective in passes:
                self.objective, self.pass_prefix, self.details = objective, objective + ": ", {}
                if objective == "total":
                    budget.work_s = budget.spent_s() + STEP_TIME_TOTAL_SHARE * max(0.0, full_s - budget.spent_s())
                else:
                    budget.work_s = full_s
                    self.cap_s, self.exact = None, {}
                    for feet, a2ps, est in self.offers:
                        self.offer(feet, a2ps, est)
                try:
                    self.search_pass(hints)
                finally:
                    saved[f"search_{objective}"] = self.details
        finally:
            budget.work_s, self.details, self.pass_prefix = full_s, saved, ""

    def run(self) -> LayoutPlan:
        t_start = time.monotonic()
        try:
            hints = self.score_peers()
            if self.step_model is not None:
                self.search_both(hints)
            else:
                self.search_pass(hints)
        except Stopped:
            pass
        if self.step_fallback is not None:
            self.details["step_time_fallback"] = self.step_fallback
        self.details["ranked_by"] = self.rank_objective
        if not self.cands and not self.default_ok:
            if self.equal_only and self.infeasible_units and not self.budget.cut:
                inst = self.instance
                raise InfeasibleError(infeasible_reason(self.consumer, self.blocks, self.free,
                                                        inst.parallel.world_size, inst.cluster.num_domains))
            raise SolverError("rank layout: no footprint found for the free GPUs within the time limit")
        return self.finish(self.choose(), t_start)


def plan_layout(
    instance: Instance,
    options: SolveOptions,
    *,
    deadline: float,
    work_s: float | None = None,
) -> LayoutPlan:
    """Map the job's ranks onto the available GPUs (see the package docstring for the method).

    Parameters
    ----------
    instance : the problem (solver view).
    options : ``consumer`` (``deepep``/``hybridep``: equal consecutive slices per domain),
        ``objective`` (``step_time``: both byte searches, candidates ranked by predicted step
        time; ``total`` or ``bottleneck``), ``time_limit_s`` (the work budget, see
        ``work_s``), and ``group_preserving`` (whether the expert maps scored must keep expert
        groups whole); ``stop_event`` is polled.
    deadline : ``time.monotonic()`` instant by which to return (the safety net).
    work_s : the deterministic work budget in predicted seconds (default
        ``LAYOUT_WORK_SHARE * options.time_limit_s``): what the layout does depends on it, never on
        the clock, unless the deadline or a stop request cuts a step (:attr:`LayoutPlan.wall_clock_cut`, logged).

    Returns
    -------
    LayoutPlan

    Raises
    ------
    InfeasibleError
        Fewer available GPUs than ranks, or a consumer rule that no layout of the free GPUs meets.
    """
    return LayoutPlanner(instance, options, deadline=deadline, work_s=work_s).run()
