"""Data-parallel sources on a straddling block: which replica runs on which side.

The experts and the replicas are *alternated*: with the experts fixed, replicas go to the block's
parts by an assignment problem (``scipy.optimize.linear_sum_assignment``, cost = the replica's
crossings from each part, summed over the stage's layers); then the experts are placed again;
until neither improves.  The moved replicas are kept only if they are no worse than the plain
contiguous order on the validation tokens.  Under group-preserving expert maps a replica moves
only inside its group position (moving it elsewhere would change which slots of each group lie in
which domain).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.optimize import linear_sum_assignment

from placement.cost import crossings_per_token
from solvers.layout.blocks import Block
from solvers.layout.scorer import BlockScorer, LayerPlacements

__all__ = ["place_sources", "MAX_SOURCE_ROUNDS"]

#: Rounds of the replicas <-> experts alternation on a straddling block.
MAX_SOURCE_ROUNDS = 4


def _source_cells(block: Block, group_size: int | None, experts_per_rank: int) -> np.ndarray:
    """(n_atoms,) cell of each atom: atoms may trade places only inside a cell."""
    n_atoms = block.atoms.shape[0]
    if group_size is None or block.ep_groups.shape[0] != 1:
        return np.zeros(n_atoms, dtype=np.int64) if block.ep_groups.shape[0] == 1 else np.arange(n_atoms)
    eg = block.ep_groups[0]
    ep_pos = {int(r): k for k, r in enumerate(eg)}
    ranks_per_position = max(1, group_size // experts_per_rank)
    cells = []
    for i, atom in enumerate(block.atoms):
        positions = {ep_pos[int(r)] // ranks_per_position for r in atom}
        cells.append(positions.pop() if len(positions) == 1 else -1 - i)
    return np.array(cells, dtype=np.int64)


def _atom_costs(scorer: BlockScorer, block: Block, placements: LayerPlacements, P: int) -> np.ndarray:
    """(n_atoms, P) crossings of each atom's tokens if it were sourced from each part."""
    n_atoms = block.atoms.shape[0]
    atom_of_rank = {int(r): i for i, atom in enumerate(block.atoms) for r in atom}
    out = np.zeros((n_atoms, P))
    for li, layer in enumerate(block.moe_layers):
        pl = placements[li][0]
        tok = scorer.tokens(block, 0, int(layer))
        if pl is None:
            continue
        parts = pl.expert2part[tok.topk]  # (N, k)
        # per token, its crossings if its source sat in each part p
        per = np.stack([crossings_per_token(parts, np.full(tok.n, p), scorer.mode) for p in range(P)], axis=1)
        atoms = np.array([atom_of_rank[int(block.ep_groups[0][k])] for k in tok.src])
        np.add.at(out, atoms, per)
    return out


def _reassign(cost: np.ndarray, cells: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Atoms -> parts by an assignment problem inside each cell (each cell keeps its parts)."""
    new = cur.copy()
    for c in np.unique(cells):
        idx = np.flatnonzero(cells == c)
        slots = np.sort(cur[idx])
        rows, cols = linear_sum_assignment(cost[idx][:, slots])
        new[idx[rows]] = slots[cols]
    return new


def place_sources(scorer_fit: BlockScorer, scorer_val: BlockScorer, block: Block, a2p: np.ndarray,
                  stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, dict]:
    """Alternate replicas -> parts (assignment) and experts -> parts until neither improves (at most
    :data:`MAX_SOURCE_ROUNDS` rounds); returns (n_atoms,) atom -> part and what happened.

    Raises
    ------
    solvers.layout.budget.Stopped
        ``stop()`` turned true.
    """
    info: dict[str, float | int | bool | None] = {"rounds": 0, "fit_before": None, "fit_after": None,
                                                 "val_before": None, "val_after": None, "kept": False}
    if block.ep_groups.shape[0] != 1 or a2p.max() == 0:
        return a2p, info
    P = int(a2p.max()) + 1
    cells = _source_cells(block, scorer_fit.group_size, scorer_fit.experts_per_rank)
    base_fit, placements = scorer_fit.score(block, a2p, stop=stop)
    best, best_fit = a2p.copy(), base_fit.total_bytes
    info["fit_before"] = best_fit
    cur, cur_pl = a2p.copy(), placements
    for rnd in range(MAX_SOURCE_ROUNDS):
        new = _reassign(_atom_costs(scorer_fit, block, cur_pl, P), cells, cur)
        if np.array_equal(new, cur):
            break
        sc, pl = scorer_fit.score(block, new, stop=stop)
        info["rounds"] = rnd + 1
        if sc.total_bytes >= best_fit - 1e-6:
            break
        best, best_fit = new.copy(), sc.total_bytes
        cur, cur_pl = new, pl
    info["fit_after"] = best_fit
    if np.array_equal(best, a2p):
        return a2p, info
    v0 = scorer_val.score(block, a2p, stop=stop)[0].total_bytes
    v1 = scorer_val.score(block, best, stop=stop)[0].total_bytes
    info["val_before"], info["val_after"] = v0, v1
    if v1 <= v0:
        info["kept"] = True
        return best, info
    return a2p, info
