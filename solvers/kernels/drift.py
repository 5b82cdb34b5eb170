"""How much of a fitted expert map's gain carries over to the next routing window (drift).

Arrays in, a share out: :func:`gain_kept` on the sampled windows' own loads.  The solvers' common
options (:mod:`solvers.base`) read it to decide how the expert search fits
(:mod:`solvers.experts.windows` holds the search over windows).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["SINGLE_WINDOW_GAIN_KEPT", "FREE_FIT_MIN_GAIN_KEPT", "gain_kept"]

#: The share of a fitted expert map's step-time gain (over contiguous experts on the same rank
#: layout) taken to hold on the next window when the instance has ONE sampled window, so its drift
#: cannot be measured: 1, the sample is trusted (several windows measure it, :func:`gain_kept`).
#: A prior of 0 (fitting early and running late on a trained model's routing gives a slope of
#: 0.007) was measured and rejected: docs/experts.md, "The final choice under drift".
SINGLE_WINDOW_GAIN_KEPT = 1.0

#: Under group-limited routing with ``apply`` ``runtime`` the expert search fits free maps only when
#: several sampled windows show at least this share of a fitted gain carrying over
#: (:func:`gain_kept`); otherwise, and always with one window, it fits group-preserving maps
#: (:meth:`solvers.base.SolveOptions.fit_groups_whole`).  Between two windows of one trained model
#: the share is 0.89 (``real_ep64``), between its 10 % and 50 % checkpoints 0.026 (``real_robust``).
FREE_FIT_MIN_GAIN_KEPT = 0.5


def gain_kept(topk: np.ndarray, bounds: Sequence[tuple[int, int]], num_experts: int) -> float:
    """How much of a fitted gain the next window keeps, estimated from the sampled windows' own drift.

    The least-squares slope, through the origin and clipped to [0, 1], of the latest window's expert
    loads on the earlier windows' (each layer's loads over its mean, minus 1; every layer pooled): 1
    when the latest window repeats the earlier loads, 0 when the earlier loads say nothing of it.
    Under the linear model ``next = mean + slope * (fitted - mean)`` a map's balance (and so its
    gain over a map blind to the loads) carries over in that proportion.  With one window (``bounds``
    of length 1) it is :data:`SINGLE_WINDOW_GAIN_KEPT`.

    Parameters
    ----------
    topk : (L, dp, T, k) sampled expert ids, windows one after another along axis 2.
    bounds : ``(start, stop)`` of each window along axis 2, oldest first.
    num_experts : E.

    Examples
    --------
    >>> t = np.array([0, 0, 0, 1, 2, 3]).reshape(1, 1, 6, 1)
    >>> gain_kept(np.concatenate([t, t], axis=2), [(0, 6), (6, 12)], 4)
    1.0
    >>> gain_kept(t, [(0, 6)], 4) == SINGLE_WINDOW_GAIN_KEPT
    True
    """
    if len(bounds) < 2:
        return SINGLE_WINDOW_GAIN_KEPT
    last = bounds[-1][0]
    num_layers = topk.shape[0]

    def rel(a: np.ndarray) -> np.ndarray:
        loads = np.stack([np.bincount(a[li].reshape(-1), minlength=num_experts) for li in range(num_layers)])
        loads = loads.astype(np.float64)
        return loads / np.maximum(loads.mean(axis=1, keepdims=True), 1e-300) - 1.0

    x, y = rel(topk[:, :, :last]), rel(topk[:, :, last:])
    xx = float((x * x).sum())
    if xx <= 0.0:  # the earlier windows are flat: nothing was fitted to their loads
        return 1.0
    return float(min(1.0, max(0.0, float((x * y).sum()) / xx)))
