"""Lazy pricing of shapes around the footprint MILP (column-generation style).

A shape's price is per MoE layer: the mean over up to :data:`PROXY_LAYERS` layers spread over the
model (each scored on the block of its own stage) of the bytes and of the busiest NIC's time; a
block's price is that times its MoE layers (the time per layer is raised to the block's NVLink
floor).  Two-part shapes are priced up front; any other shape enters with an estimate built from
them (what lands in each part when the rest of the block is one domain, summed over its parts),
never below two lower bounds (merging two parts never costs more; and the cost is at least half
the sum of its parts' two-part prices), and, for time, the worst part's busiest NIC when the rest
is one domain (at least the NVLink floor).  After each MILP solve, every straddling (block, shape)
of the pick is scored *exactly* (all of the block's own MoE layers) and that exact score replaces
the price in the next solve; the loop ends when the pick is exact everywhere (then it is optimal
for the prices) or the work budget ends.  Shapes priced above the incumbent are left out.

``cap_s`` (the ``total`` objective): shapes whose time for the block (exact, priced or estimated)
exceeds it are left out of the model, so no stage of a pick is slower than the default layout's
slowest stage (whose own exact entries are within it by construction).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from solvers.base import SolveOptions
from solvers.layout.blocks import Block
from solvers.layout.budget import Stopped, WorkBudget, milp_predict_s
from solvers.layout.candidates import ExactScores, offer_exact
from solvers.layout.milp import BYTES_PER_UNIT, MILP_NODE_LIMIT, SECONDS_PER_UNIT, FootprintModel
from solvers.layout.scorer import BlockScorer
from solvers.layout.shapes import merge_bound, shape_of

__all__ = ["ShapePrices", "PriceTables", "FootprintSearch", "PROXY_LAYERS", "Footprints"]

log = logging.getLogger(__name__)

#: MoE layers (spread over the model) on which a shape's price per layer is measured.
PROXY_LAYERS = 4

#: Per block, ``{domain: GPUs}``.
Footprints = list[dict[int, int]]
Shape = tuple[int, ...]


def _two_part(p: int, size: int) -> Shape:
    return tuple(sorted((p, size - p), reverse=True))


class ShapePrices:
    """Per-layer prices of shapes for blocks of each size, measured on a few sample layers.

    Parameters
    ----------
    blocks : the blocks.
    scorer : scores the samples.
    budget : pays for them.
    reserve_s : predicted seconds a price must leave in the budget.
    """

    def __init__(self, blocks: Sequence[Block], scorer: BlockScorer, budget: WorkBudget, reserve_s: float):
        self.blocks, self.scorer, self.budget, self.reserve_s = blocks, scorer, budget, reserve_s
        self.per_layer: dict[tuple[int, Shape], tuple[float, float]] = {}  # (size, shape) -> (bytes, nic s)
        self.arrivals: dict[tuple[int, Shape], tuple[float, ...]] = {}  # -> bytes into each part
        self.part_nic: dict[tuple[int, Shape], tuple[float, ...]] = {}  # -> busiest NIC s per part
        self.samples: dict[int, list[tuple[int, int]]] = {}
        for size in sorted({b.size for b in blocks}):
            pool = [(b.index, int(l)) for b in blocks if b.size == size for l in b.moe_layers]
            pick = np.unique(np.linspace(0, len(pool) - 1, min(PROXY_LAYERS, len(pool))).round().astype(int))
            self.samples[size] = [pool[int(i)] for i in pick] if pool else []

    def price(self, size: int, sh: Shape) -> bool:
        """Price ``sh`` for blocks of ``size``; False when the budget cannot afford it."""
        if (size, sh) in self.per_layer:
            return True
        samples = self.samples[size]
        if len(sh) == 1 or not samples:
            self.per_layer[size, sh] = (0.0, 0.0)
            self.arrivals[size, sh] = (0.0,) * len(sh)
            self.part_nic[size, sh] = (0.0,) * len(sh)
            return True
        scorer, blocks = self.scorer, self.blocks
        if not self.budget.affords(sum(scorer.predict_s(blocks[b], len(sh), 1) for b, _ in samples) + self.reserve_s):
            return False
        tot, nic, arr, pn = 0.0, 0.0, np.zeros(len(sh)), np.zeros(len(sh))
        for b, layer in samples:
            sc = scorer.score(blocks[b], scorer.slices(blocks[b], sh), layers=[layer], stop=self.budget.stopped)[0]
            tot += sc.total_bytes
            nic += sc.layer_nic_s[0]
            arr += np.asarray(sc.part_bytes)
            pn += np.asarray(sc.part_nic_s)
        n = len(samples)
        self.per_layer[size, sh] = (tot / n, nic / n)
        self.arrivals[size, sh] = tuple(float(x) for x in arr / n)
        self.part_nic[size, sh] = tuple(float(x) for x in pn / n)
        return True

    def estimate_bytes(self, size: int, sh: Shape) -> float | None:
        """Bytes per layer of an unpriced shape: the sum over its parts of what lands in a part of
        that size when the rest of the block is one domain (from the two-part prices); exact for
        two parts, and for more parts it misses only what the parts' maps cost each other."""
        out = 0.0
        for p in sh:
            two = _two_part(p, size)
            if (size, two) not in self.arrivals:
                return None
            out += self.arrivals[size, two][two.index(p)]
        return out

    def estimate_nic_s(self, size: int, sh: Shape) -> float | None:
        """Busiest NIC seconds per layer of an unpriced shape: the worst over its parts of that
        part's busiest NIC when the rest of the block is one domain (from the two-part prices)."""
        out = 0.0
        for p in sh:
            two = _two_part(p, size)
            if (size, two) not in self.part_nic:
                return None
            out = max(out, self.part_nic[size, two][two.index(p)])
        return out

    def lower_bound(self, size: int, sh: Shape, memo: dict[Shape, float]) -> float:
        """Bytes per layer no expert map on ``sh`` beats (up to the heuristic prices).

        Two bounds: merging two parts never costs more (any map on ``sh`` is one on the merge);
        and with ``T_j`` the tokens from outside part ``j`` that touch ``j`` and ``U_j`` the tokens
        from ``j`` that leave it, the cost is ``sum_j T_j >= sum_j U_j``, while the two-part shape
        ``(p_j, n - p_j)`` costs at most ``T_j + U_j`` under the same map, so the cost is at least
        half the sum of the two-part prices of its parts.
        """
        known = {k: v[0] for (z, k), v in self.per_layer.items() if z == size}
        merge = merge_bound(sh, known, memo)
        halves = [self.per_layer.get((size, _two_part(p, size))) for p in sh]
        split = 0.0
        if all(h is not None for h in halves):
            split = 0.5 * sum(h[0] for h in halves if h is not None)
        return max(merge, split)


class PriceTables:
    """The model's prices now (per block, per candidate shape: bytes and seconds), and what follows
    from them for complete footprints."""

    def __init__(self, search: FootprintSearch):
        self.shapes = search.shapes
        self.objective = search.objective
        self.cost, self.tim = search.tables()
        cap_s = search.cap_s
        self.ok = [[cap_s is None or self.tim[b][k] <= cap_s * (1 + 1e-9) + 1e-12 for k in range(len(sh))]
                   for b, sh in enumerate(self.shapes)]

    def value(self, feet: Footprints) -> tuple[float, float]:
        ks = [self.shapes[b].index(shape_of(f)) for b, f in enumerate(feet)]
        return sum(self.cost[b][k] for b, k in enumerate(ks)), max(self.tim[b][k] for b, k in enumerate(ks))

    def feasible(self, feet: Footprints) -> bool:
        return all(self.ok[b][self.shapes[b].index(shape_of(f))] for b, f in enumerate(feet))

    def key(self, tb: tuple[float, float]) -> tuple[float, float]:
        return tb if self.objective == "total" else (tb[1], tb[0])

    def best(self, cands: Sequence[tuple[Footprints, str]]) -> tuple[Footprints, str] | None:
        """The best feasible candidate (first on ties), ``None`` if none is feasible."""
        ok = [c for c in cands if self.feasible(c[0])]
        return min(ok, key=lambda c: self.key(self.value(c[0]))) if ok else None


@dataclass
class SearchFacts:
    """What the search did (deterministic counts, for the placement file's details)."""

    rounds: int = 0
    lazily: int = 0
    milp_limited: str | None = None
    shapes_kept: list[int] = field(default_factory=list)


class FootprintSearch:
    """The lazy pricing loop around :class:`FootprintModel` (module docstring).

    Parameters
    ----------
    blocks, shapes : the blocks and per block its candidate shapes.
    free : (D,) free GPUs per domain.
    scorer, budget : score and pay.
    options : ``objective``, ``consumer``.
    hints : complete footprints to start from (the caller's candidates).
    exact : (block, shape) -> exact score, shared with the caller (updated).
    cap_s : the stage-time cap (``total``), else ``None``.
    reserve_s : predicted seconds kept for the caller; the exact scoring of a pick (which the
        caller would do anyway) may use all but ``finish_s`` of it.
    """

    def __init__(self, blocks: Sequence[Block], shapes: list[list[Shape]], free: np.ndarray, scorer: BlockScorer,
                 options: SolveOptions, hints: list[Footprints], budget: WorkBudget, *, exact: ExactScores,
                 cap_s: float | None, reserve_s: float, finish_s: float):
        self.blocks, self.shapes, self.free, self.scorer = blocks, shapes, free, scorer
        self.options, self.objective, self.hints, self.budget = options, options.objective, hints, budget
        self.exact, self.cap_s, self.reserve_s, self.finish_s = exact, cap_s, reserve_s, finish_s
        self.prices = ShapePrices(blocks, scorer, budget, reserve_s)
        self.floors = [[scorer.nvlink_floor_s(b, int(l)) for l in b.moe_layers] for b in blocks]
        self.floor = [float(sum(f)) for f in self.floors]
        self.nlay = [len(b.moe_layers) for b in blocks]
        # every complete footprint seen: the hints, then each round's pick (with its MILP status)
        self.seen: list[tuple[Footprints, str]] = [(list(f), "WARM_START") for f in hints]
        self.status = "UNKNOWN"
        self.facts = SearchFacts()

    # ---- prices --------------------------------------------------------------------------
    def score_exact(self, b: int, sh: Shape) -> bool:
        """Score block ``b`` under ``sh`` on all its layers; False when the budget cannot afford it."""
        if (b, sh) in self.exact:
            return True
        block = self.blocks[b]
        if not self.budget.affords(self.scorer.predict_s(block, len(sh)) + self.finish_s):
            return False
        a2p = self.scorer.slices(block, sh)
        score = self.scorer.score(block, a2p, stop=self.budget.stopped)[0]
        offer_exact(self.exact, (b, sh), score, a2p, self.cap_s, self.objective)
        return True

    def _price_row(self, b: int, memo: dict[Shape, float]) -> tuple[list[float], list[float]]:
        size, prices = self.blocks[b].size, self.prices
        floors = self.floors[b]
        c_row, t_row = [], []
        for sh in self.shapes[b]:
            hit = self.exact.get((b, sh))
            if hit is not None:
                c_row.append(hit[0].total_bytes)
                t_row.append(hit[0].time_s)
            elif (size, sh) in prices.per_layer:
                byt, nic = prices.per_layer[size, sh]
                c_row.append(byt * self.nlay[b])
                t_row.append(float(sum(max(nic, f) for f in floors)) if len(sh) > 1 else self.floor[b])
            else:
                est = prices.estimate_bytes(size, sh)
                lb = prices.lower_bound(size, sh, memo)
                c_row.append(max(lb, est if est is not None else lb) * self.nlay[b])
                nic_est = prices.estimate_nic_s(size, sh) if len(sh) > 1 else None
                t_row.append(float(sum(max(nic_est, f) for f in floors)) if nic_est is not None else self.floor[b])
        return c_row, t_row

    def tables(self) -> tuple[list[list[float]], list[list[float]]]:
        """Per block, per shape: (price in bytes, price in seconds)."""
        cost, tim = [], []
        memos: dict[int, dict[Shape, float]] = {}
        for b in range(len(self.blocks)):
            c_row, t_row = self._price_row(b, memos.setdefault(self.blocks[b].size, {}))
            cost.append(c_row)
            tim.append(t_row)
        return cost, tim

    # ---- the loop ------------------------------------------------------------------------
    def _price_up_front(self) -> None:
        """The hints' shapes, every shape under a consumer rule (they are few), and the two-part
        split (p, n - p) for every part size p that a candidate uses, whether or not the split fits
        the domains (a block wider than two domains has no feasible two-part shape, but what lands
        in a part of p GPUs when the rest is one domain is what the estimates need)."""
        todo: list[tuple[int, Shape]] = []
        for feet in self.hints:
            for b, foot in enumerate(feet):
                todo.append((self.blocks[b].size, shape_of(foot)))
        for b, blk in enumerate(self.blocks):
            if self.options.consumer != "none":
                todo.extend((blk.size, sh) for sh in self.shapes[b])
            for p in sorted({v for sh in self.shapes[b] for v in sh if v < blk.size}, reverse=True):
                todo.append((blk.size, _two_part(p, blk.size)))
        for size, sh in dict.fromkeys(todo):
            self.budget.check()
            if not self.prices.price(size, sh):
                break

    def _kept_shapes(self, view: PriceTables, warm: tuple[Footprints, str] | None) -> list[list[int]]:
        """Per block, the candidate shapes within the cap and not priced out by the incumbent."""
        B = len(self.blocks)
        keep = [[k for k in range(len(self.shapes[b])) if view.ok[b][k]] for b in range(B)]
        if warm is None:
            return keep
        wb, wt = view.value(warm[0])
        if self.objective == "total":
            # a shape priced above the whole incumbent cannot be part of a better footprint
            # (estimates miss only what parts cost each other, so they err low)
            return [[k for k in keep[b] if view.cost[b][k] <= wb * (1 + 1e-9) + 1.0] for b in range(B)]
        # a block slower than the incumbent's slowest makes the whole footprint slower
        return [[k for k in keep[b] if view.tim[b][k] <= wt * (1 + 1e-9) + 1e-12] for b in range(B)]

    def _solve_round(self) -> Footprints | None:
        """One MILP round on the current prices; the pick, or ``None`` to end the loop."""
        facts, budget, B = self.facts, self.budget, len(self.blocks)
        facts.rounds += 1
        view = PriceTables(self)
        # warm start: the best complete footprint within the cap so far; HiGHS as scipy exposes
        # it takes no starting solution, so it is the fallback, the yardstick and the cutoff
        warm = view.best(self.seen)
        keep = self._kept_shapes(view, warm)
        if any(not kb for kb in keep):
            self.status = "INFEASIBLE" if warm is None else self.status
            return None
        model = FootprintModel(
            [b.size for b in self.blocks],
            [[self.shapes[b][k] for k in keep[b]] for b in range(B)],
            self.free,
            [[view.cost[b][k] / BYTES_PER_UNIT for k in keep[b]] for b in range(B)],
            [[view.tim[b][k] / SECONDS_PER_UNIT for k in keep[b]] for b in range(B)],
        )
        predicted = milp_predict_s(model.nnz, self.objective)
        # with nothing in hand (a consumer rule the peers' layouts break) one solve is a must
        if not budget.affords(predicted + self.reserve_s) and warm is not None:
            return None
        budget.check()
        budget.charge(predicted)
        t_round = time.monotonic()
        st, picked, _, _ = model.solve(self.objective, time_limit_s=budget.wall_left_s(), node_limit=MILP_NODE_LIMIT)
        facts.shapes_kept.append(int(sum(len(k) for k in keep)))
        log.info("footprint round %d: %s in %.2f s (%d shapes, %d nonzeros, %.2f s predicted)", facts.rounds, st,
                 time.monotonic() - t_round, facts.shapes_kept[-1], model.nnz, predicted)
        if model.stopped_by == "time":
            budget.cut = True  # HiGHS stopped by the clock: the pick may depend on the machine's speed
        elif model.stopped_by == "nodes":
            facts.milp_limited = "nodes"
        if picked is None:
            self.status = st if warm is None else self.status
            return None
        self.seen.append((picked, st))
        return picked

    def _refine(self, picked: Footprints) -> bool:
        """Score the pick's straddling blocks exactly and price its shapes for every block of
        their size; False when there is nothing left to refine or the budget ends."""
        budget, blocks = self.budget, self.blocks
        todo_exact = [(b, shape_of(f)) for b, f in enumerate(picked) if len(f) > 1 and (b, shape_of(f)) not in self.exact]
        if not todo_exact:
            return False  # every straddling block of the pick is scored exactly: optimal for these prices
        if budget.cut:
            return False
        todo_price = list(dict.fromkeys((blocks[b].size, sh) for b, sh in todo_exact
                                        if (blocks[b].size, sh) not in self.prices.per_layer))
        afforded = True
        for b, sh in todo_exact:  # first: it makes the pick a complete, exact candidate
            budget.check()
            afforded = afforded and self.score_exact(b, sh)
        for size, sh in todo_price:
            budget.check()
            afforded = afforded and self.prices.price(size, sh)
            self.facts.lazily += int(afforded)
        return afforded

    def run(self) -> tuple[list[Footprints] | None, str]:
        """``(footprints or None, status)``.

        The footprints returned are the best complete one on the final prices and, if another, the
        best one whose straddling blocks are all scored exactly (first when the clock cut in).  The
        status is the last MILP's (``OPTIMAL``, ``FEASIBLE``), ``WARM_START`` when the best hint
        won, ``INFEASIBLE`` when no footprint exists, ``STOPPED`` (deadline or stop request) or
        ``BUDGET`` (the work budget ended before any footprint was found).
        """
        t0 = time.monotonic()
        try:
            self._price_up_front()
            log.info("footprints: %d shapes priced up front in %.2f s", len(self.prices.per_layer),
                     time.monotonic() - t0)
            while True:
                picked = self._solve_round()
                if picked is None or not self._refine(picked):
                    break
        except Stopped:  # the caller keeps its complete candidates; the picks so far are more
            self.status = "STOPPED"
        finals = self._finals()
        if not finals:
            return None, ("BUDGET" if self.status == "UNKNOWN" else self.status)
        status = finals[0][1] if self.status not in ("STOPPED", "INFEASIBLE") else self.status
        return [c[0] for c in finals], status

    def _finals(self) -> list[tuple[Footprints, str]]:
        """The best footprint seen on the final prices (exact wherever a pick was scored; the
        caller scores it exactly), and the best pick already scored exactly everywhere (all the
        caller can afford when the clock has cut in: first then; the hints are the caller's own
        candidates already)."""
        view = PriceTables(self)

        def exact_everywhere(feet: Footprints) -> bool:
            return all(len(f) == 1 or (b, shape_of(f)) in self.exact for b, f in enumerate(feet))

        scored = [c for c in self.seen[len(self.hints):] if exact_everywhere(c[0])]
        finals = [c for c in (view.best(self.seen), view.best(scored)) if c is not None]
        if self.budget.cut:
            finals.reverse()
        return [c for i, c in enumerate(finals) if all(c[0] != d[0] for d in finals[:i])]

    def details(self) -> dict:
        """Deterministic facts of the search for ``details.layout``."""
        f = self.facts
        return {
            "footprint_rounds": f.rounds,
            "footprint_round_shapes": f.shapes_kept,
            "footprint_milp_limit": f.milp_limited,
            "shapes_per_block": [len(s) for s in self.shapes],
            "shapes_priced": len(self.prices.per_layer),
            "shapes_priced_lazily": f.lazily,
            "blocks_scored_exactly": len(self.exact),
        }
