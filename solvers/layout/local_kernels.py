"""The rank layout's own assignment and swap-search kernels.

Kept here, apart from the rest of the layout, until they are unified with the shared kernels of
``solvers/kernels/`` (the expert placer's); their call sites are :mod:`.experts_on_parts` only.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from solvers.layout.tokens import Tokens, part_counts

__all__ = ["transport", "swap_search"]


def transport(affinity: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Items -> parts maximising total affinity with exactly ``capacity[i]`` items in part ``i``.

    affinity : (n, P); capacity : (P,) summing to n.  Solved exactly as an assignment problem over
    slots (``linear_sum_assignment``); ties broken by item and part index (deterministic).
    """
    n = affinity.shape[0]
    slot2part = np.repeat(np.arange(len(capacity)), capacity)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cost = -affinity[:, slot2part].astype(np.float64)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(n, dtype=np.int64)
    out[rows] = slot2part[cols]
    return out


def _move_deltas(tok: Tokens, e2p: np.ndarray, cnt: np.ndarray | None, notsrc: np.ndarray,
                 use: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(E, P) change of the crossings when expert ``e`` alone moves into part ``p``; and (N, P)
    ``R[t, p]`` (``per_domain``: token ``t`` has exactly one expert in ``p``, a remote part)."""
    E = len(e2p)
    if cnt is not None:
        R = ((cnt == 1) & notsrc).astype(np.float64)
        Ad = ((cnt == 0) & notsrc).astype(np.float64)
        add = np.asarray(tok.At @ Ad)
        rem = np.asarray(tok.At @ R)[np.arange(E), e2p]
        return add - rem[:, None], R
    assert use is not None
    return use[np.arange(E), e2p][:, None] - use, None


def _best_swap(tok: Tokens, e2p: np.ndarray, D: np.ndarray, R: np.ndarray | None,
               same: np.ndarray) -> tuple[int, int] | None:
    """The best improving swap by exact delta (branch and bound on the two moves' lower bound)."""
    E = len(e2p)
    M = D[:, e2p]  # M[e, f] = delta of moving e into f's part
    approx = M + M.T
    ok = same & (e2p[:, None] < e2p[None, :])
    cand = np.flatnonzero(ok & (approx < -0.5))
    if cand.size == 0:
        return None
    order = cand[np.argsort(approx.reshape(-1)[cand], kind="stable")]
    best, best_pair = 0.0, None
    for flat in order:
        lb = approx.reshape(-1)[flat]
        if lb >= best - 0.5:
            break
        e, f = divmod(int(flat), E)
        exact = lb
        if R is not None:
            both = np.intersect1d(tok.tokens_of(e), tok.tokens_of(f), assume_unique=True)
            if both.size:
                exact += float(R[both, e2p[e]].sum() + R[both, e2p[f]].sum())
        if exact < best - 0.5:
            best, best_pair = exact, (e, f)
    return best_pair


def swap_search(
    tok: Tokens,
    e2p: np.ndarray,
    src_part: np.ndarray,
    num_parts: int,
    mode: str,
    swappable: np.ndarray,
    max_swaps: int,
) -> np.ndarray:
    """Best-improvement swaps of two experts in different parts, with exact deltas.

    ``swappable``: (E,) label; only experts with equal labels may swap (the expert group under a
    group-preserving map, else all zeros).  ``per_domain`` deltas: moving ``e`` from ``a`` to ``b``
    changes a token of ``e`` by ``-[cnt[t,a]==1 and a!=src] + [cnt[t,b]==0 and b!=src]``; a swap
    ``e<->f`` is the two moves plus a correction on tokens holding both (their counts do not change),
    ``sum (R[t,a] + R[t,b])`` over ``t`` in ``T(e) & T(f)``.  That correction is >= 0, so the two
    moves alone are a lower bound and candidates are checked in that order (branch and bound).
    Returns the (E,) part of each expert after the swaps.
    """
    e2p = e2p.copy()
    P = num_parts
    n = tok.n
    notsrc = np.ones((n, P), dtype=bool)
    notsrc[np.arange(n), src_part] = False
    same = swappable[:, None] == swappable[None, :]
    use = None
    if mode == "per_pair":
        onehot = np.zeros((n, P))
        onehot[np.arange(n), src_part] = 1.0
        use = np.asarray(tok.At @ onehot)  # (E, P) pairs of e from sources in each part
    cnt = part_counts(tok, e2p, P) if mode == "per_domain" else None
    for _ in range(max_swaps):
        D, R = _move_deltas(tok, e2p, cnt, notsrc, use)
        pair = _best_swap(tok, e2p, D, R, same)
        if pair is None:
            break
        e, f = pair
        a, b = int(e2p[e]), int(e2p[f])
        if cnt is not None:
            te, tf = tok.tokens_of(e), tok.tokens_of(f)
            cnt[te, a] -= 1
            cnt[te, b] += 1
            cnt[tf, b] -= 1
            cnt[tf, a] += 1
        e2p[e], e2p[f] = b, a
    return e2p
