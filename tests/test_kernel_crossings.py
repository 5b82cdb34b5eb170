"""solvers.kernels.crossings and expert_groups, against plain Python counts (bytes per crossing is held
against the evaluator in tests/test_expert_estimators.py)."""

from __future__ import annotations

import doctest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers.kernels.crossings
import solvers.kernels.expert_groups
from solvers.kernels import keeps_expert_groups, net_crossings_of


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(0, 8), k=st.integers(1, 5), mode=st.sampled_from(["per_domain", "per_pair"]))
def test_crossings_are_distinct_remote_domains_or_remote_experts(seed, N, k, mode):
    rng = np.random.default_rng(seed)
    dom = rng.integers(0, 4, size=(N, k))
    src = rng.integers(0, 4, size=N)
    w = rng.integers(1, 5, size=N)
    want = 0
    for n in range(N):
        if mode == "per_domain":
            want += int(w[n]) * len({int(d) for d in dom[n]} - {int(src[n])})
        else:
            want += int(w[n]) * sum(int(d) != int(src[n]) for d in dom[n])
    assert net_crossings_of(dom, src, w, mode) == want


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), G=st.sampled_from([1, 2, 4]), L=st.integers(1, 3))
def test_keeps_expert_groups_against_sets(seed, G, L):
    rng = np.random.default_rng(seed)
    E, size = 8, 8 // G
    rows = []
    for _ in range(L):
        if rng.random() < 0.5:  # a group-preserving map: groups on positions, experts inside
            order = rng.permutation(G)
            rows.append(np.concatenate([rng.permutation(np.arange(g * size, (g + 1) * size)) for g in order]))
        else:
            rows.append(rng.permutation(E))
    phy2log = np.stack(rows)
    want = all(len({int(e) // size for e in row[p * size:(p + 1) * size]}) == 1 for row in phy2log for p in range(G))
    assert keeps_expert_groups(phy2log, size) == want


def test_doctests():
    for module in (solvers.kernels.crossings, solvers.kernels.expert_groups):
        assert doctest.testmod(module).failed == 0
