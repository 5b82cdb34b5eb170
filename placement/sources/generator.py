"""Seeded generator of synthetic MoE routing statistics, calibrated to published measurements.

`generate_routing` draws, for every window, MoE layer, data-parallel source and sampled token,
the token's top-k expert ids. `describe_calibration` measures the statistics that the generator
is calibrated against, so that any routing array (synthetic or recorded) can be compared.

Generative model
----------------
One routing *window* is a batch of freshly sampled tokens routed with that window's parameters.

1. Data. There are ``num_data_domains`` domains (think web, books, code, arxiv, wiki, math) with
   a fixed global mix proportional to ``(d + 1) ** -0.7`` (32/20/15/12/10/9 % for six domains).
   Source (data-parallel rank) ``s`` draws its own mix once,
   ``mix_s ~ Dirichlet(source_mix_concentration * global_mix)``, and keeps it in every window:
   the per-source differences are persistent, as with a loader that shards data by domain. An
   infinite concentration gives every source the global mix (a fully shuffled loader).
2. Topics. There are ``6 * num_data_domains`` latent topics shared by all domains; each domain has
   its own topic mix (Dirichlet around a global topic mix, so domains overlap but differ). A token
   draws its domain from its source's mix and its topic from its domain's mix. Topics are sticky
   across depth: at each layer a token re-draws its topic from its domain's mix with probability
   0.05, so co-activation fades with distance between layers.
3. Logits. At layer ``l`` of ``L`` (depth ``f = l / (L - 1)``) the router logit of expert ``e``
   for a token of domain ``d`` and topic ``c`` is::

       2.5 * topic[l, c, e] + sqrt(f) * domain[l, d, e] + bias[l, e] + skew * pop[l, e] + gumbel

   ``topic`` and ``domain`` are standard normal preference tables, correlated across consecutive
   layers (``table[l+1] = 0.9 * table[l][:, wiring_l] + sqrt(1 - 0.9**2) * noise``, with a random
   relabelling ``wiring_l`` of the experts, because expert ids carry no meaning across layers):
   the tokens of one expert concentrate on a few experts of the next layers. Domain
   specialisation grows with depth through ``sqrt(f)``. ``bias`` emulates aux-loss-free
   balancing, which steers on the global batch: it is solved per layer and window so that the
   *expected* load of the global data mix is flat (Poisson-sampling approximation of top-k
   inclusion); single sources and single windows remain unbalanced.  With ``balance_rounds > 0``
   (:data:`AUX_LOSS_FREE_PARAMS`) a bias controller then corrects it on fresh routed batches, as
   DeepSeek-V3's per-step bias update does, so the global batch's routed load is flat up to the
   controller's residual (docs/imbalance.md). ``pop`` is a residual per-expert
   popularity, ``tanh`` of a standard normal rescaled to unit variance (bounded, so no expert runs
   away), scaled by ``skew``. ``gumbel`` is standard Gumbel noise (a 65,536-level quantile
   table), which makes the top-k a sample without replacement from the softmax of the logits.
4. Routing. Top-k of the noisy logits. With ``num_groups > 1`` the DeepSeek-V3 group-limited
   rule applies: experts ``g*E/G .. (g+1)*E/G - 1`` form group ``g``; a token scores each group
   by the sum of its two best logits, keeps the best ``groups_per_token`` groups and takes its
   top-k experts inside them.
5. Drift. Window ``w + 1`` perturbs every parameter table of window ``w`` as
   ``x <- sqrt(1 - drift**2) * x + drift * noise`` (a stationary random walk of popularity,
   topic and domain preferences), re-solves the balancing bias and samples fresh tokens. Source
   mixes, topic mixes and the expert relabelling between layers do not drift.

Calibration
-----------
Targets (docs/design.md section 4), all for training with aux-loss-free balancing, which is flatter
than inference traces:

- per-layer busiest-expert load over mean load: 1.5-3.0 with ~8k sampled tokens per layer (the
  DeepSeek inference traces, median 6x, are the upper reference; OLMoE on mixed domains
  2.1-2.75; Mixtral 1.08-1.33 the lower one);
- the busiest 1/8 of experts (32 of 256) carry 20-30 % of activations (DeepSeek inference: 25-50 %);
- domain specialisation grows with depth, below OLMoE's code-vs-web total variation of
  0.23 / 0.50 / 0.63 at layers 0 / 7 / 15 of 16;
- across layers 7 apart, an expert's tokens put 30-55 % of their activations on the expert's
  most frequent 1/8 of next-layer experts (OLMoE: 8 of 64; independence gives 12.5 %). We aim at
  the low end of that band.

Measured with `describe_calibration` and, for data domains, with the token domains that the
generator knows (medians over layers, [min-max] in brackets; seed 0, window 0, all other
arguments at their defaults). "dsv3": 58 layers, 64 sources x 128 tokens = 8,192 sampled tokens
per layer, 256 experts, top-8, 8 groups, 4 groups per token, 2 windows. "e128": 48 layers,
64 x 128 tokens, 128 experts, top-8, no groups, 2 windows. "dsv3 x8": dsv3 with 1,024 tokens per
source (65,536 per layer), where sampling noise no longer hides the structure. "null" is the
same statistic after shuffling tokens (what independent routing gives at that sample size).

=========================================  ==================  ==================  ==================
statistic                                  dsv3                e128                dsv3 x8
=========================================  ==================  ==================  ==================
max/mean expert load per layer             2.29 [2.05-2.61]    1.98 [1.79-2.25]    2.26 [2.06-2.56]
share of the busiest 1/8 of experts        0.24 [0.23-0.26]    0.22 [0.20-0.24]    0.24 [0.23-0.26]
co-activation d=7, top 1/8 share (null)    0.39 (0.27)         0.33 (0.23)         0.38 (0.24)
co-activation d=7, top-8 share (null)      0.15 (0.08)         0.20 (0.12)         0.15 (0.07)
source load TV, mean over pairs (null)     0.28 (0.26)         0.20 (0.19)         0.12 (0.09)
web-vs-code load TV, layer 0/mid/last      0.12 / 0.29 / 0.41  0.10 / 0.32 / 0.34  0.11 / 0.29 / 0.41
mean pairwise domain TV, layer 0/mid/last  0.14 / 0.32 / 0.42  0.12 / 0.31 / 0.38  0.11 / 0.31 / 0.41
distinct groups per token                  3.97                1                   3.97
window 0 vs window 1 load TV               0.040               0.030               0.025
=========================================  ==================  ==================  ==================

Reading: max/mean and the top-1/8 share sit inside their target bands at ~8k tokens and barely
move with 8x the tokens (they are intrinsic, not sampling noise). Domain specialisation rises with
depth to about 2/3 of OLMoE's. Co-activation 7 layers apart is 0.38 of activations on 1/8 of the
experts, the low end of OLMoE's 30-55 %, against 0.24 for independent routing with the same load
skew. Sources differ (0.12 against 0.09 with many tokens), but with 128 tokens per source the
difference is small next to the sampling noise, as on a real cluster. With ``skew=0`` the dsv3
loads give max/mean 1.27 [1.18-1.62] and a top-1/8 share of 0.14.

The same functions measure any instance: ``placement stats INSTANCE`` (:func:`placement.core.stats.routing_stats`,
which `describe_calibration` shares its statistics with) on the committed instances, whose routing
this generator drew, is what an imported instance is compared against (medians over MoE layers,
fit window; "null" as above; co-activation between consecutive MoE layers, on the busiest-partner
1/8 of experts):

=========================================  ==========  ==========  ==========
``placement stats``                        tiny        dsv3_256    qwen3_256
=========================================  ==========  ==========  ==========
tokens per source, fit / held-out          32 / 32     128 / 64    96 / 64
expert load max/mean, all sources          1.375       2.275       2.029
expert load max/mean, per source           1.766       3.635       2.922
source difference, pairwise TV (null)      0.18 (0.18) 0.27 (0.26) 0.23 (0.21)
co-activation d=1, top 1/8 share (null)    0.23 (0.18) 0.46 (0.27) 0.39 (0.23)
fit vs held-out load TV                    0.060       0.047       0.037
=========================================  ==========  ==========  ==========

Beside the real model's routing (``instances/real_ep64``: the project's own small DeepSeek-V3-style
MoE trained on text, docs/real_routing.md) with the generator's for the same shape (its defaults,
seed 0: 5 MoE layers, 64 sources x 256 fit / 128 held-out tokens, 64 experts, top-8, 8 groups, 4
per token), medians over MoE layers; "drift" is the real model at 10 % of training
(``real_ep64_c10``) against the final one, and for the generator its window 0 against window 1::

    mkdir -p twin && python -c "from placement.formats import read_instance, write_instance; \\
      from placement.sources.realroute.cli import twin_instance; \\
      write_instance(twin_instance(read_instance('instances/real_ep64.json')), 'twin/real_ep64_generator.json')"
    placement stats instances/real_ep64.json --against instances/real_ep64_c10.json
    placement stats twin/real_ep64_generator.json
    python -m placement.sources.realroute --stats instances/    # the partner-share rows

=========================================  ===============  ===============  ===============
statistic                                  real_ep64        generator        generator,
                                                                             trained params
=========================================  ===============  ===============  ===============
tokens per source, fit / held-out          256 / 128        256 / 128        256 / 128
expert load max/mean, all sources          1.449            1.858            1.586
expert load max/mean, per source           2.193            2.114            1.871
source difference, pairwise TV (null)      0.213 (0.091)    0.108 (0.090)    0.134 (0.092)
co-activation d=1, top 1/8 share (null)    0.348 (0.166)    0.291 (0.212)    0.395 (0.171)
top-8 partner share, same layer (indep.)   0.384 (0.169)    0.317 (0.216)    0.419 (0.173)
fit vs held-out load TV (mean)             0.030            0.022            0.098
fit vs held-out top-8 partners kept        0.883            0.865            0.314
drift: load TV                             0.135            0.022            0.098
drift: top-8 partners kept                 0.410            0.865            0.314
=========================================  ===============  ===============  ===============

Reading: the real router is better balanced (its aux-loss-free bias) than the generator's
default skew, its sources differ about twice as much, and its co-activation beyond independent
routing is stronger (partner share 2.26x independent against 1.47x); between checkpoints it
drifts far more than the generator's windows do (which model one checkpoint).  The generator's
defaults are unchanged: they fix every committed synthetic instance.

"trained params" is :data:`TRAINED_MODEL_PARAMS` (``skew`` 0.2, ``source_mix_concentration``
0.5, ``drift`` 0.6, ``topic_strength`` 7.5), fitted to the real columns (load, partner ratio,
source TV, drift) by a grid and Nelder-Mead search on this shape (``twin_instance(inst,
TRAINED_MODEL_PARAMS)``). Its windows stand for checkpoints far apart, so its fit-vs-held-out
rows are drift rows too. It is closer to the real model on every statistic but keeps two gaps the
generative model cannot close: sources differ less (domain preferences start at zero in the first
layer) and drift reshuffles partners more than it moves loads (one random walk of every table).

Generating dsv3 takes about 3.5 s of CPU time (one core, numpy only; measured 3.3-3.9 s).

``skew=0`` removes only the popularity term: topic and domain structure (co-activation,
specialisation) stay. A uniform random routing without any structure is not a setting of this
generator; it is one line of numpy,
``np.sort(rng.random((..., E)).argsort(axis=-1)[..., :k], axis=-1)``, and `describe_calibration`
measures it the same way.

Determinism: the same arguments give byte-identical output on the same numpy build (all
randomness comes from ``np.random.default_rng`` streams spawned from one ``SeedSequence(seed)``;
no BLAS or threading). Window ``w`` does not depend on ``num_windows``: asking for more windows
extends the series.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from placement.core.stats import coactivation_share, expert_counts, mean_pairwise_tv, normalise, total_variation

__all__ = ["generate_routing", "describe_calibration", "TRAINED_MODEL_PARAMS", "AUX_LOSS_FREE_PARAMS"]

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
#: Keyword arguments of :func:`generate_routing` fitted to the routing of the project's trained
#: DeepSeek-V3-style model (``instances/real_ep64``, its 10 % checkpoint for drift; module docstring,
#: "Calibration"): flatter loads, stronger co-activation, sources that differ more and drift between
#: windows that stands for a checkpoint far apart.  The defaults stay the published-statistics
#: calibration (the committed synthetic instances use them).
TRAINED_MODEL_PARAMS: dict[str, float] = {"skew": 0.2, "source_mix_concentration": 0.5, "drift": 0.6,
                                          "topic_strength": 7.5}
#: Keyword arguments of :func:`generate_routing` for a DeepSeek-V3-class model trained with
#: auxiliary-loss-free balancing (DeepSeek-V3 technical report, arXiv 2412.19437, sections 2.1.2 and
#: 4.5.3; docs/imbalance.md): :data:`TRAINED_MODEL_PARAMS` with the committed 256-expert shapes'
#: topic logit and drift (``placement/sources/instances.py``) and 8 rounds of the bias controller
#: (``balance_rounds``), so the global batch is balanced up to the controller's residual.
#: Calibration target (seed 0; 8 MoE layers, 64 sources x 128 tokens, 256 experts, top-8, 8 groups,
#: 4 per token; medians over layers, sampling noise removed by :mod:`placement.predict.imbalance`): lasting
#: expert load max/mean <= 1.05 and lasting EP64-rank max/mean <= 1.02, where
#: :data:`TRAINED_MODEL_PARAMS` at the committed dsv3 settings gives 1.62 and 1.29 (measured:
#: 1.022 and 1.004; tests/test_imbalance.py checks both).
AUX_LOSS_FREE_PARAMS: dict[str, float] = {**TRAINED_MODEL_PARAMS, "topic_strength": 2.6, "drift": 0.95,
                                          "balance_rounds": 8}

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


def generate_routing(
    *,
    seed: int,
    num_layers: int,
    num_sources: int,
    tokens_per_source: int,
    num_windows: int,
    num_experts: int,
    top_k: int,
    num_groups: int = 1,
    groups_per_token: int = 1,
    num_data_domains: int = 6,
    source_mix_concentration: float = 10.0,
    skew: float = 0.65,
    drift: float = 0.1,
    topic_strength: float = _TOPIC_STRENGTH,
    balance_rounds: int = 0,
) -> np.ndarray:
    """Sample synthetic top-k routing of MoE layers, calibrated to published statistics.

    See the module docstring for the generative model and what the defaults produce.

    Parameters
    ----------
    seed : int
        Non-negative seed; the same arguments give byte-identical output.
    num_layers : int
        MoE layers, in model order; multi-token-prediction MoE layers (instance layer indices
        ``num_layers + j``) come last and are generated like the layers after the decoder's last.
    num_sources : int
        Data-parallel ranks; each has its own mix of data domains.
    tokens_per_source : int
        Sampled tokens per source per window.
    num_windows : int
        Consecutive windows of routing: window 0 to fit, window 1 held out, more for drift
        studies. Window ``w`` does not depend on ``num_windows``.
    num_experts : int
        Routed experts per layer (at most 65,536).
    top_k : int
        Experts per token.
    num_groups : int, default 1
        Groups of contiguous expert ids (DeepSeek ``n_group``); must divide ``num_experts``.
        1 disables group-limited routing.
    groups_per_token : int, default 1
        Groups a token may use (DeepSeek ``topk_group``); ignored when ``num_groups == 1``.
    num_data_domains : int, default 6
        Data domains (web, books, code, arxiv, wiki, math, ...).
    source_mix_concentration : float, default 10.0
        Total Dirichlet concentration of each source's mix around the global mix: smaller means
        sources differ more; ``np.inf`` gives every source the global mix.
    skew : float, default 0.65
        Standard deviation (in logits) of the residual per-expert popularity that balancing
        leaves; 0 gives loads flat up to sampling noise.
    drift : float, default 0.1
        Per-window random-walk step of every parameter table, in [0, 1]; 0 keeps the parameters
        and only resamples tokens.
    topic_strength : float, default 2.5
        Logit scale of the topic preferences (the ``2.5`` of the logit formula): larger means tokens
        that share a topic pick the same experts more often (stronger co-activation).
        :data:`TRAINED_MODEL_PARAMS` holds the values fitted to the project's trained model.
    balance_rounds : int, default 0
        Rounds of an auxiliary-loss-free bias controller run on fresh batches before each layer
        of each window is sampled (:data:`AUX_LOSS_FREE_PARAMS`): the bias then balances the
        routed load (group-limited routing and popularity included), not only its analytic
        expectation.  0 keeps the analytic bias alone (every committed instance).

    Returns
    -------
    numpy.ndarray
        ``topk``: (num_windows, num_layers, num_sources, tokens_per_source, top_k) uint16, the
        expert ids of each sampled token's top-k experts, distinct within a token and sorted
        ascending.

    Raises
    ------
    TypeError
        If an integer argument is not an integer or a float argument not a real number.
    ValueError
        If an argument is out of range, ``num_groups`` does not divide ``num_experts``, or the
        allowed groups hold fewer than ``top_k`` experts.

    Examples
    --------
    >>> topk = generate_routing(seed=0, num_layers=2, num_sources=3, tokens_per_source=4,
    ...                         num_windows=2, num_experts=16, top_k=2, num_groups=4,
    ...                         groups_per_token=2)
    >>> topk.shape, topk.dtype
    ((2, 2, 3, 4, 2), dtype('uint16'))
    >>> bool((topk[..., 1] > topk[..., 0]).all())
    True
    """
    topk, _ = _generate(
        seed=seed,
        num_layers=num_layers,
        num_sources=num_sources,
        tokens_per_source=tokens_per_source,
        num_windows=num_windows,
        num_experts=num_experts,
        top_k=top_k,
        num_groups=num_groups,
        groups_per_token=groups_per_token,
        num_data_domains=num_data_domains,
        source_mix_concentration=source_mix_concentration,
        skew=skew,
        drift=drift,
        topic_strength=topic_strength,
        balance_rounds=balance_rounds,
    )
    return topk


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
