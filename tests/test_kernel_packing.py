"""solvers.kernels.packing: LPT packing, against a plain reference loop and brute force."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers.kernels.packing
from solvers.kernels import lpt_pack


def _reference(w: np.ndarray, cap: list[int], rule: str) -> list[int]:
    """The rule of the module docstring, item by item, in plain Python."""
    R, n = w.shape
    load = [[0.0] * len(cap) for _ in range(R)]
    free = list(cap)
    order = sorted(range(n), key=lambda i: (-sum(w[:, i]), i))
    out = [0] * n
    for i in order:
        best, best_key = None, None
        for j in range(len(cap)):
            if free[j] == 0:
                continue
            if rule == "after":
                key = max(load[r][j] + w[r, i] for r in range(R))
            else:
                key = max(load[r][j] for r in range(R)) / cap[j]
            if best_key is None or key < best_key:
                best, best_key = j, key
        assert best is not None
        out[i] = best
        free[best] -= 1
        for r in range(R):
            load[r][best] += w[r, i]
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.integers(1, 3), n=st.integers(0, 9), rule=st.sampled_from(["after", "per_capacity"]))
def test_matches_the_reference_and_respects_capacities(seed, R, n, rule):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 20, size=(R, n)).astype(float)
    cap = rng.integers(1, 4, size=int(rng.integers(1, 4)))
    if cap.sum() < n:
        cap[0] += n - cap.sum()
    pack_of, load = lpt_pack(w, cap, rule=rule)
    assert pack_of.tolist() == _reference(w, cap.tolist(), rule)
    assert (np.bincount(pack_of, minlength=len(cap)) <= cap).all()
    for r in range(R):
        assert np.allclose(load[r], np.bincount(pack_of, weights=w[r], minlength=len(cap)))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=6, max_size=6))
def test_equal_capacities_within_the_lpt_guarantee(weights):
    w = np.array(weights, dtype=float)
    pack_of, load = lpt_pack(w, np.array([3, 3]))
    best = min(np.bincount(np.array(a), weights=w, minlength=2).max()
               for a in itertools.product(range(2), repeat=6) if np.bincount(np.array(a), minlength=2).tolist() == [3, 3])
    assert load.max() <= best * 4 / 3 + w.max() + 1e-9
    assert np.array_equal(pack_of, lpt_pack(w, np.array([3, 3]), rule="per_capacity")[0])  # same pack, one row


def test_initial_load_and_errors():
    pack_of, load = lpt_pack(np.array([1.0, 1.0]), np.array([1, 1]), initial_load=np.array([5.0, 0.0]))
    assert pack_of.tolist() == [1, 0] and load.tolist() == [6.0, 1.0]
    with pytest.raises(ValueError, match="do not fit"):
        lpt_pack(np.ones(3), np.array([1, 1]))


def test_doctests():
    assert doctest.testmod(solvers.kernels.packing).failed == 0
