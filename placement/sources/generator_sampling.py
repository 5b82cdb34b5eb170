"""The sampling of :mod:`placement.sources.generator`: the generative model's constants, its
per-layer preference tables, the balancing bias, group-limited top-k routing and the window loop
(:func:`_generate`).  The model, its calibration and the determinism rules are in that module's
docstring; its public face is :func:`placement.sources.generator.generate_routing`.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

# Latent topics per data domain (topics are shared by all domains).
_TOPICS_PER_DOMAIN = 6
# Dirichlet concentration of the global topic frequencies (per topic).
_TOPIC_BASE_CONCENTRATION = 2.0
# Dirichlet concentration (per topic, relative to the global frequencies) of each domain's topic mix.
_TOPIC_MIX_CONCENTRATION = 4.0
# Probability that a token re-draws its topic from one layer to the next.
_TOPIC_SWITCH = 0.05
# Logit scale of the topic preferences.
_TOPIC_STRENGTH = 2.5
# Logit scale of the domain preferences at the first and at the last layer (sqrt(depth) between).
_DOMAIN_STRENGTH = (0.0, 1.0)
# Correlation of a preference table between consecutive layers (after relabelling the experts).
_LAYER_CORRELATION = 0.9
# Global data mix: weight of domain d is proportional to (d + 1) ** -_DOMAIN_MIX_DECAY.
_DOMAIN_MIX_DECAY = 0.7
# Standard deviation of tanh(z) for z ~ N(0, 1), so that skew * pop has standard deviation skew.
_TANH_STD = 0.6279287304737793
# Fixed-point iterations of the balancing bias, and Newton steps of its first iteration.
_BALANCE_ITERATIONS = 5
_NEWTON_STEPS = 6
# Tokens of one batch of the auxiliary-loss-free controller (_refine_bias).
_BALANCE_TOKENS = 16384
# Tokens routed at once (bounds the memory of the (tokens, experts) score block).
_TOKEN_BLOCK = 16384
# Standard Gumbel quantiles at the midpoints of 65,536 equal-probability bins.
_GUMBEL_TABLE = (-np.log(-np.log((np.arange(65536) + 0.5) / 65536))).astype(np.float32)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    x = float(value)
    if np.isnan(x) or (np.isinf(x) and not allow_inf) or not low <= x <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return x


def _global_domain_mix(num_domains: int) -> np.ndarray:
    """(num_domains,) global share of tokens of each data domain, decreasing, summing to 1."""
    weight = np.arange(1, num_domains + 1, dtype=np.float64) ** -_DOMAIN_MIX_DECAY
    return weight / weight.sum()


def _layer_tables(rng: np.random.Generator, rows: int, wiring: np.ndarray) -> np.ndarray:
    """Preference tables correlated across layers.

    Parameters
    ----------
    rng : numpy.random.Generator
    rows : int
        Rows per layer (domains or topics).
    wiring : numpy.ndarray
        (L, E) int: a permutation of expert ids per layer; row ``l`` relabels layer ``l - 1``.

    Returns
    -------
    numpy.ndarray
        (L, rows, E) float64 with standard normal entries; ``table[l][:, e]`` has correlation
        ``_LAYER_CORRELATION`` with ``table[l - 1][:, wiring[l, e]]``.
    """
    num_layers, num_experts = wiring.shape
    rho = _LAYER_CORRELATION
    out = np.empty((num_layers, rows, num_experts))
    out[0] = rng.standard_normal((rows, num_experts))
    for layer in range(1, num_layers):
        fresh = rng.standard_normal((rows, num_experts))
        out[layer] = rho * out[layer - 1][:, wiring[layer]] + np.sqrt(1.0 - rho**2) * fresh
    return out


def _draw_rows(rng: np.random.Generator, cdf: np.ndarray) -> np.ndarray:
    """One categorical draw per row of ``cdf`` ((n, m) cumulative probabilities) -> (n,) int."""
    u = rng.random((cdf.shape[0], 1))
    return np.minimum((u > cdf).sum(axis=1), cdf.shape[1] - 1)


def _refine_bias(
    rng: np.random.Generator,
    topic_logit: np.ndarray,
    domain_logit: np.ndarray,
    source_cdf: np.ndarray,
    topic_cdf: np.ndarray,
    top_k: int,
    num_groups: int,
    groups_per_token: int,
    rounds: int,
) -> np.ndarray:
    """(E,) bias correction from ``rounds`` steps of an auxiliary-loss-free controller.

    Emulates the per-expert bias of DeepSeek-V3's auxiliary-loss-free balancing (technical report,
    arXiv 2412.19437, section 2.1.2: after each step the bias of an overloaded expert goes down, of
    an underloaded one up), which steers on the *routed* load of the global batch, group-limited
    routing and per-expert popularity included, rather than on the analytic expectation of
    :func:`_balance_bias`.  Each round routes a fresh batch of ``_BALANCE_TOKENS`` tokens (each from
    a random source's data mix, like the window's tokens; a fixed count, so a window's parameters do
    not depend on ``tokens_per_source``) and moves each expert's bias by ``-rate * log(load /
    mean)`` (clipped to +-2): rate 1 for the first half of the rounds, then 1/2, 1/3, ..., so the
    correction averages the batches' sampling noise away.  The window's own tokens are never seen.

    Parameters
    ----------
    topic_logit : (C, E) topic logits with the bias and popularity so far.
    domain_logit : (D, E) domain logits.
    source_cdf : (S, D) cumulative data mix of each source; topic_cdf : (D, C) of each domain.

    Returns
    -------
    (E,) correction with mean 0, added to the bias.
    """
    num_sources = source_cdf.shape[0]
    num_experts = topic_logit.shape[1]
    n = _BALANCE_TOKENS
    corr = np.zeros(num_experts)
    d_logit32 = domain_logit.astype(np.float32)
    for r in range(rounds):
        t_logit32 = (topic_logit + corr).astype(np.float32)
        source = rng.integers(0, num_sources, size=n)
        domain = _draw_rows(rng, source_cdf[source])
        topic = _draw_rows(rng, topic_cdf[domain])
        load = np.zeros(num_experts)
        for start in range(0, n, _TOKEN_BLOCK):
            stop = min(n, start + _TOKEN_BLOCK)
            scores = t_logit32[topic[start:stop]] + d_logit32[domain[start:stop]]
            scores += _GUMBEL_TABLE.take(rng.integers(0, 65536, size=(stop - start, num_experts), dtype=np.uint16))
            load += np.bincount(_route(scores, top_k, num_groups, groups_per_token).reshape(-1), minlength=num_experts)
        # Full steps for the first half of the rounds (reach balance), then 1/2, 1/3, ... (average
        # the batches' noise away).
        half = rounds // 2
        rate = 1.0 if r < half else 1.0 / (r - half + 2)
        step = np.clip(np.log(np.maximum(load, 0.5) / load.mean()), -2.0, 2.0) * rate
        corr -= step - step.mean()
    return corr


def _top_k_inclusion(x: np.ndarray, theta: np.ndarray, top_k: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Approximate probabilities that each expert is in a Gumbel-top-k draw.

    Uses the Poisson-sampling approximation of sampling without replacement: expert ``e`` is
    included with probability ``1 - exp(-exp(x_e + theta))``, ``theta`` solved per row by Newton
    steps so that the probabilities sum to ``top_k``.

    Parameters
    ----------
    x : numpy.ndarray
        (rows, E) logits.
    theta : numpy.ndarray
        (rows, 1) starting offsets (the previous solution, or a lower bound).
    top_k : int
    steps : int
        Newton steps.

    Returns
    -------
    inclusion : numpy.ndarray
        (rows, E), each row summing to ~top_k.
    theta : numpy.ndarray
        (rows, 1) the offsets reached.
    """
    for _ in range(steps):
        y = np.exp(x + theta)
        ey = np.exp(-y)
        excess = (1.0 - ey).sum(axis=1, keepdims=True) - top_k
        slope = (y * ey).sum(axis=1, keepdims=True)
        theta = theta - np.clip(excess / np.maximum(slope, 1e-12), -2.0, 2.0)
    return 1.0 - np.exp(-np.exp(x + theta)), theta


def _balance_bias(logits: np.ndarray, weight: np.ndarray, top_k: int) -> np.ndarray:
    """Per-expert bias that makes the expected load of a token mix flat (aux-loss-free balancing).

    Parameters
    ----------
    logits : numpy.ndarray
        (rows, E) logits of each kind of token (a (domain, topic) pair), before the bias.
    weight : numpy.ndarray
        (rows,) share of tokens of each kind, summing to 1.
    top_k : int

    Returns
    -------
    numpy.ndarray
        (E,) bias with mean 0.
    """
    num_experts = logits.shape[1]
    bias = np.zeros(num_experts)
    if top_k >= num_experts:
        return bias
    target = top_k / num_experts
    x = logits - logits.max(axis=1, keepdims=True)
    theta = np.log(top_k) - np.log(np.exp(x).sum(axis=1, keepdims=True))
    for it in range(_BALANCE_ITERATIONS):
        inclusion, theta = _top_k_inclusion(x + bias, theta, top_k, _NEWTON_STEPS if it == 0 else 2)
        load = (weight[:, None] * inclusion).sum(axis=0)
        step = np.clip(np.log(np.maximum(load, 1e-300) / target), -3.0, 3.0)
        bias -= step - step.mean()
    return bias


def _route(scores: np.ndarray, top_k: int, num_groups: int, groups_per_token: int) -> np.ndarray:
    """Top-k experts of each token, with DeepSeek-V3 group-limited routing.

    Parameters
    ----------
    scores : numpy.ndarray
        (n, E) float scores.
    top_k : int
    num_groups : int
        Groups of contiguous expert ids; 1 disables group-limited routing.
    groups_per_token : int
        Groups a token may use when ``num_groups > 1``.

    Returns
    -------
    numpy.ndarray
        (n, top_k) uint16 expert ids, ascending within a row.
    """
    n, num_experts = scores.shape
    if num_groups == 1 or groups_per_token == num_groups:
        return _top_k_sorted(scores, top_k).astype(np.uint16)
    # Step 1: score each group by the sum of its two best scores; keep the best groups.
    size = num_experts // num_groups
    grouped = scores.reshape(n, num_groups, size)
    best = min(2, size)
    group_score = np.sort(grouped, axis=2)[:, :, size - best :].sum(axis=2)
    cut = num_groups - groups_per_token
    kept = np.sort(np.argpartition(group_score, cut, axis=1)[:, cut:], axis=1)  # (n, groups_per_token)
    # Step 2: top-k among the experts of the kept groups, mapped back to expert ids.
    candidates = np.take_along_axis(grouped, kept[:, :, None], axis=1).reshape(n, groups_per_token * size)
    local = _top_k_sorted(candidates, top_k)
    ids = np.take_along_axis(kept, local // size, axis=1) * size + local % size
    return ids.astype(np.uint16)


def _top_k_sorted(scores: np.ndarray, top_k: int) -> np.ndarray:
    """(n, m) scores -> (n, top_k) int64 column indices of each row's top-k, ascending."""
    n, m = scores.shape
    cut = m - top_k
    kth = np.partition(scores, cut, axis=1)[:, cut, None]
    chosen = scores >= kth
    ties = np.flatnonzero(np.count_nonzero(chosen, axis=1) != top_k)
    if ties.size:  # equal scores at the cut: let argpartition pick exactly top_k
        chosen[ties] = False
        picked = np.argpartition(scores[ties], cut, axis=1)[:, cut:]
        chosen[ties[:, None], picked] = True
    flat = np.flatnonzero(chosen).reshape(n, top_k)
    flat -= np.arange(0, n * m, m)[:, None]
    return flat


def _generate(
    *,
    seed: int,
    num_layers: int,
    num_sources: int,
    tokens_per_source: int,
    num_windows: int,
    num_experts: int,
    top_k: int,
    num_groups: int,
    groups_per_token: int,
    num_data_domains: int,
    source_mix_concentration: float,
    skew: float,
    drift: float,
    topic_strength: float = _TOPIC_STRENGTH,
    balance_rounds: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """`generate_routing` plus each token's data domain, (num_windows, num_sources, tokens) int64."""
    seed = _check_int("seed", seed, 0)
    num_layers = _check_int("num_layers", num_layers, 1)
    num_sources = _check_int("num_sources", num_sources, 1)
    tokens_per_source = _check_int("tokens_per_source", tokens_per_source, 1)
    num_windows = _check_int("num_windows", num_windows, 1)
    num_experts = _check_int("num_experts", num_experts, 1)
    top_k = _check_int("top_k", top_k, 1)
    num_groups = _check_int("num_groups", num_groups, 1)
    groups_per_token = _check_int("groups_per_token", groups_per_token, 1)
    num_data_domains = _check_int("num_data_domains", num_data_domains, 1)
    concentration = _check_float("source_mix_concentration", source_mix_concentration, 0.0, np.inf, allow_inf=True)
    skew = _check_float("skew", skew, 0.0, np.inf)
    drift = _check_float("drift", drift, 0.0, 1.0)
    topic_strength = _check_float("topic_strength", topic_strength, 0.0, np.inf)
    balance_rounds = _check_int("balance_rounds", balance_rounds, 0)
    if concentration == 0.0:
        raise ValueError("source_mix_concentration must be > 0 (np.inf: every source has the global mix)")
    if num_experts > 65536:
        raise ValueError(f"num_experts must be <= 65536 (ids are uint16), got {num_experts}")
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
    if num_groups > 1:
        if groups_per_token > num_groups:
            raise ValueError(f"groups_per_token must be <= num_groups ({num_groups}), got {groups_per_token}")
        if groups_per_token * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"groups_per_token ({groups_per_token}) groups of {num_experts // num_groups} experts "
                f"hold fewer than top_k ({top_k}) experts"
            )

    L, E, D = num_layers, num_experts, num_data_domains
    C = _TOPICS_PER_DOMAIN * D
    N = num_sources * tokens_per_source
    # A fourth child for the balancing rounds: spawn(4)[:3] equals spawn(3), so the other streams
    # (and every instance built without rounds) are unchanged.
    structure_seq, drift_seq, token_seq, balance_seq = np.random.SeedSequence(seed).spawn(4)

    # Step 1: the fixed structure: data mixes, topic mixes, layer wiring, preference tables.
    rng = np.random.default_rng(structure_seq)
    mix = _global_domain_mix(D)
    if np.isinf(concentration):
        source2mix = np.tile(mix, (num_sources, 1))
    else:
        source2mix = rng.dirichlet(concentration * mix, size=num_sources)  # (S, D)
    topic_base = rng.dirichlet(np.full(C, _TOPIC_BASE_CONCENTRATION))
    domain2topic = rng.dirichlet(_TOPIC_MIX_CONCENTRATION * C * topic_base, size=D)  # (D, C)
    kind_weight = (mix[:, None] * domain2topic).reshape(D * C)  # share of (domain, topic) pairs
    wiring = np.stack([rng.permutation(E) for _ in range(L)])
    domain_pref = _layer_tables(rng, D, wiring)  # (L, D, E)
    topic_pref = _layer_tables(rng, C, wiring)  # (L, C, E)
    pop = rng.standard_normal((L, E))  # popularity before tanh
    depth = np.linspace(0.0, 1.0, L) if L > 1 else np.zeros(1)
    domain_strength = _DOMAIN_STRENGTH[0] + (_DOMAIN_STRENGTH[1] - _DOMAIN_STRENGTH[0]) * np.sqrt(depth)
    source_cdf = np.cumsum(source2mix, axis=1)
    topic_cdf = np.cumsum(domain2topic, axis=1)

    drift_rng = np.random.default_rng(drift_seq)
    token_rngs = [np.random.default_rng(s) for s in token_seq.spawn(num_windows)]
    balance_rngs = [np.random.default_rng(s) for s in balance_seq.spawn(num_windows)]
    topk = np.empty((num_windows, L, num_sources, tokens_per_source, top_k), dtype=np.uint16)
    token2domain = np.empty((num_windows, num_sources, tokens_per_source), dtype=np.int64)
    keep, shake = np.sqrt(1.0 - drift**2), drift
    for w in range(num_windows):
        # Step 2: drift the parameters from the previous window.
        if w > 0 and drift > 0.0:
            domain_pref = keep * domain_pref + shake * drift_rng.standard_normal(domain_pref.shape)
            topic_pref = keep * topic_pref + shake * drift_rng.standard_normal(topic_pref.shape)
            pop = keep * pop + shake * drift_rng.standard_normal(pop.shape)

        # Step 3: sample the window's tokens: domain from the source's mix, topic from the domain's.
        trng = token_rngs[w]
        u = trng.random((num_sources, tokens_per_source, 1))
        domain = np.minimum((u > source_cdf[:, None, :]).sum(axis=2), D - 1).reshape(N)
        token2domain[w] = domain.reshape(num_sources, tokens_per_source)
        topic = _draw_rows(trng, topic_cdf[domain])

        # Step 4: route layer by layer.
        for layer in range(L):
            if layer > 0 and _TOPIC_SWITCH > 0.0:
                switch = np.flatnonzero(trng.random(N) < _TOPIC_SWITCH)
                topic[switch] = _draw_rows(trng, topic_cdf[domain[switch]])
            topic_logit = topic_strength * topic_pref[layer]  # (C, E)
            domain_logit = domain_strength[layer] * domain_pref[layer]  # (D, E)
            kind_logit = (domain_logit[:, None, :] + topic_logit[None, :, :]).reshape(D * C, E)
            bias = _balance_bias(kind_logit, kind_weight, top_k)
            popularity = skew * np.tanh(pop[layer]) / _TANH_STD
            if balance_rounds:
                bias = bias + _refine_bias(
                    balance_rngs[w], topic_logit + bias + popularity, domain_logit, source_cdf, topic_cdf,
                    top_k, num_groups, groups_per_token, balance_rounds,
                )
            topic_logit32 = (topic_logit + bias + popularity).astype(np.float32)
            domain_logit32 = domain_logit.astype(np.float32)
            out = topk[w, layer].reshape(N, top_k)
            for start in range(0, N, _TOKEN_BLOCK):
                stop = min(N, start + _TOKEN_BLOCK)
                scores = topic_logit32[topic[start:stop]]
                scores += domain_logit32[domain[start:stop]]
                scores += _GUMBEL_TABLE.take(trng.integers(0, 65536, size=(stop - start, E), dtype=np.uint16))
                out[start:stop] = _route(scores, top_k, num_groups, groups_per_token)
    return topk, token2domain
