"""Tests of placement.sources.generator: shapes, determinism, group-limited routing, calibration, drift."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.sources import generator, generator_calibration
from placement.sources.generator import describe_calibration, generate_routing

SMALL = dict(num_layers=3, num_sources=4, tokens_per_source=16, num_windows=2, num_experts=32, top_k=4)

# A moderately sized DeepSeek-like case: 8,192 sampled tokens per layer, 256 experts, top-8,
# 8 groups of which 4 per token; 16 layers so that co-activation 7 layers apart has 9 pairs.
MODERATE = dict(
    num_layers=16,
    num_sources=32,
    tokens_per_source=256,
    num_windows=2,
    num_experts=256,
    top_k=8,
    num_groups=8,
    groups_per_token=4,
)
DEFAULTS = dict(num_data_domains=6, source_mix_concentration=10.0, skew=0.65, drift=0.1)


@pytest.fixture(scope="module")
def moderate():
    """(topk, token2domain, stats) of the moderate case with default calibration parameters."""
    topk, token2domain = generator._generate(seed=0, **MODERATE, **DEFAULTS)
    stats = describe_calibration(topk, MODERATE["num_experts"], num_groups=MODERATE["num_groups"])
    return topk, token2domain, stats


def _groups_used(topk: np.ndarray, group_size: int) -> np.ndarray:
    """Number of distinct groups of each token (last axis holds a token's experts)."""
    groups = np.sort(topk.astype(np.int64) // group_size, axis=-1)
    return 1 + np.count_nonzero(np.diff(groups, axis=-1), axis=-1)


# --- shape, dtype, per-token validity -------------------------------------------------------------


@pytest.mark.parametrize("groups", [dict(), dict(num_groups=4, groups_per_token=2)])
def test_shape_and_dtype(groups):
    topk = generate_routing(seed=1, **SMALL, **groups)
    assert topk.shape == (2, 3, 4, 16, 4)
    assert topk.dtype == np.uint16
    assert topk.max() < SMALL["num_experts"]


@pytest.mark.parametrize("groups", [dict(), dict(num_groups=8, groups_per_token=3)])
def test_experts_distinct_and_sorted_within_a_token(groups):
    topk = generate_routing(seed=2, **{**SMALL, "num_experts": 64, "top_k": 6}, **groups)
    assert (np.diff(topk.astype(np.int64), axis=-1) > 0).all()


def test_top_k_equal_to_num_experts_routes_to_every_expert():
    topk = generate_routing(seed=0, **{**SMALL, "num_experts": 4, "top_k": 4})
    assert (topk == np.arange(4)).all()


# --- determinism ---------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes():
    kwargs = dict(**SMALL, num_groups=4, groups_per_token=2)
    a = generate_routing(seed=7, **kwargs)
    b = generate_routing(seed=7, **kwargs)
    assert a.tobytes() == b.tobytes()


def test_different_seed_gives_different_routing():
    a = generate_routing(seed=7, **SMALL)
    b = generate_routing(seed=8, **SMALL)
    assert a.tobytes() != b.tobytes()


def test_more_windows_extend_the_series():
    two = generate_routing(seed=3, **SMALL)
    three = generate_routing(seed=3, **{**SMALL, "num_windows": 3})
    assert three[:2].tobytes() == two.tobytes()


# --- group-limited routing -----------------------------------------------------------------------------


def test_tokens_never_touch_more_than_groups_per_token_groups():
    topk = generate_routing(seed=4, **{**SMALL, "num_experts": 64, "top_k": 6}, num_groups=8, groups_per_token=2)
    used = _groups_used(topk, 64 // 8)
    assert used.max() <= 2
    assert used.mean() > 1.5  # the limit binds: tokens do spread over both allowed groups


def _reference_route(scores: np.ndarray, top_k: int, num_groups: int, groups_per_token: int) -> np.ndarray:
    """The DeepSeek-V3 rule written plainly, one token at a time."""
    n, num_experts = scores.shape
    size = num_experts // num_groups
    out = np.empty((n, top_k), dtype=np.int64)
    for t in range(n):
        row = scores[t].astype(np.float64)
        allowed = np.ones(num_experts, dtype=bool)
        if num_groups > 1:
            group_score = [np.sort(row[g * size : (g + 1) * size])[-2:].sum() for g in range(num_groups)]
            kept = np.argsort(group_score)[::-1][:groups_per_token]
            allowed[:] = False
            for g in kept:
                allowed[g * size : (g + 1) * size] = True
        candidates = np.flatnonzero(allowed)
        best = candidates[np.argsort(row[candidates])[::-1][:top_k]]
        out[t] = np.sort(best)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_groups=st.sampled_from([1, 2, 4, 8]),
    group_size=st.sampled_from([2, 3, 8]),
    data=st.data(),
)
def test_route_matches_the_plain_rule(seed, num_groups, group_size, data):
    num_experts = num_groups * group_size
    groups_per_token = data.draw(st.integers(1, num_groups))
    allowed = groups_per_token * group_size if num_groups > 1 else num_experts
    top_k = data.draw(st.integers(1, allowed))
    scores = np.random.default_rng(seed).standard_normal((40, num_experts)).astype(np.float32)
    got = generator._route(scores.copy(), top_k, num_groups, groups_per_token)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, _reference_route(scores, top_k, num_groups, groups_per_token))


def test_route_with_tied_scores_still_picks_top_k_distinct_experts():
    scores = np.zeros((5, 32), dtype=np.float32)
    scores[:, ::2] = 1.0  # 16 tied maxima per token
    got = generator._route(scores, 4, 4, 2).astype(np.int64)
    assert (np.diff(got, axis=1) > 0).all()
    assert _groups_used(got, 8).max() <= 2
    assert (got % 2 == 0).all()


# --- calibration --------------------------------------------------------------------------------------


def test_load_skew_in_training_band(moderate):
    _, _, stats = moderate
    assert stats["tokens_per_layer"] == 8192
    assert 1.5 <= np.median(stats["max_mean_load"]) <= 3.0
    assert 0.20 <= np.median(stats["top_eighth_share"]) <= 0.30


def test_skew_zero_flattens_loads(moderate):
    _, _, stats = moderate
    flat = generate_routing(seed=0, **{**MODERATE, "num_windows": 1}, skew=0.0)
    flat_stats = describe_calibration(flat, MODERATE["num_experts"])
    assert np.median(flat_stats["max_mean_load"]) < 1.6
    assert np.median(flat_stats["max_mean_load"]) < np.median(stats["max_mean_load"]) - 0.5


def test_domain_specialisation_grows_with_depth(moderate):
    topk, token2domain, _ = moderate
    tv = generator._domain_load_tv(topk[0], token2domain[0], MODERATE["num_experts"], 6)
    pairs = np.triu_indices(6, 1)
    mean_tv = np.array([layer_tv[pairs].mean() for layer_tv in tv])
    assert mean_tv[-4:].mean() > mean_tv[:4].mean() + 0.1
    assert mean_tv[-1] < 0.63  # below OLMoE's deepest layer: aux-loss-free balance specialises less


def test_sources_differ_more_in_deep_layers(moderate):
    _, _, stats = moderate
    excess = stats["source_tv"] - stats["source_tv_null"]
    assert excess.mean() > 0
    assert excess[-4:].mean() > excess[:4].mean()


def test_coactivation_above_independent_routing(moderate):
    _, _, stats = moderate
    assert stats["coactivation_top_eighth"].shape == (MODERATE["num_layers"] - 7,)
    assert (stats["coactivation_top_eighth"] > stats["coactivation_top_eighth_null"] + 0.05).all()
    assert (stats["coactivation_top8"] > stats["coactivation_top8_null"] + 0.03).all()
    # moderate, not extreme: OLMoE's band for 1/8 of the experts is 30-55 %
    assert 0.25 <= np.median(stats["coactivation_top_eighth"]) <= 0.55


def test_group_statistic(moderate):
    _, _, stats = moderate
    assert (stats["groups_per_token"] <= 4).all()
    assert (stats["groups_per_token"] > 3.5).all()


def test_uniform_random_routing_measures_as_its_null():
    rng = np.random.default_rng(0)
    topk = np.sort(rng.random((1, 9, 16, 512, 64)).argsort(axis=-1)[..., :8], axis=-1).astype(np.uint16)
    stats = describe_calibration(topk, 64)
    np.testing.assert_allclose(stats["coactivation_top_eighth"], stats["coactivation_top_eighth_null"], atol=0.01)
    np.testing.assert_allclose(stats["source_tv"], stats["source_tv_null"], atol=0.01)
    assert stats["max_mean_load"].max() < 1.3
    assert stats["window_tv"].shape == (0,)


def test_identical_sources_when_concentration_is_infinite():
    kwargs = {**MODERATE, "num_layers": 4, "num_windows": 1}
    same = describe_calibration(generate_routing(seed=0, **kwargs, source_mix_concentration=np.inf), 256)
    apart = describe_calibration(generate_routing(seed=0, **kwargs, source_mix_concentration=0.5), 256)
    same_excess = (same["source_tv"] - same["source_tv_null"]).mean()
    apart_excess = (apart["source_tv"] - apart["source_tv_null"]).mean()
    assert abs(same_excess) < 0.01
    assert apart_excess > same_excess + 0.02


# --- drift -------------------------------------------------------------------------------------------


def test_windows_differ_but_held_out_is_closer_than_another_seed(moderate):
    topk, _, stats = moderate
    assert topk[0].tobytes() != topk[1].tobytes()
    other, _ = generator._generate(seed=1, **{**MODERATE, "num_windows": 1}, **DEFAULTS)
    across_seeds = describe_calibration(np.stack([topk[0], other[0]]), MODERATE["num_experts"])
    assert stats["window_tv"][0] < 0.5 * across_seeds["window_tv"][0]


def test_more_drift_moves_loads_further():
    kwargs = {**MODERATE, "num_layers": 4}
    still = describe_calibration(generate_routing(seed=5, **kwargs, drift=0.0), 256)
    moving = describe_calibration(generate_routing(seed=5, **kwargs, drift=0.5), 256)
    assert moving["window_tv"][0] > still["window_tv"][0] + 0.03


# --- argument checks and docs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(num_groups=3), ValueError),  # does not divide 32 experts
        (dict(num_groups=4, groups_per_token=5), ValueError),
        (dict(num_groups=8, groups_per_token=1, top_k=5), ValueError),  # 1 group of 4 < top_k
        (dict(top_k=33), ValueError),
        (dict(drift=1.5), ValueError),
        (dict(skew=-0.1), ValueError),
        (dict(source_mix_concentration=0.0), ValueError),
        (dict(num_layers=0), ValueError),
        (dict(seed=-1), ValueError),
        (dict(num_layers=2.0), TypeError),
        (dict(skew="high"), TypeError),
    ],
)
def test_bad_arguments_are_rejected(change, error):
    with pytest.raises(error):
        generate_routing(**{"seed": 0, **SMALL, **change})


def test_describe_calibration_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="outside"):
        describe_calibration(np.full((1, 2, 2, 2, 2), 9, dtype=np.uint16), 8)


@pytest.mark.parametrize("module", [generator, generator_calibration], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
