"""Domain classes: EP ranks of a stage that sit in the same NVLink domain in every EP group.

All EP groups of a pipeline stage share one expert map per layer, so the cross-domain cost of a map
depends only on which *class* each expert lands in: the class of an EP rank is its *domain
signature*, the tuple of its domains over the stage's EP groups.  With one EP group per stage the
classes are exactly the domains the group touches.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["domain_classes"]


def domain_classes(
    rank_domains: np.ndarray, *, numbering: Literal["sorted", "first_appearance"] = "sorted"
) -> tuple[np.ndarray, np.ndarray]:
    """The classes of a stage's EP ranks.

    Parameters
    ----------
    rank_domains : (G, ep) int, domain of EP rank ``r`` in EP group ``g``.
    numbering : ``sorted`` (classes in increasing order of their signatures) or
        ``first_appearance`` (in order of their first EP rank).

    Returns
    -------
    ``(class2domains (C, G) int64, rank2class (ep,) int64)``: the signature of every class and the
    class of every EP rank.

    Examples
    --------
    >>> sig, r2c = domain_classes(np.array([[3, 3, 1, 1], [3, 2, 1, 2]]))
    >>> sig.tolist(), r2c.tolist()
    ([[1, 1], [1, 2], [3, 2], [3, 3]], [3, 2, 0, 1])
    >>> domain_classes(np.array([[3, 3, 1, 1]]), numbering="first_appearance")[1].tolist()
    [0, 0, 1, 1]
    """
    sig_by_rank = np.asarray(rank_domains, dtype=np.int64).T  # (ep, G)
    class2domains, rank2class = np.unique(sig_by_rank, axis=0, return_inverse=True)
    rank2class = rank2class.reshape(-1).astype(np.int64)
    if numbering == "first_appearance":
        _, first = np.unique(rank2class, return_index=True)
        order = np.argsort(first, kind="stable")  # old class ids in order of first appearance
        renumber = np.empty_like(order)
        renumber[order] = np.arange(order.shape[0])
        class2domains, rank2class = class2domains[order], renumber[rank2class]
    return class2domains.astype(np.int64), rank2class
