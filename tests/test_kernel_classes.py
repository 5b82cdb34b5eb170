"""solvers.kernels.classes: domain classes, against a dictionary of domain signatures."""

from __future__ import annotations

import doctest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers.kernels.classes
from solvers.kernels import domain_classes


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), G=st.integers(1, 3), ep=st.integers(1, 9), D=st.integers(1, 4))
def test_classes_are_the_distinct_signatures(seed, G, ep, D):
    rng = np.random.default_rng(seed)
    rank_domains = rng.integers(0, D, size=(G, ep))
    signatures = {tuple(int(d) for d in rank_domains[:, r]) for r in range(ep)}
    sig, r2c = domain_classes(rank_domains)
    assert [tuple(row) for row in sig.tolist()] == sorted(signatures)
    for r in range(ep):
        assert tuple(sig[r2c[r]].tolist()) == tuple(rank_domains[:, r].tolist())
    first, first_r2c = domain_classes(rank_domains, numbering="first_appearance")
    seen: dict[tuple, int] = {}
    for r in range(ep):
        key = tuple(int(d) for d in rank_domains[:, r])
        assert first_r2c[r] == seen.setdefault(key, len(seen))
        assert tuple(first[first_r2c[r]].tolist()) == key


def test_doctests():
    assert doctest.testmod(solvers.kernels.classes).failed == 0
