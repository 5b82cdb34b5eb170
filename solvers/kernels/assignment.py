"""Items to classes with exact class counts: the slot-expanded assignment problem.

Every item goes to exactly one class and class ``c`` receives exactly ``counts[c]`` items; the
total cost ``sum_i cost[i, class(i)]`` is minimised.  This is a transportation problem; its
constraint matrix is totally unimodular, so expanding every class into ``counts[c]`` identical
slots turns it into a linear assignment problem whose optimum is the optimum over all maps.

- one class with items: trivial;
- two classes: sorting the items by ``cost[:, a] - cost[:, b]`` and giving the first ``counts[a]``
  to ``a`` is exact (an exchange argument) and much faster than an assignment;
- more: :func:`scipy.optimize.linear_sum_assignment` over the slots.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = ["assign_to_counts"]


def assign_to_counts(
    cost: np.ndarray, counts: np.ndarray, *, method: Literal["auto", "slots"] = "auto"
) -> tuple[np.ndarray, float]:
    """Min-cost map of ``n`` items to classes with exactly ``counts[c]`` items in class ``c``.

    Parameters
    ----------
    cost : (n, C) float, cost of item ``i`` in class ``c`` (negate an affinity to maximise it).
    counts : (C,) int, items each class receives; ``counts.sum() == n``.
    method : ``auto`` (a sort when exactly two classes receive items, else the slot assignment) or
        ``slots`` (always the slot assignment).  Both are exact; they may break ties differently.

    Returns
    -------
    ``(item2class (n,) int64, total cost float)``.

    Raises
    ------
    ValueError
        When ``counts`` does not sum to the number of items.

    Examples
    --------
    >>> assign_to_counts(np.array([[0., 5.], [1., 0.], [0., 2.]]), np.array([2, 1]))
    (array([0, 1, 0]), 0.0)
    """
    cost = np.asarray(cost, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    n = cost.shape[0]
    if int(counts.sum()) != n:
        raise ValueError(f"counts sum to {int(counts.sum())}, expected {n} items")
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0.0
    nz = np.flatnonzero(counts)
    if nz.shape[0] == 1:
        item2class = np.full(n, nz[0], dtype=np.int64)
    elif nz.shape[0] == 2 and method == "auto":
        a, b = nz
        order = np.argsort(cost[:, a] - cost[:, b], kind="stable")
        item2class = np.full(n, b, dtype=np.int64)
        item2class[order[: counts[a]]] = a
    else:
        slot2class = np.repeat(np.arange(cost.shape[1]), counts)
        rows, cols = linear_sum_assignment(cost[:, slot2class])
        item2class = np.empty(n, dtype=np.int64)
        item2class[rows] = slot2class[cols]
    return item2class, float(cost[np.arange(n), item2class].sum())
