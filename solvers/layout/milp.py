"""The footprint MILP: one shape per block and its domains, under the domains' free-GPU capacities.

Solved with HiGHS through ``scipy.optimize.milp``; see :class:`FootprintModel` for the model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import sparse

from solvers.layout.shapes import shape_of

__all__ = ["FootprintModel", "MILP_NODE_LIMIT", "TIE_BREAK", "BYTES_PER_UNIT", "SECONDS_PER_UNIT"]

#: Deterministic cap on the branch-and-bound nodes of one footprint MILP (HiGHS ``node_limit``).
MILP_NODE_LIMIT = 500
#: Weight of the tie-breaking objective relative to the first one (prices in GB and ms).
TIE_BREAK = 1e-6
#: Scale of the MILP's prices: gigabytes and milliseconds.
BYTES_PER_UNIT = 1e9
SECONDS_PER_UNIT = 1e-3


class FootprintModel:
    """MILP: one shape per block and its domains, under the domains' free-GPU capacities.

    Variables (all binary but ``z``)::

        x[b, d, v]  block b puts exactly v GPUs in domain d          (at most one v per (b, d))
        s[b, k]     block b takes its k-th candidate shape            (exactly one k per b)
        z           the slowest block's time (bottleneck objective)

    Constraints: ``sum_{d,v} v x[b,d,v] = n_b``; ``sum_{b,v} v x[b,d,v] <= free_d``;
    ``sum_d x[b,d,v] = sum_k mult_k(v) s[b,k]`` for every part size ``v`` (ties the parts to the
    shape); ``z >= sum_k time[b,k] s[b,k]``; blocks with identical rows take non-decreasing shape
    indices (symmetry).  Solved with HiGHS (``scipy.optimize.milp``), whose LP bound proves
    optimality on this model much faster than CP-SAT (docs/layout.md has the measurement).

    Parameters
    ----------
    sizes : (B,) GPUs of each block.
    shapes : per block, the candidate shapes (non-increasing tuples of part sizes).
    free : (D,) free GPUs per domain.
    cost : per block, per shape, bytes per step (total objective).
    time : per block, per shape, seconds per step (bottleneck objective).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        free: np.ndarray,
        cost: Sequence[Sequence[float]],
        time: Sequence[Sequence[float]],
    ):
        self.sizes = [int(x) for x in sizes]
        self.shapes = [list(s) for s in shapes]
        self.free = [int(x) for x in free]
        B, D = len(self.sizes), len(self.free)
        # x[b, d, v] -> column; s[b, k] -> column; z last
        self.x: dict[tuple[int, int, int], int] = {}
        self.s: dict[tuple[int, int], int] = {}
        for b in range(B):
            vals = sorted({v for sh in self.shapes[b] for v in sh})
            for d in range(D):
                for v in vals:
                    if v <= self.free[d]:
                        self.x[b, d, v] = len(self.x)
        nx = len(self.x)
        for b in range(B):
            for k in range(len(self.shapes[b])):
                self.s[b, k] = nx + len(self.s)
        self.z = nx + len(self.s)
        self.n = self.z + 1
        self._rows: list[dict[int, float]] = []
        self._lo: list[float] = []
        self._hi: list[float] = []
        self._add_assignment_rows()
        self.cost = np.array([c for b in range(B) for c in cost[b]], dtype=np.float64)
        self.time = [np.asarray(t, dtype=np.float64) for t in time]
        for b in range(B):
            coef = {self.s[b, k]: float(self.time[b][k]) for k in range(len(self.shapes[b]))}
            coef[self.z] = -1.0
            self._row(coef, -np.inf, 0)
        # symmetry: interchangeable blocks take non-decreasing shape indices
        classes: dict[tuple, list[int]] = {}
        for b in range(B):
            key = (self.sizes[b], tuple(self.shapes[b]), tuple(cost[b]), tuple(time[b]))
            classes.setdefault(key, []).append(b)
        self.classes = [m for m in classes.values() if len(m) > 1]
        for members in self.classes:
            for b1, b2 in zip(members, members[1:]):
                coef = {self.s[b1, k]: float(k) for k in range(len(self.shapes[b1]))}
                for k in range(len(self.shapes[b2])):
                    coef[self.s[b2, k]] = coef.get(self.s[b2, k], 0.0) - float(k)
                self._row(coef, -np.inf, 0)
        self.stopped_by: str | None = None

    def _row(self, coef: dict[int, float], lower: float, upper: float) -> None:
        self._rows.append(coef)
        self._lo.append(lower)
        self._hi.append(upper)

    def _add_assignment_rows(self) -> None:
        """At most one part size per (block, domain), one shape per block, the block's size, the
        parts tied to the shape, and the domains' capacities."""
        B, D = len(self.sizes), len(self.free)
        by_bd: dict[tuple[int, int], list[int]] = {}
        for (b, d, v), j in self.x.items():
            by_bd.setdefault((b, d), []).append(j)
        for cols in by_bd.values():
            self._row({j: 1.0 for j in cols}, 0, 1)
        for b in range(B):
            self._row({self.s[b, k]: 1.0 for k in range(len(self.shapes[b]))}, 1, 1)
            self._row({j: float(v) for (bb, d, v), j in self.x.items() if bb == b}, self.sizes[b], self.sizes[b])
            for v in sorted({v for sh in self.shapes[b] for v in sh}):
                coef = {j: 1.0 for (bb, d, vv), j in self.x.items() if bb == b and vv == v}
                for k, sh in enumerate(self.shapes[b]):
                    if sh.count(v):
                        coef[self.s[b, k]] = -float(sh.count(v))
                self._row(coef, 0, 0)
        for d in range(D):
            self._row({j: float(v) for (b, dd, v), j in self.x.items() if dd == d}, 0, self.free[d])

    # ---- objective pieces ----------------------------------------------------------------------
    def _total_vec(self) -> np.ndarray:
        c = np.zeros(self.n)
        c[[self.s[key] for key in sorted(self.s)]] = self.cost
        return c

    def _z_vec(self) -> np.ndarray:
        c = np.zeros(self.n)
        c[self.z] = 1.0
        return c

    def canonical(self, assignment: Sequence[dict[int, int]]) -> list[dict[int, int]]:
        """Reorder the footprints of interchangeable blocks to respect the symmetry breaking."""
        assignment = list(assignment)
        for members in self.classes:
            shapes = self.shapes[members[0]]
            feet = sorted((assignment[b] for b in members),
                          key=lambda f: shapes.index(shape_of(f)))
            for b, f in zip(members, feet):
                assignment[b] = f
        return assignment

    def value(self, assignment: Sequence[dict[int, int]]) -> tuple[float, float]:
        """(total, bottleneck) of a complete footprint under the model's prices."""
        tot, z = 0.0, 0.0
        for b, foot in enumerate(assignment):
            k = self.shapes[b].index(shape_of(foot))
            tot += float(self.cost[self.s[b, k] - self.s[0, 0]])
            z = max(z, float(self.time[b][k]))
        return tot, z

    @property
    def nnz(self) -> int:
        """Nonzeros of the constraint matrix (what :func:`solvers.layout.budget.milp_predict_s` sizes a solve by)."""
        return int(sum(len(r) for r in self._rows))

    def solve(
        self, objective: str, *, time_limit_s: float, node_limit: int | None = None
    ) -> tuple[str, list[dict[int, int]] | None, float | None, float | None]:
        """Minimise ``objective`` (``total`` or ``bottleneck``), the other one as a tie-breaker.

        The tie-breaker enters with a weight small enough not to trade against the first objective
        (a second solve with the first objective as a constraint, or an objective cutoff from the
        warm start, slows HiGHS down by an order of magnitude on this model; the warm start is the
        fallback instead).  ``node_limit`` bounds the branch and bound deterministically;
        ``time_limit_s`` is the wall-clock safety net (HiGHS measures it on the clock).  Returns
        (status, per-block ``{domain: GPUs}``, total, bottleneck); :attr:`stopped_by` says what
        ended a solve short of a proof: ``"nodes"`` (deterministic), ``"time"`` (the clock) or
        ``None``.
        """
        from scipy.optimize import Bounds, LinearConstraint, milp

        data, ri, ci = [], [], []
        for i, coef in enumerate(self._rows):
            for j, v in coef.items():
                ri.append(i)
                ci.append(j)
                data.append(v)
        A = sparse.csr_matrix((data, (ri, ci)), shape=(len(self._rows), self.n))
        if objective == "total":
            obj = self._total_vec() + TIE_BREAK * self._z_vec()
        else:
            obj = self._z_vec() + TIE_BREAK * self._total_vec()
        integrality = np.ones(self.n, dtype=np.int64)
        integrality[self.z] = 0
        ub = np.ones(self.n)
        ub[self.z] = np.inf
        lb = np.zeros(self.n)
        # the slowest block is at least the slowest block's fastest shape (tightens the LP bound)
        lb[self.z] = max((float(t.min()) for t in self.time if t.size), default=0.0)
        res = milp(
            obj,
            constraints=LinearConstraint(A, self._lo, self._hi),
            integrality=integrality,
            bounds=Bounds(lb, ub),
            options={"time_limit": max(0.05, time_limit_s), "presolve": True,
                     **({"node_limit": int(node_limit)} if node_limit is not None else {})},
        )
        status = {0: "OPTIMAL", 1: "LIMIT", 2: "INFEASIBLE", 3: "UNBOUNDED", 4: "ERROR"}.get(res.status, "ERROR")
        self.stopped_by = None
        if res.status == 1:
            nodes = getattr(res, "mip_node_count", None)
            self.stopped_by = "nodes" if node_limit is not None and nodes is not None and nodes >= node_limit else "time"
        if res.x is None:
            return status, None, None, None
        feet: list[dict[int, int]] = [dict() for _ in self.sizes]
        for (b, d, v), j in self.x.items():
            if res.x[j] > 0.5:
                feet[b][d] = v
        tot, z = self.value(feet)
        return ("OPTIMAL" if res.status == 0 else "FEASIBLE"), feet, tot, z
