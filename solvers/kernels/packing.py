"""Longest-processing-time (LPT) packing with cardinality limits.

Items go heaviest first (ties: lower index first) into a pack that still has room; which pack is a
rule of the caller's choosing, both classic LPT:

- ``after`` (default): the pack whose load after taking the item is lowest; with several weight
  rows (say one per EP group), the lowest *maximum over rows* after taking it;
- ``per_capacity``: the pack with the lowest load per unit of capacity before taking the item
  (DeepSeek EPLB's ``balanced_packing``: with equal capacities, the lightest pack).

With one weight row and equal capacities both rules pick the same pack.  Ties: lowest pack index.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["lpt_pack"]


def lpt_pack(
    weights: np.ndarray,
    capacities: np.ndarray,
    *,
    rule: Literal["after", "per_capacity"] = "after",
    initial_load: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack weighted items into packs holding at most ``capacities[j]`` items each.

    Parameters
    ----------
    weights : (n,) or (R, n) non-negative float, item weights (one row per load dimension).
    capacities : (m,) int, items each pack holds; ``sum >= n``.
    rule : how a pack is chosen (module docstring).
    initial_load : (m,) or (R, m) loads the packs start with (default 0).

    Returns
    -------
    ``(pack_of (n,) int64, load (R, m) or (m,) float)``: each item's pack and the packs' final loads
    (same number of dimensions as ``weights``).

    Raises
    ------
    ValueError
        When the packs cannot hold the items.

    Examples
    --------
    >>> lpt_pack(np.array([5., 4., 3., 2., 1., 1.]), np.array([3, 3]))[0].tolist()
    [0, 1, 1, 0, 0, 1]
    """
    w = np.asarray(weights, dtype=np.float64)
    one_row = w.ndim == 1
    w2 = w[None, :] if one_row else w
    cap = np.asarray(capacities, dtype=np.int64)
    n, m = w2.shape[1], cap.shape[0]
    if (cap < 0).any() or int(cap.sum()) < n:
        raise ValueError(f"{n} items do not fit packs of sizes {cap.tolist()}")
    if initial_load is None:
        load = np.zeros((w2.shape[0], m))
    else:
        load = np.array(initial_load, dtype=np.float64).reshape(w2.shape[0], m)
    free = cap.copy()
    pack_of = np.empty(n, dtype=np.int64)
    scale = np.where(cap > 0, cap, 1).astype(np.float64)
    for i in np.argsort(-w2.sum(axis=0), kind="stable"):
        if rule == "per_capacity":
            key = np.where(free > 0, load.max(axis=0) / scale, np.inf)
            j = int(np.argmin(key))
        else:
            avail = np.flatnonzero(free > 0)
            score = (load[:, avail] + w2[:, i : i + 1]).max(axis=0)
            j = int(avail[int(np.argmin(score))])
        pack_of[i] = j
        free[j] -= 1
        load[:, j] += w2[:, i]
    return pack_of, load[0] if one_row else load
