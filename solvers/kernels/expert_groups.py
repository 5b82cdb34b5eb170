"""Whether expert maps keep DeepSeek's expert groups whole (a solver-side computation).

Expert group ``g`` is the ``E/G`` contiguous logical ids ``g*E/G .. (g+1)*E/G - 1``; a group
position is the ``E/G`` contiguous physical slots that hold one whole group.  A map keeps expert
groups whole when every group position holds experts of one group only.  (``placement verify`` has
its own implementation of this rule; solvers never call it.)
"""

from __future__ import annotations

import numpy as np

__all__ = ["keeps_expert_groups"]


def keeps_expert_groups(phy2log: np.ndarray, experts_per_group: int) -> bool:
    """True when every layer's map keeps expert groups whole.

    Parameters
    ----------
    phy2log : (L, E) or (E,) int, logical expert of each physical slot.
    experts_per_group : E/G (``E`` means one group: always True).

    Examples
    --------
    >>> keeps_expert_groups(np.array([[2, 3, 0, 1], [0, 2, 1, 3]]), 2)
    False
    >>> keeps_expert_groups(np.array([3, 2, 0, 1]), 2)
    True
    """
    rows = np.atleast_2d(np.asarray(phy2log, dtype=np.int64))
    L, E = rows.shape
    groups = (rows // experts_per_group).reshape(L, E // experts_per_group, experts_per_group)
    return bool((groups == groups[:, :, :1]).all())
