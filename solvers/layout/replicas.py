"""Data-parallel sources on a straddling block: which replica runs on which side.

The experts and the replicas are *alternated*: with the experts fixed, replicas go to the block's
parts by an assignment problem (``scipy.optimize.linear_sum_assignment``, cost = the replica's
crossings from each part, summed over the stage's layers); then the experts are placed again;
until neither improves.  The moved replicas are kept only if they are no worse than the plain
contiguous order on the validation tokens.

Under group-preserving expert maps an atom (a replica's TP x CP ranks) carries its expert slots
with it, and a group-preserving map needs each expert group whole on one group position; the
crossings the assignment counts assume the experts stay in their parts, which such a map can
still realise only if the *make-up* of the group positions (how many of a position's slots lie in
each part) is the same multiset as before.  So replicas move in *units* that keep it:

- each atom inside one group position (the usual case): a unit is a position's atoms; a unit may
  take over another unit's make-up, across parts and racks (an assignment problem over units,
  each cell of it the best assignment of the unit's atoms onto that make-up), and atoms trade
  places freely inside their unit;
- each group position inside one atom (a rank holds whole groups): a unit is an atom, as free;
- otherwise (atoms and positions overlapping): atoms move only inside their position, atoms that
  span positions stay (the rule before units existed).

Then a group that sat on position ``u`` goes to the position now holding ``u``'s old make-up, and
every expert stays in its part.  Free maps: all atoms are one unit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.optimize import linear_sum_assignment

from placement.predict.cost import crossings_per_token
from solvers.layout.blocks import Block
from solvers.layout.scorer import BlockScorer, LayerPlacements

__all__ = ["place_sources", "MAX_SOURCE_ROUNDS"]

#: Rounds of the replicas <-> experts alternation on a straddling block.
MAX_SOURCE_ROUNDS = 4


def _source_units(block: Block, group_size: int | None, experts_per_rank: int) -> tuple[np.ndarray, bool]:
    """(n_atoms,) unit of each atom, and whether units may trade make-ups (module docstring).

    Atoms trade places freely inside their unit; with the flag, whole units also take over other
    units' make-ups (the multiset of parts their atoms occupy).
    """
    n_atoms = block.atoms.shape[0]
    if block.ep_groups.shape[0] != 1:
        return np.arange(n_atoms, dtype=np.int64), False
    if group_size is None:
        return np.zeros(n_atoms, dtype=np.int64), False
    ep_pos = {int(r): k for k, r in enumerate(block.ep_groups[0])}
    # group positions each atom's expert slots touch
    touched = [
        {(ep_pos[int(r)] * experts_per_rank + j) // group_size for r in atom for j in range(experts_per_rank)}
        for atom in block.atoms
    ]
    if all(len(t) == 1 for t in touched):
        return np.array([min(t) for t in touched], dtype=np.int64), True
    owners = np.bincount([q for t in touched for q in t])
    if (owners <= 1).all():
        return np.arange(n_atoms, dtype=np.int64), True
    return np.array([min(t) if len(t) == 1 else -1 - i for i, t in enumerate(touched)], dtype=np.int64), False


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


def _reassign(cost: np.ndarray, units: np.ndarray, cur: np.ndarray, trade: bool = False) -> np.ndarray:
    """Atoms -> parts: inside each unit an assignment problem over the unit's parts; with
    ``trade``, units of equal size also take over each other's make-ups (an assignment problem
    over units, each entry the inner optimum), kept only where it lowers the cost."""
    new = cur.copy()
    members = [np.flatnonzero(units == u) for u in np.unique(units)]
    by_size: dict[int, list[np.ndarray]] = {}
    for idx in members:
        by_size.setdefault(len(idx), []).append(idx)
    for same in by_size.values():
        makeups = [np.sort(cur[idx]) for idx in same] if trade else None
        inner: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]] = {}
        for a, idx in enumerate(same):
            for b in range(len(same)) if makeups is not None else (a,):
                slots = makeups[b] if makeups is not None else np.sort(cur[idx])
                rows, cols = linear_sum_assignment(cost[idx][:, slots])
                inner[a, b] = (idx[rows], slots[cols], float(cost[idx[rows], slots[cols]].sum()))
        pairs = [(a, a) for a in range(len(same))]
        if makeups is not None and len(same) > 1:
            table = np.array([[inner[a, b][2] for b in range(len(same))] for a in range(len(same))])
            rows, cols = linear_sum_assignment(table)
            if table[rows, cols].sum() < np.trace(table) - 1e-9:
                pairs = list(zip(rows.tolist(), cols.tolist()))
        for a, b in pairs:
            atoms, parts, _ = inner[a, b]
            new[atoms] = parts
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
    units, trade = _source_units(block, scorer_fit.group_size, scorer_fit.experts_per_rank)
    base_fit, placements = scorer_fit.score(block, a2p, stop=stop)
    best, best_fit = a2p.copy(), base_fit.total_bytes
    info["fit_before"] = best_fit
    cur, cur_pl = a2p.copy(), placements
    for rnd in range(MAX_SOURCE_ROUNDS):
        new = _reassign(_atom_costs(scorer_fit, block, cur_pl, P), units, cur, trade)
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
