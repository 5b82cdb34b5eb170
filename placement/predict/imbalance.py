"""Lasting expert load imbalance: the sampled window's load shares with their sampling noise removed.

The evaluator counts, per MoE layer and EP group, the (token, expert) pairs each EP rank receives
in the sampled window.  Their busiest-over-mean ratio (``Metrics.expert_load_max_over_mean_per_layer``)
mixes two things: the lasting skew of the router (what a longer window would still show, what
the job pays for on every step) and the sampling noise of a finite window.  Uniform routing over 64
EP ranks with 8,192 sampled tokens per group reads about 1.07 although nothing in it is imbalanced.
This module estimates the lasting part.

The estimator (per layer and EP group, ``R`` ranks, ``N`` pairs)
---------------------------------------------------------------
Shares ``p_r = n_r / N`` (they sum to 1, so their mean is exactly ``1 / R``).  The observed spread
``S = sum_r (p_r - 1/R)^2`` has expectation ``sum_r (pi_r - 1/R)^2 + V`` where ``pi`` are the
lasting shares and ``V = sum_r Var(p_r)`` the sampling noise.  The method of moments gives the
lasting spread ``max(0, S - V)``, and the positive-part James-Stein (empirical Bayes) estimate of
each share shrinks its deviation from the mean by ``B = max(0, 1 - V / S)``
(:func:`lasting_shares`; James-Stein's constant is ``(R-3)/(R-1)`` of ``V``, the method of moments'
1 shrinks a little more).

The busiest rank is not the largest shrunk share: one factor for all ranks pulls a lone hot rank
down with the noise of the others (40% of its excess for one hot rank among 64 at ten noise
deviations).  :func:`lasting_max_over_mean` instead removes from the raw maximum the amount by
which noise inflates a maximum, given the shrunk shares: ``raw - (E[max_r (pi_r + e_r)] - max_r
pi_r)``, ``e_r`` normal with each share's noise (:func:`expected_max`), floored at 1.  Under
uniform routing the inflation is the raw excess up to that excess's own fluctuation; a rank far
above the rest keeps its raw value.  ``E[max] >= max E``, so the lasting ratio never exceeds the
raw one.  Measured (tests/test_imbalance.py, docs/imbalance.md): uniform routing keeps on average
0.5-1.1 ``sqrt(R / N)`` of lasting excess against 2.3-3.1 raw at 64 ranks; planted imbalance is
recovered without bias, within the raw maximum's own noise.

The noise ``V`` is measured, not assumed.  A token sends its ``k`` pairs to ranks that are not
independent draws (its experts are distinct; group-limited routing sends them to a few groups
together, so several land on one rank), so the multinomial variance ``N p (1 - p)`` would be wrong
by the ratio of those correlations.  Tokens, however, are sampled independently: each rank's
count is a sum over tokens of the token's own count ``x_tr``, and its variance is the sum of the
per-token variances, estimated from the window itself.  The tokens of one data-parallel source
share that source's data mix, which persists from step to step (lasting), so the variance is taken
within each source (stratum): ``Var(n_r) = sum_s T_s v_sr``, ``v_sr`` the sample variance of
``x_tr`` over the ``T_s`` tokens of source ``s``.  A source with a single token borrows the
group's pooled per-token variance.  :func:`multinomial_count_variance` is the count-only fallback
(independent pairs) when the tokens are not at hand.

The job then sees each micro-batch's own spread on top of the lasting shares
(:func:`placement.predict.performance.per_microbatch_load`: tokens per micro-batch per EP rank); the
step-time model prices that instead of the raw sampled ratio.  docs/imbalance.md has the evidence
that trained models with auxiliary-loss-free balancing stay balanced at the global batch, and the
measured effect on the committed instances.

This module imports only numpy and :mod:`placement.core.model`.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import InvalidInputError

__all__ = [
    "shrinkage_factor",
    "lasting_shares",
    "expected_max",
    "token_count_variance",
    "multinomial_count_variance",
    "lasting_max_over_mean",
    "lasting_max_over_mean_per_layer",
]


def shrinkage_factor(counts: np.ndarray, count_variance: np.ndarray) -> np.ndarray:
    """Positive-part shrinkage factor ``B = max(0, 1 - V / S)`` of each row's shares.

    Parameters
    ----------
    counts : (..., R) pairs each of ``R`` bins (EP ranks or experts) received, non-negative.
    count_variance : (..., R) sampling variance of each count.

    Returns
    -------
    (...,) factor in [0, 1]; 0 for a row with no pairs, or with all counts equal.

    Examples
    --------
    >>> round(float(shrinkage_factor(np.array([60.0, 40.0]), np.array([25.0, 25.0]))), 6)
    0.75
    """
    n = np.asarray(counts, dtype=np.float64)
    var = np.asarray(count_variance, dtype=np.float64)
    total = n.sum(axis=-1)
    safe = np.where(total > 0, total, 1.0)
    share = n / safe[..., None]
    spread = ((share - 1.0 / n.shape[-1]) ** 2).sum(axis=-1)  # S
    noise = var.sum(axis=-1) / safe**2  # V
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(spread > 0, 1.0 - noise / np.where(spread > 0, spread, 1.0), 0.0)
    return np.where(total > 0, np.clip(b, 0.0, 1.0), 0.0)


def lasting_shares(counts: np.ndarray, count_variance: np.ndarray) -> np.ndarray:
    """(..., R) lasting load shares ``1/R + B (p - 1/R)`` (rows sum to 1; uniform for empty rows).

    The best estimate of each bin's own share (:func:`shrinkage_factor`).  It is not the estimate of
    the busiest bin's load: shrinking every deviation by one factor pulls a lone hot bin down with
    the noise of the others (by about 40% for one hot rank among 64 at a sample where its excess is
    10 noise deviations).  :func:`lasting_max_over_mean` corrects the raw maximum instead.
    """
    n = np.asarray(counts, dtype=np.float64)
    r = n.shape[-1]
    total = n.sum(axis=-1, keepdims=True)
    share = np.where(total > 0, n / np.where(total > 0, total, 1.0), 1.0 / r)
    b = shrinkage_factor(n, count_variance)[..., None]
    return 1.0 / r + b * (share - 1.0 / r)


# Abramowitz and Stegun 7.1.26: erf(x) for x >= 0 within 1.5e-7.
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
# Points of the grid on which the expected maximum is integrated, and its half-width in deviations.
_GRID_POINTS = 257
_GRID_SDS = 7.0


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF (numpy only; absolute error below 1e-7)."""
    x = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + _AS_P * x)
    poly = t * (_AS_A[0] + t * (_AS_A[1] + t * (_AS_A[2] + t * (_AS_A[3] + t * _AS_A[4]))))
    half_erfc = 0.5 * poly * np.exp(-x * x)
    return np.where(z >= 0, 1.0 - half_erfc, half_erfc)


def expected_max(mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """(...,) expected maximum of independent normals with (..., R) means and standard deviations.

    ``E[max] = lo + integral_lo^hi (1 - prod_r Phi((x - mean_r) / sd_r)) dx`` on a grid from
    ``lo = max_r(mean_r - 7 sd_r)`` to ``hi = max_r(mean_r + 7 sd_r)`` (the maximum lies there but
    for a 1e-12 tail), trapezoidal.  A bin with ``sd = 0`` is a constant.

    Examples
    --------
    >>> round(float(expected_max(np.zeros(2), np.ones(2))), 4)  # 1 / sqrt(pi)
    0.5642
    """
    mu = np.asarray(mean, dtype=np.float64)
    sd = np.maximum(np.asarray(sd, dtype=np.float64), 0.0)
    lo = (mu - _GRID_SDS * sd).max(axis=-1)
    hi = (mu + _GRID_SDS * sd).max(axis=-1)
    frac = np.linspace(0.0, 1.0, _GRID_POINTS)
    x = lo[..., None] + (hi - lo)[..., None] * frac  # (..., P)
    z = (x[..., None, :] - mu[..., :, None]) / np.where(sd > 0, sd, 1.0)[..., :, None]  # (..., R, P)
    cdf = np.where((sd > 0)[..., :, None], _normal_cdf(z), (x[..., None, :] >= mu[..., :, None]).astype(np.float64))
    tail = 1.0 - cdf.prod(axis=-2)  # (..., P): P(max > x)
    step = (hi - lo) / (_GRID_POINTS - 1)
    return lo + step * (tail.sum(axis=-1) - 0.5 * (tail[..., 0] + tail[..., -1]))


def lasting_max_over_mean(counts: np.ndarray, count_variance: np.ndarray) -> np.ndarray:
    """(...,) lasting busiest-over-mean of each row; 1 for empty rows.

    The raw ratio less the noise's expected inflation of a maximum: with the lasting shares
    ``pi`` (:func:`lasting_shares`) and each share's noise ``sigma_r``,
    ``raw - (E[max_r (pi_r + e_r)] - max_r pi_r) R`` with ``e_r ~ N(0, sigma_r^2)``
    (:func:`expected_max`), floored at 1.  A parametric-bootstrap bias correction: under uniform
    routing the inflation is the raw excess itself (up to its own fluctuation); a hot bin far
    above the rest keeps its raw value (noise does not inflate a lone maximum).  Never above the
    raw ratio (``E[max] >= max E``).

    Examples
    --------
    >>> round(float(lasting_max_over_mean(np.array([60.0, 40.0]), np.array([25.0, 25.0]))), 4)
    1.1941
    """
    n = np.asarray(counts, dtype=np.float64)
    r = n.shape[-1]
    total = n.sum(axis=-1)
    safe = np.where(total > 0, total, 1.0)
    raw = np.where(total > 0, n.max(axis=-1) * r / safe, 1.0)
    pi = lasting_shares(n, count_variance) * r  # in units of the mean
    # The shares sum to 1, so their noises are centred: e_r = f_r - mean(f) with independent f_r of
    # sd sigma_r sqrt(R / (R - 1)), and E[max e] = E[max f] (exact for R = 2: E|e_1|).
    centred = np.sqrt(r / (r - 1.0)) if r > 1 else 1.0
    sd = np.sqrt(np.maximum(np.asarray(count_variance, dtype=np.float64), 0.0)) * (r * centred) / safe[..., None]
    inflation = np.maximum(expected_max(pi, sd) - pi.max(axis=-1), 0.0)
    return np.where(total > 0, np.clip(raw - inflation, 1.0, raw), 1.0)


def multinomial_count_variance(counts: np.ndarray) -> np.ndarray:
    """(..., R) variance of each count if every pair were an independent draw: ``N p (1 - p)``.

    The count-only fallback; it understates the noise of group-limited routing (a token's pairs
    land together) and overstates it for distinct experts on one bin.  Prefer
    :func:`token_count_variance` when the tokens are at hand.
    """
    n = np.asarray(counts, dtype=np.float64)
    total = n.sum(axis=-1, keepdims=True)
    p = n / np.where(total > 0, total, 1.0)
    return total * p * (1.0 - p)


def token_count_variance(
    target: np.ndarray, row: np.ndarray, stratum: np.ndarray, num_rows: int, num_strata: int, num_bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """Counts and their sampling variance from the tokens' targets, within strata.

    Parameters
    ----------
    target : (n_tokens, k) bin (EP rank or expert) of each of a token's ``k`` pairs, in
        ``[0, num_bins)``.
    row : (n_tokens,) row (EP group) each token's pairs are counted in, in ``[0, num_rows)``.
    stratum : (n_tokens,) stratum (data-parallel source) of each token, in ``[0, num_strata)``.
    num_rows, num_strata, num_bins : sizes of the output.

    Returns
    -------
    counts : (num_rows, num_bins) pairs per bin.
    variance : (num_rows, num_bins) ``sum_s T_s v_s`` with ``v_s`` the sample variance over the
        ``T_s`` tokens of stratum ``s`` (of that row) of a token's pairs on the bin; strata with one
        token use the row's pooled per-token variance.
    """
    tgt = np.asarray(target, dtype=np.int64)
    n_tok, k = tgt.shape
    cells = num_rows * num_strata
    cell = np.asarray(row, dtype=np.int64) * num_strata + np.asarray(stratum, dtype=np.int64)  # (n_tok,)
    # sum_t x_tr^2 = n_r + 2 (pairs i < j of one token both on r); the pairs (i, i + d) over
    # d = 1 .. k-1 are every pair once.
    key = cell[:, None] * num_bins + tgt  # (n_tok, k)
    size = cells * num_bins
    n = np.bincount(key.reshape(-1), minlength=size).astype(np.float64)
    q = n.copy()
    for d in range(1, k):
        same = tgt[:, d:] == tgt[:, :-d]
        if same.any():
            q += 2.0 * np.bincount(key[:, d:][same], minlength=size)
    n = n.reshape(num_rows, num_strata, num_bins)
    q = q.reshape(num_rows, num_strata, num_bins)
    t = np.bincount(cell, minlength=cells).astype(np.float64).reshape(num_rows, num_strata, 1)
    # Within stratum: T v = (q - n^2 / T) T / (T - 1).
    with np.errstate(divide="ignore", invalid="ignore"):
        within = np.where(t >= 2, (q - n * n / np.where(t > 0, t, 1.0)) * t / np.where(t >= 2, t - 1.0, 1.0), 0.0)
    counts = n.sum(axis=1)
    var = within.sum(axis=1)
    single = (t[..., 0] == 1).sum(axis=1)  # (num_rows,) strata with one token
    if single.any():
        tt = t.sum(axis=1)  # (num_rows, 1)
        qq = q.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            pooled = np.where(tt >= 2, (qq - counts * counts / np.where(tt > 0, tt, 1.0)) / np.where(tt >= 2, tt - 1.0, 1.0), 0.0)
        var = var + single[:, None] * pooled
    return counts, np.maximum(var, 0.0)


def lasting_max_over_mean_per_layer(
    expert2eprank: np.ndarray, topk: np.ndarray, src_group: np.ndarray, ep: int
) -> list[float]:
    """(L,) lasting EP-rank load max/mean of each MoE layer: the worst of its EP groups.

    The lasting counterpart of ``Metrics.expert_load_max_over_mean_per_layer`` (same window, same
    groups), never above it.

    Parameters
    ----------
    expert2eprank : (L, E) EP rank hosting each expert.
    topk : (L, dp, T, k) expert ids of each sampled token.
    src_group : (L, dp, T) EP group (within its stage) of the rank that sends each token.
    ep : EP ranks per group.

    Raises
    ------
    InvalidInputError
        If the shapes disagree.
    """
    e2r = np.asarray(expert2eprank, dtype=np.int64)
    tk = np.asarray(topk)
    grp = np.asarray(src_group, dtype=np.int64)
    if tk.ndim != 4 or grp.shape != tk.shape[:3] or e2r.shape[0] != tk.shape[0]:
        raise InvalidInputError(
            f"topk: expected (L, dp, T, k) with src_group (L, dp, T) and expert2eprank (L, E), got "
            f"{tk.shape}, {grp.shape}, {e2r.shape}"
        )
    num_layers, dp, tokens, k = tk.shape
    ngroups = int(grp.max()) + 1 if grp.size else 1
    source = np.broadcast_to(np.arange(dp)[:, None], (dp, tokens)).reshape(-1)
    out = []
    for li in range(num_layers):
        target = e2r[li][tk[li].reshape(-1, k).astype(np.int64)]
        counts, var = token_count_variance(target, grp[li].reshape(-1), source, ngroups, dp, ep)
        out.append(float(lasting_max_over_mean(counts, var).max()))
    return out
