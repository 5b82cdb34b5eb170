"""solvers.kernels.assignment: items to classes with exact counts, against brute force."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers.kernels.assignment
from solvers.kernels import assign_to_counts


def _brute_force(cost: np.ndarray, counts: np.ndarray) -> float:
    n, C = cost.shape
    best = np.inf
    for m in itertools.product(range(C), repeat=n):
        if np.array_equal(np.bincount(m, minlength=C), counts):
            best = min(best, float(cost[np.arange(n), list(m)].sum()))
    return best


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), C=st.integers(1, 4), method=st.sampled_from(["auto", "slots"]))
def test_optimal_with_exact_counts(seed, n, C, method):
    rng = np.random.default_rng(seed)
    cost = rng.integers(0, 6, size=(n, C)).astype(float)  # small integers: many ties
    counts = np.bincount(rng.integers(0, C, size=n), minlength=C)
    item2class, total = assign_to_counts(cost, counts, method=method)
    assert np.array_equal(np.bincount(item2class, minlength=C), counts)
    assert total == float(cost[np.arange(n), item2class].sum())
    assert total == _brute_force(cost, counts)


def test_two_classes_sort_and_slots_agree_on_the_optimum():
    rng = np.random.default_rng(4)
    for _ in range(20):
        cost = rng.random((12, 3))
        counts = np.array([5, 0, 7])  # two classes receive items: the sort path
        a, va = assign_to_counts(cost, counts)
        b, vb = assign_to_counts(cost, counts, method="slots")
        assert va == pytest.approx(vb) and np.array_equal(np.bincount(a, minlength=3), counts)


def test_negated_affinity_maximises_it():
    affinity = np.array([[5.0, 0.0], [0.0, 1.0], [4.0, 3.0]])
    item2class, total = assign_to_counts(-affinity, np.array([1, 2]))
    assert item2class.tolist() == [0, 1, 1] and total == -9.0


def test_bad_counts_and_empty_input():
    with pytest.raises(ValueError, match="counts sum to 3"):
        assign_to_counts(np.zeros((2, 2)), np.array([2, 1]))
    e, v = assign_to_counts(np.zeros((0, 3)), np.zeros(3, dtype=int))
    assert e.shape == (0,) and v == 0.0


def test_doctests():
    assert doctest.testmod(solvers.kernels.assignment).failed == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), C=st.integers(1, 4))
def test_the_rank_layouts_use_integer_affinities_with_empty_parts(seed, n, C):
    """How ``solvers.layout.experts_on_parts`` calls it: negated integer (token, expert) pair counts,
    some parts receiving nothing, ``method="slots"``; optimal against brute force."""
    rng = np.random.default_rng(seed)
    affinity = rng.integers(0, 4, size=(n, C)).astype(np.float64)
    counts = np.bincount(rng.integers(0, max(1, C - 1), size=n), minlength=C)
    item2class, total = assign_to_counts(-affinity, counts, method="slots")
    assert np.array_equal(np.bincount(item2class, minlength=C), counts)
    assert total == -affinity[np.arange(n), item2class].sum()
    assert total == _brute_force(-affinity, counts)
