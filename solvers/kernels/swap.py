"""Best-improvement swap search on weighted nets, with exact incremental deltas.

Items (experts) sit in classes; a net (a weighted set of tokens with one expert set and one source)
sees class ``c`` as domain ``net_class_domain[c, n]``.  A net's crossings are, per token,
``per_domain``: the distinct remote domains of its items, ``per_pair``: its items in remote domains.

A swap exchanges the classes of two items ``e`` (class ``a``) and ``f`` (class ``b``).  Its exact
delta is ``M[e, b] + M[f, a] - R_b[e, f] - R_a[f, e]``, where ``M[e, c]`` is the exact delta of
moving ``e`` alone to ``c`` and ``R_c[e, f]`` sums, over the nets holding both ``e`` and ``f``,
``e``'s part of ``M[e, c]``: such nets keep their domain counts under the swap, so their delta is
exactly 0 (``per_pair`` needs no correction: ``R`` is None).  After a swap only the nets holding
``e`` or ``f`` change; ``M`` and ``R`` are updated from them alone.

Constraints: only items with equal ``swap_label`` swap (None: any two), and with ``load`` (G, E) and
a cap (G, C) no class may exceed its cap in any row.  Deterministic: ties of the exact delta go,
with ``tie_break="class_pair"`` (the default), to the lowest class pair, then the lowest item pair
(row-major); with ``tie_break="lower_bound"``, to the lowest two-move sum ``M[e, b] + M[f, a]``
(the swap's lower bound under ``per_domain``), then the lowest item pair ``(e, f)`` with ``e`` in
the lower class (the order of a branch and bound over that bound, which the rank layout used).
"""

from __future__ import annotations

from typing import Callable, Literal

import numpy as np

from solvers.kernels.crossings import net_crossings_of

__all__ = ["NetSwapSearch"]


class NetSwapSearch:
    """Exact swap deltas and best-improvement swaps on one set of nets.

    Parameters
    ----------
    experts : (N, k) int, the distinct items of each net.
    net_class_domain : (C, N) int, domain of class ``c`` as seen from net ``n``.
    src : (N,) int, each net's source domain.
    weight : (N,) int, tokens per net.
    num_items : E.
    num_domains : D (domains are ``0 .. D-1``).
    cost_mode : ``per_domain`` or ``per_pair``.
    load : (G, E) item loads for the caps of :meth:`run_swaps` (None: no caps possible).
    swap_label : (E,) only items with equal labels swap (None: any two).
    tie_break : ``class_pair`` or ``lower_bound``, the order among swaps of equal exact delta
        (module docstring).
    """

    def __init__(self, experts: np.ndarray, net_class_domain: np.ndarray, src: np.ndarray, weight: np.ndarray, *,
                 num_items: int, num_domains: int, cost_mode: str, load: np.ndarray | None = None,
                 swap_label: np.ndarray | None = None,
                 tie_break: Literal["class_pair", "lower_bound"] = "class_pair"):
        if tie_break not in ("class_pair", "lower_bound"):
            raise ValueError(f"tie_break must be 'class_pair' or 'lower_bound', got {tie_break!r}")
        self.tie_break = tie_break
        self.experts = experts
        self.src = src
        self.net_class_domain = net_class_domain
        self.E, self.C, self.D = num_items, int(net_class_domain.shape[0]), num_domains
        N, k = experts.shape
        self.N, self.k = N, k
        self.cost_mode = cost_mode
        self.per_domain = cost_mode == "per_domain"
        self.load = load
        self.swap_label = swap_label
        # (C, N, k) domain each item of each net would be in, per class
        self.ndom = np.repeat(net_class_domain[:, :, None], k, axis=2)
        self.w = weight.astype(np.int64)
        # nets holding each item (CSR over items)
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        self.e_ptr = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.E))])
        self.e_nets = (order // max(k, 1)).astype(np.int64)
        self.cnt = np.zeros((0, self.D), dtype=np.int64)
        self.parts = np.zeros((0, k, self.C), dtype=np.int64)
        self.M = np.zeros((self.E, self.C))
        self.R: np.ndarray | None = None

    # ---- exact evaluation ------------------------------------------------------------------
    def cost(self, e2c: np.ndarray) -> int:
        """Exact crossings of the nets with item ``e`` in class ``e2c[e]``."""
        if self.N == 0:
            return 0
        dom = self.net_class_domain[e2c[self.experts], np.arange(self.N)[:, None]]
        return net_crossings_of(dom, self.src, self.w, self.cost_mode)

    def _parts(self, rows: np.ndarray, e2c: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        """(len(rows), k, C) each (net, item) pair's part of that item's exact move delta."""
        ex = self.experts[rows]  # (m, k)
        src = self.src[rows][:, None]
        w = self.w[rows][:, None]
        cur = e2c[ex]
        da = np.take_along_axis(self.ndom[:, rows, :], cur[None, :, :], axis=0)[0]  # (m, k)
        out = np.zeros(ex.shape + (self.C,), dtype=np.int64)
        if self.per_domain:
            cr = cnt[rows]
            leave = (np.take_along_axis(cr, da, axis=1) == 1) & (da != src)
            for c in range(self.C):
                dc = self.ndom[c, rows]
                enter = (np.take_along_axis(cr, dc, axis=1) == 0) & (dc != src)
                out[:, :, c] = np.where(dc == da, 0, w * (enter.astype(np.int64) - leave))
        else:
            for c in range(self.C):
                dc = self.ndom[c, rows]
                out[:, :, c] = w * ((dc != src).astype(np.int64) - (da != src))
        return out

    def _counts(self, rows: np.ndarray, e2c: np.ndarray) -> np.ndarray:
        """(len(rows), D) items of each net in each domain."""
        ex = self.experts[rows]
        da = np.take_along_axis(self.ndom[:, rows, :], e2c[ex][None, :, :], axis=0)[0]
        m = rows.shape[0]
        return np.bincount((np.arange(m)[:, None] * self.D + da).reshape(-1), minlength=m * self.D).reshape(m, self.D)

    def init_state(self, e2c: np.ndarray) -> None:
        """Compute ``M``, ``R`` and the per-net domain counts afresh for ``e2c``."""
        N = self.N
        rows = np.arange(N)
        self.cnt = self._counts(rows, e2c)
        self.parts = self._parts(rows, e2c, self.cnt)  # (N, k, C)
        ex = self.experts
        self.M = np.stack([np.bincount(ex.reshape(-1), weights=self.parts[:, :, c].reshape(-1), minlength=self.E)
                           for c in range(self.C)], axis=1)
        self.R = None
        if self.per_domain:
            self.R = np.zeros((self.C, self.E, self.E))
            ii = np.broadcast_to(ex[:, :, None], (N, self.k, self.k)).reshape(-1)
            jj = np.broadcast_to(ex[:, None, :], (N, self.k, self.k)).reshape(-1)
            for c in range(self.C):
                vals = np.broadcast_to(self.parts[:, :, c][:, :, None], (N, self.k, self.k)).reshape(-1)
                self.R[c] = np.bincount(ii * self.E + jj, weights=vals, minlength=self.E * self.E).reshape(self.E, self.E)

    def swap_delta(self, e2c: np.ndarray, e: int, f: int) -> float:
        """Exact change of :meth:`cost` if ``e`` and ``f`` exchange classes (state must match ``e2c``)."""
        a, b = int(e2c[e]), int(e2c[f])
        delta = self.M[e, b] + self.M[f, a]
        if self.R is not None:
            delta -= self.R[b][e, f] + self.R[a][f, e]
        return float(delta)

    def apply(self, e2c: np.ndarray, e: int, f: int) -> None:
        """Swap the classes of ``e`` and ``f`` in ``e2c`` (in place) and update the state from their nets."""
        rows = np.union1d(self.e_nets[self.e_ptr[e]: self.e_ptr[e + 1]], self.e_nets[self.e_ptr[f]: self.e_ptr[f + 1]])
        e2c[e], e2c[f] = e2c[f], e2c[e]
        if rows.size == 0:
            return
        self.cnt[rows] = self._counts(rows, e2c)
        new = self._parts(rows, e2c, self.cnt)
        diff = new - self.parts[rows]
        self.parts[rows] = new
        ex = self.experts[rows]
        m = rows.shape[0]
        for c in range(self.C):
            self.M[:, c] += np.bincount(ex.reshape(-1), weights=diff[:, :, c].reshape(-1), minlength=self.E)
        if self.R is not None:
            flat = (ex[:, :, None] * self.E + ex[:, None, :]).reshape(-1)
            for c in range(self.C):
                vals = np.broadcast_to(diff[:, :, c][:, :, None], (m, self.k, self.k)).reshape(-1)
                if vals.any():
                    self.R[c] += np.bincount(flat, weights=vals, minlength=self.E * self.E).reshape(self.E, self.E)

    # ---- the search --------------------------------------------------------------------------
    def best_swap(self, e2c: np.ndarray, loads: np.ndarray | None, cap: np.ndarray | None) -> tuple[int, int] | None:
        """The most improving allowed swap ``(e, f)`` (delta <= -1), or None."""
        if self.tie_break == "lower_bound":
            return self._best_swap_lower_bound(e2c, loads, cap)
        M, R = self.M, self.R
        members = [np.flatnonzero(e2c == c) for c in range(self.C)]
        best_val, best = -0.5, None  # integer deltas: accept <= -1
        for a in range(self.C):
            for b in range(a + 1, self.C):
                Ea, Eb = members[a], members[b]
                if Ea.size == 0 or Eb.size == 0:
                    continue
                delta = M[Ea, b][:, None] + M[Eb, a][None, :]
                if R is not None:
                    delta = delta - R[b][np.ix_(Ea, Eb)] - R[a][np.ix_(Eb, Ea)].T
                ok = self._allowed(Ea, Eb, a, b, loads, cap)
                delta = np.where(ok, delta, 0)
                i = int(np.argmin(delta))
                v = delta.flat[i]
                if v < best_val:
                    best_val = v
                    best = (int(Ea[i // Eb.size]), int(Eb[i % Eb.size]))
        return best

    def _best_swap_lower_bound(self, e2c: np.ndarray, loads: np.ndarray | None,
                               cap: np.ndarray | None) -> tuple[int, int] | None:
        """:meth:`best_swap` with ties ordered by ``(lower bound, e, f)`` (``tie_break="lower_bound"``)."""
        M, R = self.M, self.R
        members = [np.flatnonzero(e2c == c) for c in range(self.C)]
        best_key: tuple[float, float, int, int] | None = None
        for a in range(self.C):
            for b in range(a + 1, self.C):
                Ea, Eb = members[a], members[b]
                if Ea.size == 0 or Eb.size == 0:
                    continue
                bound = M[Ea, b][:, None] + M[Eb, a][None, :]
                delta = bound
                if R is not None:
                    delta = bound - R[b][np.ix_(Ea, Eb)] - R[a][np.ix_(Eb, Ea)].T
                ok = self._allowed(Ea, Eb, a, b, loads, cap) & (delta < -0.5)  # integer deltas
                if not ok.any():
                    continue
                dmin = delta[ok].min()
                ok &= delta == dmin
                bmin = bound[ok].min()
                i = int(np.flatnonzero(ok & (bound == bmin))[0])  # row-major: lowest (e, f)
                key = (float(dmin), float(bmin), int(Ea[i // Eb.size]), int(Eb[i % Eb.size]))
                if best_key is None or key < best_key:
                    best_key = key
        return None if best_key is None else (best_key[2], best_key[3])

    def _allowed(self, Ea: np.ndarray, Eb: np.ndarray, a: int, b: int, loads: np.ndarray | None,
                 cap: np.ndarray | None) -> np.ndarray:
        """(|Ea|, |Eb|) which swaps of an item of class ``a`` with one of class ``b`` are allowed."""
        ok = np.ones((Ea.size, Eb.size), dtype=bool)
        if self.swap_label is not None:
            ok &= self.swap_label[Ea][:, None] == self.swap_label[Eb][None, :]
        if cap is not None and loads is not None and self.load is not None:
            for g in range(self.load.shape[0]):
                d = self.load[g, Eb][None, :] - self.load[g, Ea][:, None]  # a gains f, loses e
                ok &= (loads[g, a] + d <= cap[g, a]) & (loads[g, b] - d <= cap[g, b])
        return ok

    def run_swaps(self, e2c: np.ndarray, loads: np.ndarray | None, cap: np.ndarray | None, max_swaps: int,
                  should_stop: Callable[[], bool] | None = None) -> int:
        """Apply best swaps to ``e2c`` (and ``loads`` (G, C), in place) from a fresh state until none
        improves, ``max_swaps`` are done or ``should_stop()`` (asked before each swap) says so; returns
        the swaps made (``e2c`` is a valid map after each)."""
        self.init_state(e2c)
        swaps = 0
        while swaps < max_swaps and not (should_stop is not None and should_stop()):
            best = self.best_swap(e2c, loads, cap)
            if best is None:
                break
            e, f = best
            if loads is not None and self.load is not None:
                a, b = e2c[e], e2c[f]
                d = self.load[:, f] - self.load[:, e]
                loads[:, a] += d
                loads[:, b] -= d
            self.apply(e2c, e, f)
            swaps += 1
        return swaps
