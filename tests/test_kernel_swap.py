"""solvers.kernels.swap: exact incremental swap deltas and a search that ends at a local optimum."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.kernels import NetSwapSearch


def _random_nets(rng, E: int, C: int, D: int, N: int, k: int, G: int):
    experts = np.stack([np.sort(rng.choice(E, k, replace=False)) for _ in range(N)])
    group = rng.integers(0, G, size=N)
    class_sig = rng.integers(0, D, size=(C, G))  # domain of class c in EP group g
    src = rng.integers(0, D, size=N)
    weight = rng.integers(1, 4, size=N)
    e2c = rng.permutation(np.arange(E) % C)
    return experts, class_sig[:, group], src, weight, e2c


def _brute_cost(experts, ncd, src, weight, e2c, mode) -> int:
    total = 0
    for n in range(experts.shape[0]):
        doms = [int(ncd[e2c[e], n]) for e in experts[n]]
        if mode == "per_domain":
            total += int(weight[n]) * len(set(doms) - {int(src[n])})
        else:
            total += int(weight[n]) * sum(d != int(src[n]) for d in doms)
    return total


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]), G=st.integers(1, 2))
def test_every_swap_delta_is_exact_and_applied_state_matches_a_fresh_one(seed, mode, G):
    rng = np.random.default_rng(seed)
    E, C, D = 10, 3, 3
    experts, ncd, src, weight, e2c = _random_nets(rng, E, C, D, N=14, k=3, G=G)
    s = NetSwapSearch(experts, ncd, src, weight, num_items=E, num_domains=D, cost_mode=mode)
    s.init_state(e2c)
    base = s.cost(e2c)
    assert base == _brute_cost(experts, ncd, src, weight, e2c, mode)
    for e in range(E):
        for f in range(E):
            if e2c[e] == e2c[f]:
                continue
            moved = e2c.copy()
            moved[e], moved[f] = e2c[f], e2c[e]
            assert s.swap_delta(e2c, e, f) == _brute_cost(experts, ncd, src, weight, moved, mode) - base
    cur = e2c.copy()
    for _ in range(5):
        e, f = rng.choice(E, 2, replace=False)
        if cur[e] != cur[f]:
            s.apply(cur, int(e), int(f))
    M, R, cnt = s.M.copy(), None if s.R is None else s.R.copy(), s.cnt.copy()
    s.init_state(cur)
    assert np.array_equal(cnt, s.cnt) and np.allclose(M, s.M)
    if R is not None:
        assert s.R is not None and np.allclose(R, s.R)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]))
def test_search_ends_at_a_local_optimum_within_labels_and_caps(seed, mode):
    rng = np.random.default_rng(seed)
    E, C, D = 8, 2, 2
    experts, ncd, src, weight, e2c = _random_nets(rng, E, C, D, N=12, k=3, G=1)
    label = np.arange(E) // 4  # two swap groups
    load = rng.integers(0, 5, size=(1, E))
    loads = np.stack([np.bincount(e2c, weights=load[0], minlength=C)]).astype(np.int64)
    cap = loads + 3
    s = NetSwapSearch(experts, ncd, src, weight, num_items=E, num_domains=D, cost_mode=mode, load=load,
                      swap_label=label)
    start = s.cost(e2c)
    cur = e2c.copy()
    s.run_swaps(cur, loads, cap, max_swaps=100)
    assert s.cost(cur) <= start
    assert np.array_equal(np.sort(cur), np.sort(e2c))  # a swap keeps class counts
    for grp in (0, 1):  # labels: each group keeps its class make-up
        sel = label == grp
        assert np.array_equal(np.sort(cur[sel]), np.sort(e2c[sel]))
    got = np.bincount(cur, weights=load[0], minlength=C)
    assert (got <= cap[0]).all() and np.array_equal(got, loads[0])
    for e in range(E):  # no allowed improving swap is left
        for f in range(E):
            if cur[e] == cur[f] or label[e] != label[f]:
                continue
            moved = cur.copy()
            moved[e], moved[f] = cur[f], cur[e]
            within = (np.bincount(moved, weights=load[0], minlength=C) <= cap[0]).all()
            if within:
                assert s.cost(moved) >= s.cost(cur)


def _brute_search(experts, ncd, src, weight, e2c, mode, labels, max_swaps, tie_break):
    """Reference best-improvement search: every allowed swap scored by full recomputation, the
    best by ``(delta, key)`` with ``key`` the tie order of ``tie_break`` (module docstring)."""
    e2c = e2c.copy()
    E = len(e2c)
    for _ in range(max_swaps):
        base = _brute_cost(experts, ncd, src, weight, e2c, mode)

        def moved_cost(pairs):
            m = e2c.copy()
            for item, cls in pairs:
                m[item] = cls
            return _brute_cost(experts, ncd, src, weight, m, mode) - base

        best = None
        for e in range(E):
            for f in range(E):
                a, b = int(e2c[e]), int(e2c[f])
                if a >= b or (labels is not None and labels[e] != labels[f]):
                    continue
                delta = moved_cost([(e, b), (f, a)])
                if delta > -1:
                    continue
                if tie_break == "lower_bound":
                    key = (delta, moved_cost([(e, b)]) + moved_cost([(f, a)]), e, f)
                else:
                    key = (delta, a, b, e, f)
                if best is None or key < best[0]:
                    best = (key, e, f)
        if best is None:
            break
        _, e, f = best
        e2c[e], e2c[f] = e2c[f], e2c[e]
    return e2c


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]),
       tie_break=st.sampled_from(["class_pair", "lower_bound"]), labelled=st.booleans(), G=st.integers(1, 2))
def test_search_takes_the_best_swap_in_the_tie_order_of_a_brute_force_reference(seed, mode, tie_break, labelled, G):
    rng = np.random.default_rng(seed)
    E, C = 9, 3
    experts, ncd, src, weight, e2c = _random_nets(rng, E, C, C, N=16, k=3, G=G)
    labels = rng.integers(0, 2, size=E) if labelled else None
    s = NetSwapSearch(experts, ncd, src, weight, num_items=E, num_domains=C, cost_mode=mode,
                      swap_label=labels, tie_break=tie_break)
    got = e2c.copy()
    s.run_swaps(got, None, None, 6)
    want = _brute_search(experts, ncd, src, weight, e2c, mode, labels, 6, tie_break)
    assert np.array_equal(got, want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), labelled=st.booleans())
def test_the_rank_layouts_use_one_net_per_token_each_part_its_own_domain(seed, labelled):
    """How ``solvers.layout.experts_on_parts`` calls the kernel: weight 1 per token, class ``p`` is
    domain ``p`` for every token, ``lower_bound`` ties; checked against the reference search."""
    from solvers.layout.experts_on_parts import _swaps
    from solvers.layout.tokens import Tokens

    rng = np.random.default_rng(seed)
    E, P, N, k = 10, 3, 20, 3
    topk = np.stack([rng.choice(E, k, replace=False) for _ in range(N)])
    src_part = rng.integers(0, P, size=N)
    e2p = rng.permutation(np.arange(E) % P)
    labels = rng.integers(0, 2, size=E) if labelled else None
    got = _swaps(Tokens(topk, src_part, E), e2p, src_part, P, "per_domain", labels, 8)
    ncd = np.tile(np.arange(P)[:, None], (1, N))
    want = _brute_search(topk, ncd, src_part, np.ones(N, dtype=np.int64), e2p, "per_domain", labels, 8,
                         "lower_bound")
    assert np.array_equal(got, want)


def test_unknown_tie_break_is_refused():
    import pytest

    with pytest.raises(ValueError, match="tie_break"):
        NetSwapSearch(np.zeros((0, 1), dtype=np.int64), np.zeros((1, 0), dtype=np.int64), np.zeros(0, dtype=np.int64),
                      np.zeros(0, dtype=np.int64), num_items=1, num_domains=1, cost_mode="per_domain", tie_break="x")
