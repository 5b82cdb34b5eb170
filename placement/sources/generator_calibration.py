"""The statistics :mod:`placement.sources.generator` is calibrated against (:func:`describe_calibration`),
measured with the functions ``placement stats`` uses (:mod:`placement.core.stats`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from placement.core.stats import coactivation_share, expert_counts, mean_pairwise_tv, normalise, total_variation
from placement.sources.generator_sampling import _check_int

# The statistics are shared with `placement stats` (placement/core/stats.py), so that synthetic and
# imported routing are measured by the same functions.
_total_variation = total_variation
_normalise = normalise
_expert_counts = expert_counts
_mean_pairwise_tv = mean_pairwise_tv
_coactivation_share = coactivation_share


def describe_calibration(
    topk: np.ndarray, num_experts: int, *, num_groups: int = 1, distance: int = 7
) -> dict[str, Any]:
    """Measure the routing statistics that the generator is calibrated against.

    Statistics are per layer of window 0, except ``window_tv``. Per-layer values come as arrays so
    that a caller can take medians or look at depth trends. The ``*_null`` entries give the same
    statistic after shuffling tokens (across layers for co-activation, across sources for the
    source statistic): what independent routing gives at this sample size, the fair baseline for
    small samples. The shuffles use a fixed seed, so the result is deterministic.

    Parameters
    ----------
    topk : numpy.ndarray
        (num_windows, num_layers, num_sources, tokens_per_source, top_k) integer expert ids, as
        returned by `generate_routing`; a 4-d array is taken as a single window.
    num_experts : int
        Experts per layer.
    num_groups : int, default 1
        Groups of contiguous expert ids, for ``groups_per_token``.
    distance : int, default 7
        Layer distance of the co-activation statistics.

    Returns
    -------
    dict
        ``tokens_per_layer`` : int, sampled tokens per layer and window.
        ``max_mean_load`` : (L,) busiest expert's activations over the mean.
        ``top_eighth_share`` : (L,) share of activations on the ``max(1, E // 8)`` busiest experts
        (the top 32 of 256).
        ``coactivation_top8``, ``coactivation_top8_null`` : (L - distance,) for layer ``l``, the
        share of the layer-``l + distance`` activations of each expert's tokens that fall on that
        expert's 8 most frequent layer-``l + distance`` experts, pooled over experts weighted by
        load (uniform routing with unlimited tokens: ``8 / E``). Empty if ``L <= distance``.
        ``coactivation_top_eighth``, ``coactivation_top_eighth_null`` : the same with the
        ``max(1, E // 8)`` most frequent experts (uniform: 1/8, comparable to OLMoE's 8 of 64).
        ``source_tv``, ``source_tv_null`` : (L,) mean over pairs of sources of the total variation
        between their expert-load distributions (0 with one source).
        ``groups_per_token`` : (L,) mean number of distinct expert groups per token.
        ``window_tv`` : (num_windows - 1,) for each later window, the total variation between
        its per-layer load distribution and window 0's, averaged over layers.

    Raises
    ------
    ValueError
        If ``topk`` is not 4- or 5-dimensional, holds ids outside ``[0, num_experts)``, or
        ``num_groups`` does not divide ``num_experts``.

    Examples
    --------
    >>> from placement.sources.generator import generate_routing
    >>> topk = generate_routing(seed=0, num_layers=9, num_sources=4, tokens_per_source=64,
    ...                         num_windows=2, num_experts=32, top_k=4)
    >>> stats = describe_calibration(topk, 32)
    >>> stats["max_mean_load"].shape, stats["coactivation_top8"].shape
    ((9,), (2,))
    """
    num_experts = _check_int("num_experts", num_experts, 1)
    num_groups = _check_int("num_groups", num_groups, 1)
    distance = _check_int("distance", distance, 1)
    topk = np.asarray(topk)
    if topk.ndim == 4:
        topk = topk[None]
    if topk.ndim != 5:
        raise ValueError(f"topk must have shape (windows, layers, sources, tokens, top_k), got {topk.shape}")
    if not np.issubdtype(topk.dtype, np.integer):
        raise ValueError(f"topk must hold integer expert ids, got dtype {topk.dtype}")
    if topk.size and (topk.min() < 0 or topk.max() >= num_experts):
        raise ValueError(f"topk holds expert ids outside [0, {num_experts})")
    if num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")

    num_windows, L, S, T, k = topk.shape
    E = num_experts
    N = S * T
    top_eighth = max(1, E // 8)
    top8 = min(8, E)
    rng = np.random.default_rng(0)
    window0 = topk[0]

    loads = np.stack([_expert_counts(window0[layer], E) for layer in range(L)])  # (L, E)
    mean_load = np.maximum(loads.mean(axis=1), 1e-12)
    sorted_loads = np.sort(loads, axis=1)
    total = np.maximum(loads.sum(axis=1), 1)

    shuffled = rng.permutation(N)
    source_tv = np.array([_mean_pairwise_tv(window0[layer], E) for layer in range(L)])
    source_tv_null = np.array(
        [_mean_pairwise_tv(window0[layer].reshape(N, k)[shuffled].reshape(S, T, k), E) for layer in range(L)]
    )

    pairs = max(0, L - distance)
    co8, co8_null, co_eighth, co_eighth_null = (np.zeros(pairs) for _ in range(4))
    for layer in range(pairs):
        first = window0[layer].reshape(N, k)
        later = window0[layer + distance].reshape(N, k)
        later_null = later[rng.permutation(N)]
        co8[layer] = _coactivation_share(first, later, E, top8)
        co8_null[layer] = _coactivation_share(first, later_null, E, top8)
        co_eighth[layer] = _coactivation_share(first, later, E, top_eighth)
        co_eighth_null[layer] = _coactivation_share(first, later_null, E, top_eighth)

    group = np.sort(window0.reshape(L, N, k) // (E // num_groups), axis=2)
    groups_per_token = (1 + np.count_nonzero(np.diff(group, axis=2), axis=2)).mean(axis=1)

    share0 = _normalise(loads)
    window_tv = np.array(
        [
            _total_variation(share0, _normalise(np.stack([_expert_counts(topk[w, layer], E) for layer in range(L)])))
            .mean()
            for w in range(1, num_windows)
        ]
    )
    return {
        "tokens_per_layer": N,
        "max_mean_load": sorted_loads[:, -1] / mean_load,
        "top_eighth_share": sorted_loads[:, E - top_eighth :].sum(axis=1) / total,
        "coactivation_top8": co8,
        "coactivation_top8_null": co8_null,
        "coactivation_top_eighth": co_eighth,
        "coactivation_top_eighth_null": co_eighth_null,
        "source_tv": source_tv,
        "source_tv_null": source_tv_null,
        "groups_per_token": groups_per_token,
        "window_tv": window_tv,
    }


def _domain_load_tv(
    topk_window: np.ndarray, token2domain: np.ndarray, num_experts: int, num_domains: int
) -> np.ndarray:
    """Total variation between the expert-load distributions of data domains.

    Parameters
    ----------
    topk_window : numpy.ndarray
        (L, S, T, k) expert ids of one window.
    token2domain : numpy.ndarray
        (S, T) data domain of each token of that window (from `_generate`).
    num_experts, num_domains : int

    Returns
    -------
    numpy.ndarray
        (L, num_domains, num_domains) symmetric, zero diagonal.
    """
    L, S, T, k = topk_window.shape
    domain = np.repeat(token2domain.reshape(-1).astype(np.int64), k)
    out = np.zeros((L, num_domains, num_domains))
    for layer in range(L):
        flat = domain * num_experts + topk_window[layer].reshape(-1).astype(np.int64)
        counts = np.bincount(flat, minlength=num_domains * num_experts).reshape(num_domains, num_experts)
        share = _normalise(counts)
        out[layer] = _total_variation(share[:, None, :], share[None, :, :])
    return out
