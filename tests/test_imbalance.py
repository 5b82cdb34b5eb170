"""The lasting expert load (placement/predict/imbalance.py): hand counts, a slow reference, properties, the
evaluator's field, the step model's use of it, and the auxiliary-loss-free generator preset."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from placement.predict.imbalance import (
    expected_max,
    lasting_max_over_mean,
    lasting_max_over_mean_per_layer,
    lasting_shares,
    multinomial_count_variance,
    shrinkage_factor,
    token_count_variance,
)
from placement.core.model import InvalidInputError

INSTANCES = Path(__file__).resolve().parent.parent / "instances"


# ---------------------------------------------------------------------------------------------
# Hand counts
# ---------------------------------------------------------------------------------------------
def test_token_count_variance_hand_count_with_and_without_strata():
    # 2 bins, k = 2; tokens' pairs on bin 0: 2, 1, 0, 1 (bin 1: 0, 1, 2, 1).
    target = np.array([[0, 0], [0, 1], [1, 1], [0, 1]])
    row = np.zeros(4, dtype=np.int64)
    counts, var = token_count_variance(target, row, np.zeros(4, dtype=np.int64), 1, 1, 2)
    assert counts.tolist() == [[4.0, 4.0]]
    # One stratum: sample variance of (2, 1, 0, 1) is 2/3, times 4 tokens.
    assert np.allclose(var, [[8 / 3, 8 / 3]])
    # Two strata {0, 1} and {2, 3}: (2, 1) and (0, 1) each have sample variance 1/2, times 2 tokens.
    counts, var = token_count_variance(target, row, np.array([0, 0, 1, 1]), 1, 2, 2)
    assert np.allclose(var, [[2.0, 2.0]])
    # A stratum of one token (token 3 alone) borrows the row's pooled per-token variance (2/3):
    # stratum {0, 1, 2}: bin 0 (2, 1, 0) -> variance 1, times 3 = 3; plus 2/3.
    counts, var = token_count_variance(target, row, np.array([0, 0, 0, 1]), 1, 2, 2)
    assert np.allclose(var, [[3 + 2 / 3, 3 + 2 / 3]])


def test_shrinkage_and_lasting_ratio_hand_count():
    # Shares 0.6 / 0.4: S = 0.02; V = (25 + 25) / 100^2 = 0.005; B = 0.75.
    n, v = np.array([60.0, 40.0]), np.array([25.0, 25.0])
    assert shrinkage_factor(n, v) == pytest.approx(0.75)
    assert lasting_shares(n, v) == pytest.approx([0.575, 0.425])
    # Lasting ratio: raw 1.2 less the inflation of a maximum of two centred normals of sd
    # 2 * 0.05 * sqrt(2) around 1.15 / 0.85 (computed by expected_max; checked on its own below).
    pi = np.array([1.15, 0.85])
    sd = np.full(2, 2 * 0.05 * math.sqrt(2))
    want = 1.2 - (float(expected_max(pi, sd)) - 1.15)
    assert float(lasting_max_over_mean(n, v)) == pytest.approx(want)
    assert 1.0 < float(lasting_max_over_mean(n, v)) < 1.2


def test_expected_max_against_closed_forms_and_a_monte_carlo():
    # Two standard normals: 1 / sqrt(pi); one constant far above: the constant.
    assert float(expected_max(np.zeros(2), np.ones(2))) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert float(expected_max(np.array([5.0, 0.0]), np.array([0.0, 0.1]))) == pytest.approx(5.0, abs=1e-6)
    rng = np.random.default_rng(3)
    mu, sd = rng.normal(size=7), rng.uniform(0.1, 2.0, size=7)
    mc = (mu + sd * rng.standard_normal((400_000, 7))).max(axis=1).mean()
    assert float(expected_max(mu, sd)) == pytest.approx(mc, abs=0.01)


# ---------------------------------------------------------------------------------------------
# The per-layer function against a slow, token-by-token reference
# ---------------------------------------------------------------------------------------------
def _slow_lasting(e2r: np.ndarray, topk: np.ndarray, src_group: np.ndarray, ep: int) -> list[float]:
    L, dp, T, k = topk.shape
    out = []
    for li in range(L):
        groups = sorted(set(int(g) for g in src_group[li].reshape(-1)))
        best = 1.0
        for g in groups:
            n = np.zeros(ep)
            var = np.zeros(ep)
            for s in range(dp):
                xs = []
                for t in range(T):
                    if src_group[li, s, t] != g:
                        continue
                    x = np.zeros(ep)
                    for e in topk[li, s, t]:
                        x[e2r[li, e]] += 1
                    xs.append(x)
                if not xs:
                    continue
                xa = np.array(xs)
                n += xa.sum(axis=0)
                if len(xs) >= 2:
                    var += len(xs) * xa.var(axis=0, ddof=1)
            assert all(np.sum(src_group[li, s] == g) != 1 for s in range(dp))  # no one-token strata here
            best = max(best, float(lasting_max_over_mean(n, var)))
        out.append(best)
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ep=st.integers(2, 6), groups=st.integers(1, 3), k=st.integers(1, 4),
       tokens=st.integers(2, 12), dp=st.integers(1, 3))
def test_per_layer_matches_a_token_by_token_reference(seed, ep, groups, k, tokens, dp):
    rng = np.random.default_rng(seed)
    L, E = 2, ep * 2
    e2r = np.stack([rng.permutation(E) % ep for _ in range(L)])
    topk = np.sort(rng.random((L, dp, tokens, E)).argsort(axis=-1)[..., :k], axis=-1)
    # Every source's tokens go to one group (as in the evaluator: a source's tokens are sent by
    # ranks of one EP group when tp * cp == 1), so no stratum holds a single token.
    src_group = np.broadcast_to(rng.integers(0, groups, size=(L, dp, 1)), (L, dp, tokens)).copy()
    got = lasting_max_over_mean_per_layer(e2r, topk, src_group, ep)
    assert got == pytest.approx(_slow_lasting(e2r, topk, src_group, ep), rel=1e-9, abs=1e-12)


def test_per_layer_rejects_mismatched_shapes():
    with pytest.raises(InvalidInputError, match="topk"):
        lasting_max_over_mean_per_layer(np.zeros((2, 4), dtype=int), np.zeros((2, 1, 3, 2), dtype=int),
                                        np.zeros((2, 1, 4), dtype=int), 2)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bins=st.integers(1, 40), tokens=st.integers(1, 60), k=st.integers(1, 6),
       strata=st.integers(1, 4), skew=st.floats(0.0, 3.0))
def test_never_above_the_raw_ratio_and_never_below_one(seed, bins, tokens, k, strata, skew):
    rng = np.random.default_rng(seed)
    p = np.exp(skew * rng.standard_normal(bins))
    target = rng.choice(bins, size=(tokens, k), p=p / p.sum())
    counts, var = token_count_variance(target, np.zeros(tokens, dtype=np.int64), rng.integers(0, strata, tokens),
                                       1, strata, bins)
    raw = counts.max() * bins / counts.sum()
    for v in (var, multinomial_count_variance(counts)):
        got = float(lasting_max_over_mean(counts, v)[0])
        assert 1.0 <= got <= raw + 1e-12


GROUPS = 32
STRATA = 4


def _uniform_groups(rng: np.random.Generator, ranks: int, k: int, tokens_per_stratum: int, clumped: bool):
    """(GROUPS, ranks) counts and token variances of uniform routing, and the multinomial variances."""
    n_tok = GROUPS * STRATA * tokens_per_stratum
    if clumped:  # every pair of a token on one rank (group-limited routing at its extreme)
        target = np.repeat(rng.integers(0, ranks, size=(n_tok, 1)), k, axis=1)
    else:  # every pair an independent uniform draw
        target = rng.integers(0, ranks, size=(n_tok, k))
    row = np.repeat(np.arange(GROUPS), STRATA * tokens_per_stratum)
    stratum = np.tile(np.repeat(np.arange(STRATA), tokens_per_stratum), GROUPS)
    counts, var = token_count_variance(target, row, stratum, GROUPS, STRATA, ranks)
    return counts, var, multinomial_count_variance(counts)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 64), k=st.integers(1, 8),
       tokens_per_stratum=st.integers(2, 256))
def test_uniform_routing_predicts_no_lasting_imbalance(seed, ranks, k, tokens_per_stratum):
    """Uniform routing, every pair an independent draw, N = 4 T k pairs per group: the lasting excess
    averaged over 32 groups stays below 1.5 sqrt(R / N), the noise's own scale (measured: 0.4-1.1),
    while the raw excess is 2.3-3.1 sqrt(R / N) at 32 ranks and more."""
    rng = np.random.default_rng(seed)
    counts, var, _ = _uniform_groups(rng, ranks, k, tokens_per_stratum, clumped=False)
    pairs = STRATA * tokens_per_stratum * k
    tol = 1.5 * math.sqrt(ranks / pairs)
    lasting = lasting_max_over_mean(counts, var) - 1.0
    assert lasting.mean() <= tol
    if ranks >= 32:  # the bound is tighter than the raw ratio: this test would catch "no correction"
        raw = counts.max(axis=1) * ranks / counts.sum(axis=1) - 1.0
        assert raw.mean() > tol


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 64), k=st.integers(1, 8),
       tokens_per_stratum=st.integers(2, 256))
def test_uniform_routing_with_clumped_tokens_predicts_no_lasting_imbalance(seed, ranks, k, tokens_per_stratum):
    """Uniform over ranks but each token's k pairs on one rank: the noise is that of T tokens, not of
    T k pairs.  The token variance sees it (mean lasting excess below 1.5 sqrt(R / T), measured up to
    1.0); the multinomial variance would not, and at 48+ ranks and k = 8 exceeds the bound."""
    rng = np.random.default_rng(seed)
    counts, var, multi = _uniform_groups(rng, ranks, k, tokens_per_stratum, clumped=True)
    tol = 1.5 * math.sqrt(ranks / (STRATA * tokens_per_stratum))
    assert (lasting_max_over_mean(counts, var) - 1.0).mean() <= tol
    if ranks >= 48 and k == 8:
        assert (lasting_max_over_mean(counts, multi) - 1.0).mean() > tol


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 64), excess=st.floats(0.1, 1.0),
       profile=st.sampled_from(["one_hot", "linear", "lognormal"]))
def test_planted_imbalance_is_recovered(seed, ranks, excess, profile):
    """Lasting shares with busiest/mean 1 + excess, N pairs such that the excess is 20 noise
    deviations (N = 400 R / excess^2): recovered within 0.45 excess (measured: within 0.24 over 300
    draws per case, an error of standard deviation about 0.08 excess, mean under 0.01)."""
    rng = np.random.default_rng(seed)
    if profile == "one_hot":
        p = np.full(ranks, 1.0)
        p[rng.integers(ranks)] = 2.0
    elif profile == "linear":
        p = 1.0 + np.linspace(-1.0, 1.0, ranks)
    else:
        p = np.exp(rng.standard_normal(ranks))
    p = p / p.sum()
    p = 1.0 / ranks + (p - 1.0 / ranks) * excess / (p.max() * ranks - 1.0)  # max / mean = 1 + excess
    assume(p.min() >= 0.0)
    true = p.max() * ranks
    assert true == pytest.approx(1.0 + excess)
    pairs = int(math.ceil(400 * ranks / excess**2))
    counts = rng.multinomial(pairs, p).astype(np.float64)
    got = float(lasting_max_over_mean(counts, multinomial_count_variance(counts)))
    assert abs(got - true) <= 0.45 * excess


def test_a_lone_hot_rank_keeps_its_load_where_one_shrinkage_factor_would_not():
    """One hot rank among 64 at its expected counts, 10 noise deviations above: the bias-corrected
    maximum keeps it within 5%; the largest shrunk share would lose about 40% of the excess."""
    ranks, excess = 64, 0.3
    p = np.full(ranks, (1.0 - excess / (ranks - 1)) / ranks)
    p[0] = (1.0 + excess) / ranks
    assert p.sum() == pytest.approx(1.0)
    counts = p * math.ceil(100 * ranks / excess**2)
    var = multinomial_count_variance(counts)
    got = float(lasting_max_over_mean(counts, var))
    assert abs(got - (1 + excess)) <= 0.05 * excess
    shrunk = float(lasting_shares(counts, var).max() * ranks)
    assert shrunk - 1 < 0.7 * excess


# ---------------------------------------------------------------------------------------------
# The evaluator's field and the step model
# ---------------------------------------------------------------------------------------------
def _tiny():
    from placement.formats import read_instance

    return read_instance(INSTANCES / "tiny.json")


def test_evaluate_reports_the_lasting_load_below_the_raw_one():
    from placement.predict.cost import evaluate
    from placement.predict.report import report
    from solvers.default import default_placement

    inst = _tiny()
    pl = default_placement(inst)
    for window in ("sampled", "heldout"):
        m = evaluate(inst, pl, window=window)
        assert len(m.expert_load_lasting_max_over_mean_per_layer) == inst.model.num_moe_layers
        for lasting, raw in zip(m.expert_load_lasting_max_over_mean_per_layer, m.expert_load_max_over_mean_per_layer):
            assert 1.0 <= lasting <= raw + 1e-12
        assert m.expert_load_lasting_max_over_mean == max(m.expert_load_lasting_max_over_mean_per_layer)
    out = report(inst, pl)
    assert "expert_load_lasting_max_over_mean" in out and "heldout_expert_load_lasting_max_over_mean" in out


def _uniform_copy(inst, tokens_per_source: int, seed: int = 0):
    from placement.core.model import Routing

    L, dp, _, k = inst.routing.topk.shape
    E = inst.model.num_experts
    rng = np.random.default_rng(seed)
    topk = np.sort(rng.random((L, dp, tokens_per_source, E)).argsort(axis=-1)[..., :k], axis=-1).astype(np.uint16)
    return dataclasses.replace(inst, routing=Routing(topk, None))


def test_the_step_model_prices_the_lasting_load():
    """Uniform routing on tiny's shape: the evaluator's raw ratio is noise, the lasting one about 1;
    the prediction equals the step model fed the lasting list and is faster than fed the raw one."""
    from placement.predict.cost import evaluate
    from placement.predict.performance import StepTimeModel
    from solvers.default import default_placement

    inst = _uniform_copy(_tiny(), 64)
    pl = default_placement(inst)
    m = evaluate(inst, pl)
    raw = np.array(m.expert_load_max_over_mean_per_layer)
    lasting = np.array(m.expert_load_lasting_max_over_mean_per_layer)
    assert raw.mean() > 1.05 and lasting.mean() < 1.0 + (raw.mean() - 1.0) / 2
    model = StepTimeModel(inst)
    got = model.predict_metrics(m, pl.rank2gpu)
    kw: dict[str, Any] = dict(nic_bytes_per_layer=m.max_gpu_cross_domain_bytes_per_layer,
                              nvlink_bytes_per_layer=m.max_gpu_nvlink_bytes_per_layer)
    want = model.predict(m.alltoall_time_s_per_layer, lasting.tolist(), pl.rank2gpu, **kw)
    assert got.step_time_s == want.step_time_s
    assert got.step_time_s < model.predict(m.alltoall_time_s_per_layer, raw.tolist(), pl.rank2gpu, **kw).step_time_s
    # Metrics without the field (built before it existed) are priced on the raw ratio.
    old = dataclasses.replace(m, expert_load_lasting_max_over_mean_per_layer=[])
    assert model.predict_metrics(old, pl.rank2gpu).step_time_s == model.predict(
        m.alltoall_time_s_per_layer, raw.tolist(), pl.rank2gpu, **kw).step_time_s


def test_the_cli_shows_the_lasting_row(capsys):
    from placement.cli import main

    assert main(["evaluate", str(INSTANCES / "tiny.json")]) == 0
    out = capsys.readouterr().out
    assert "expert load max/mean (worst layer)" in out and "lasting (noise removed, priced)" in out


# ---------------------------------------------------------------------------------------------
# The auxiliary-loss-free generator preset
# ---------------------------------------------------------------------------------------------
def _medians(params: dict[str, Any], seed: int = 0) -> tuple[float, float]:
    """Median over 8 MoE layers of the lasting expert and EP64-rank load max/mean, dsv3 shape at
    reduced size (64 sources x 128 tokens, 256 experts, top-8, 8 groups, 4 per token)."""
    from placement.sources.generator import generate_routing

    S, T, E, k, ep = 64, 128, 256, 8, 64
    topk = generate_routing(seed=seed, num_layers=8, num_sources=S, tokens_per_source=T, num_windows=1,
                            num_experts=E, top_k=k, num_groups=8, groups_per_token=4, **params)[0]
    src = np.repeat(np.arange(S), T)
    row = np.zeros(S * T, dtype=np.int64)
    expert, rank = [], []
    for layer in topk:
        t = layer.reshape(-1, k).astype(np.int64)
        for bins, tgt, out in ((E, t, expert), (ep, t // (E // ep), rank)):
            n, v = token_count_variance(tgt, row, src, 1, S, bins)
            out.append(float(lasting_max_over_mean(n, v)[0]))
    return float(np.median(expert)), float(np.median(rank))


def test_aux_loss_free_preset_meets_its_calibration_target():
    """The documented target (placement/sources/generator.py, AUX_LOSS_FREE_PARAMS): seed 0, lasting expert
    load max/mean <= 1.05 and lasting EP64-rank max/mean <= 1.02; the trained-model preset at the
    committed dsv3 settings stays far above (1.61 and 1.28)."""
    from placement.sources.generator import AUX_LOSS_FREE_PARAMS, TRAINED_MODEL_PARAMS

    expert, rank = _medians(dict(AUX_LOSS_FREE_PARAMS))
    assert expert <= 1.05 and rank <= 1.02
    current = {**TRAINED_MODEL_PARAMS, "skew": 0.27, "topic_strength": 2.6, "drift": 0.95}
    expert_c, rank_c = _medians(current)
    assert expert_c > 1.4 and rank_c > 1.2


def test_balance_rounds_is_checked_and_zero_leaves_the_output_unchanged():
    from placement.sources.generator import generate_routing

    kw: dict[str, Any] = dict(seed=5, num_layers=2, num_sources=3, tokens_per_source=4, num_windows=2,
                              num_experts=16, top_k=2, num_groups=4, groups_per_token=2)
    assert np.array_equal(generate_routing(**kw), generate_routing(**kw, balance_rounds=0))
    assert not np.array_equal(generate_routing(**kw), generate_routing(**kw, balance_rounds=2))
    with pytest.raises(ValueError, match="balance_rounds"):
        generate_routing(**kw, balance_rounds=-1)
