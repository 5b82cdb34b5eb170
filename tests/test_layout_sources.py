"""The layout's data-parallel source step (solvers/layout/replicas.py): which atoms may move where.

Under a group-preserving map a replica moves with its expert slots; the step keeps the multiset of
the group positions' make-ups (how many of a position's slots lie in each part), so the old expert
-> part map stays realisable by a group-preserving map.  Brute force over every permutation of the
atoms' parts checks that the step finds the cheapest such move.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.layout.blocks import Block
from solvers.layout.replicas import _reassign, _source_units


def _block(ep: int, atom_size: int = 1) -> Block:
    ranks = np.arange(ep, dtype=np.int64)
    atoms = ranks.reshape(-1, atom_size)
    return Block(index=0, stage=0, ranks=ranks, atoms=atoms, atom_replica=np.arange(atoms.shape[0]),
                 ep_groups=ranks.reshape(1, -1), moe_layers=np.array([0]))


def test_units_are_group_positions_atoms_or_the_old_cells():
    # free maps: one unit, no trading needed
    units, trade = _source_units(_block(8), None, 2)
    assert units.tolist() == [0] * 8 and not trade
    # 2 slots per rank, groups of 4 slots: a position is 2 ranks; positions trade make-ups
    units, trade = _source_units(_block(8), 4, 2)
    assert units.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and trade
    # a rank holds two whole groups: every atom a unit
    units, trade = _source_units(_block(4), 2, 4)
    assert units.tolist() == [0, 1, 2, 3] and trade
    # atoms of two ranks, each inside one position of 4 ranks
    units, trade = _source_units(_block(8, atom_size=2), 4, 1)
    assert units.tolist() == [0, 0, 1, 1] and trade
    # 2 slots per rank, groups of 3: rank 1 spans positions 0 and 1, which ranks 0 and 2 share with
    # it; only the old rule (atoms move inside their position, rank 1 stays)
    units, trade = _source_units(_block(3), 3, 2)
    assert units.tolist() == [0, -2, 1] and not trade


def _makeups(a2p: np.ndarray, units: np.ndarray) -> Counter:
    return Counter(tuple(sorted(a2p[units == u].tolist())) for u in np.unique(units))


def _brute(cost: np.ndarray, units: np.ndarray, cur: np.ndarray, trade: bool) -> float:
    want = _makeups(cur, units)
    best = np.inf
    for perm in set(itertools.permutations(cur.tolist())):
        a2p = np.array(perm)
        if trade:
            ok = _makeups(a2p, units) == want
        else:
            ok = all(sorted(a2p[units == u].tolist()) == sorted(cur[units == u].tolist()) for u in np.unique(units))
        if ok:
            best = min(best, float(cost[np.arange(len(a2p)), a2p].sum()))
    return best


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_units=st.integers(1, 4),
    unit_size=st.integers(1, 3),
    num_parts=st.integers(2, 3),
    trade=st.booleans(),
    free=st.booleans(),
)
def test_reassign_finds_the_cheapest_move_that_keeps_the_make_ups(seed, n_units, unit_size, num_parts, trade, free):
    rng = np.random.default_rng(seed)
    n_atoms = n_units * unit_size
    if n_atoms > 8:
        n_units = 8 // unit_size
        n_atoms = n_units * unit_size
    units = np.zeros(n_atoms, dtype=np.int64) if free else np.repeat(np.arange(n_units), unit_size)
    cur = rng.integers(0, num_parts, size=n_atoms)
    cost = rng.integers(0, 20, size=(n_atoms, num_parts)).astype(float)
    new = _reassign(cost, units, cur, trade)
    assert sorted(new.tolist()) == sorted(cur.tolist())  # every part keeps its atom count
    if trade:
        assert _makeups(new, units) == _makeups(cur, units)  # realisable by a group-preserving map
    else:
        for u in np.unique(units):
            assert sorted(new[units == u].tolist()) == sorted(cur[units == u].tolist())
    got = float(cost[np.arange(n_atoms), new].sum())
    assert got == _brute(cost, units, cur, trade)
    assert got <= float(cost[np.arange(n_atoms), cur].sum())


def test_trading_moves_whole_positions_across_parts():
    # two positions of two atoms each, position 0 in part 0 and position 1 in part 1; the atoms of
    # position 0 prefer part 1 and those of position 1 part 0: the old rule (moves only inside a
    # position) cannot help, trading make-ups swaps them.
    units = np.array([0, 0, 1, 1])
    cur = np.array([0, 0, 1, 1])
    cost = np.array([[5.0, 1.0], [5.0, 1.0], [1.0, 5.0], [1.0, 5.0]])
    assert _reassign(cost, units, cur, False).tolist() == [0, 0, 1, 1]
    assert _reassign(cost, units, cur, True).tolist() == [1, 1, 0, 0]
    # a tie keeps the atoms where they are
    flat = np.ones((4, 2))
    assert _reassign(flat, units, cur, True).tolist() == [0, 0, 1, 1]
