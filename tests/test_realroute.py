"""The project's own real routing source: router, balancing bias, recorder, committed instances."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.core.checker import check
from placement.formats import read_instance
from placement import stats
from solvers.default import default_placement
from tests.conftest import INSTANCES, ROOT

REAL = ["real_ep64", "real_ep64_c10", "real_ep64_c50", "real_drift", "real_robust", "real_pp_frag"]


# ------------------------------------------------------------------ the router (torch)
def _brute_force_route(scores: np.ndarray, top_k: int, G: int, gpt: int) -> set[int]:
    """Best group subset by the sum of each group's two best scores, then the best k-subset."""
    E = scores.size
    n = E // G
    gscore = [sum(sorted(scores[g * n : (g + 1) * n])[-2:]) for g in range(G)]
    groups = max(itertools.combinations(range(G), gpt), key=lambda c: sum(gscore[g] for g in c))
    allowed = [e for g in groups for e in range(g * n, (g + 1) * n)]
    return set(max(itertools.combinations(allowed, top_k), key=lambda c: sum(scores[e] for e in c)))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    G=st.sampled_from([2, 3, 4]),
    n=st.sampled_from([2, 3]),
    gpt=st.integers(1, 3),
    k=st.integers(1, 4),
)
def test_group_limited_topk_matches_brute_force(seed, G, n, gpt, k):
    torch = pytest.importorskip("torch")
    from placement.sources.realroute.moe import group_limited_topk

    gpt = min(gpt, G)
    k = min(k, gpt * n)
    rng = np.random.default_rng(seed)
    scores = rng.random((5, G * n))  # continuous: no ties
    ids = group_limited_topk(torch.from_numpy(scores), k, G, gpt).numpy()
    for t in range(scores.shape[0]):
        assert set(ids[t].tolist()) == _brute_force_route(scores[t], k, G, gpt)


def _tiny_cfg():
    from placement.sources.realroute.moe import MoEConfig

    return MoEConfig(
        d_model=16, num_heads=2, num_layers=3, first_moe_layer=1, dense_hidden=16, num_experts=8, expert_hidden=8,
        shared_hidden=8, top_k=2, num_groups=4, groups_per_token=2, seq_len=16,
    )  # fmt: skip


def test_bias_moves_selection_not_gate_weights():
    torch = pytest.importorskip("torch")
    from placement.sources.realroute.moe import Router

    torch.manual_seed(0)
    cfg = _tiny_cfg()
    router = Router(cfg)
    x = torch.randn(64, cfg.d_model)
    ids0, w0 = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    # A bias that is the same for every expert changes nothing: not the choice, not the weights.
    router.bias.fill_(0.3)
    ids1, w1 = router(x)
    assert torch.equal(ids0, ids1) and torch.allclose(w0, w1)
    # A large bias on expert 5 makes every token pick it ...
    router.bias.zero_()
    router.bias[5] = 10.0
    ids2, w2 = router(x)
    assert bool((ids2 == 5).any(dim=1).all())
    assert not bool((ids0 == 5).any(dim=1).all())
    # ... but its gate weight is its unbiased score, normalised over the chosen experts.
    chosen = scores.gather(1, ids2)
    assert torch.allclose(w2, chosen / chosen.sum(dim=1, keepdim=True) * cfg.route_scale)
    assert not router.bias.requires_grad and "bias" not in dict(router.named_parameters())


def test_bias_update_moves_toward_the_mean_load():
    torch = pytest.importorskip("torch")
    from placement.sources.realroute.moe import MoELayer

    cfg = _tiny_cfg()
    layer = MoELayer(cfg)
    layer.step_load.copy_(torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5]))
    layer.update_bias()
    assert layer.router.bias[0] == pytest.approx(-cfg.bias_update_rate)
    assert layer.router.bias[1] == pytest.approx(cfg.bias_update_rate)
    assert float(layer.router.bias[2]) == 0.0
    assert float(layer.step_load.sum()) == 0.0


def test_moe_layer_matches_a_per_token_loop():
    """The padded batched dispatch equals routing each token through its experts one by one."""
    torch = pytest.importorskip("torch")
    from torch.nn import functional as F

    from placement.sources.realroute.moe import MoELayer

    torch.manual_seed(1)
    cfg = _tiny_cfg()
    layer = MoELayer(cfg).eval()
    x = torch.randn(2, 7, cfg.d_model)
    out = layer(x).reshape(-1, cfg.d_model)
    flat = x.reshape(-1, cfg.d_model)
    ids, w = layer.router(flat)
    for t in range(flat.shape[0]):
        want = layer.shared(flat[t : t + 1])[0]
        for j in range(cfg.top_k):
            e = int(ids[t, j])
            h = F.silu(flat[t] @ layer.w1[e]) * (flat[t] @ layer.w3[e])
            want = want + w[t, j] * (h @ layer.w2[e])
        assert torch.allclose(out[t], want, atol=1e-5)


# ------------------------------------------------------------------ the recorder (torch)
def _small_corpus():
    from placement.sources.realroute.corpus import Corpus

    texts = [(ROOT / "README.md").read_bytes(), (ROOT / "placement" / "predict" / "cost.py").read_bytes()]
    arrs = tuple(np.frombuffer(t, dtype=np.uint8).copy() for t in texts)
    return Corpus(("prose", "python"), arrs, tuple(hashlib.sha256(t).hexdigest() for t in texts))


def test_recorder_writes_an_instance_the_reader_and_checker_accept(tmp_path):
    pytest.importorskip("torch")
    from placement.formats import write_instance
    from placement.sources.realroute.build import LayoutSpec, _instance
    from placement.sources.realroute.record import TrainConfig, WindowSpec, draw_window, record_window, train
    cfg = _tiny_cfg()
    corpus = _small_corpus()
    ckpts = train(corpus, cfg, TrainConfig(steps=4, batch_sequences=2, seed=3, checkpoint_fractions=(0.5, 1.0)), log=lambda m: None)
    assert [s for s, _ in ckpts] == [2, 4]
    again = train(corpus, cfg, TrainConfig(steps=4, batch_sequences=2, seed=3, checkpoint_fractions=(0.5, 1.0)), log=lambda m: None)
    assert all(all(a[k].equal(b[k]) for k in a) for (_, a), (_, b) in zip(ckpts, again))  # deterministic

    wspec = WindowSpec(seed=5, num_sources=4, sequences_per_source=3, tokens_per_sequence=5, source_mix_concentration=1.0)
    seqs, kinds = draw_window(corpus, wspec, 0, cfg.seq_len)
    assert seqs.shape == (4, 3, 16) and kinds.shape == (4, 3)
    topk = record_window(cfg, ckpts[0][1], seqs, 5)
    held = record_window(cfg, ckpts[1][1], draw_window(corpus, wspec, 1, cfg.seq_len)[0], 5)
    assert topk.shape == (2, 4, 15, 2)
    assert bool((np.diff(topk.astype(int), axis=-1) > 0).all())  # distinct, sorted
    assert np.array_equal(topk, record_window(cfg, ckpts[0][1], seqs, 5, chunk=5))  # chunking is invisible
    spec = LayoutSpec(1, 1, 4, 4, 2, (1, 2), 2, 2, 2, 0, (1.0, 1.0))
    inst = _instance("rec_test", "recorder test", spec, cfg, topk, held, 0, {"function": "test"})
    write_instance(inst, tmp_path / "rec_test.json")
    back = read_instance(tmp_path / "rec_test.json")
    assert np.array_equal(back.routing.topk, topk) and np.array_equal(back.routing.heldout_topk, held)
    assert back.model.group_limited and back.model.num_moe_layers == 2
    assert check(back, default_placement(back)) == []


# ------------------------------------------------------------------ the committed instances
@pytest.mark.parametrize("name", REAL)
def test_committed_real_instances_load(name):
    inst = read_instance(INSTANCES / f"{name}.json")
    m = inst.model
    assert (m.num_experts, m.top_k, m.num_groups, m.groups_per_token, m.num_moe_layers) == (64, 8, 8, 4, 5)
    gen = inst.extra["generator"]
    assert gen["function"] == "placement.realroute"  # provenance as recorded in the committed instances
    assert inst.routing.topk.shape[1] == inst.parallel.dp == 64
    # Real routing: far more even than the raw router, but not flat, and sources differ.
    assert np.median(stats.load_max_mean(inst.routing.topk, 64)) > 1.0
    assert check(inst, default_placement(inst)) == []


def test_real_series_and_drift_share_their_bytes():
    """real_drift = the early checkpoint's sampled window + the final checkpoint's held-out window."""
    c10 = read_instance(INSTANCES / "real_ep64_c10.json")
    final = read_instance(INSTANCES / "real_ep64.json")
    drift = read_instance(INSTANCES / "real_drift.json")
    assert np.array_equal(drift.routing.topk, c10.routing.topk)
    assert np.array_equal(drift.routing.heldout_topk, final.routing.heldout_topk)
    steps = [read_instance(INSTANCES / f"{n}.json").extra["generator"]["checkpoint_step"] for n in ["real_ep64_c10", "real_ep64_c50", "real_ep64"]]
    assert steps == sorted(steps) and len(set(steps)) == 3
    assert not np.array_equal(c10.routing.topk, final.routing.topk)  # the model changed


def test_solve_runs_on_a_real_instance(tmp_path):
    from placement.cli import main

    out = tmp_path / "p.json"
    assert main(["solve", str(INSTANCES / "real_ep64.json"), "--time-limit", "10", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    inst = read_instance(INSTANCES / "real_ep64.json")
    assert doc["instance"] == {"name": "real_ep64", "sha256": inst.sha256}
    assert main(["verify", str(INSTANCES / "real_ep64.json"), str(out)]) == 0


def test_the_trained_model_params_bring_the_generator_closer_to_the_real_routing_on_every_statistic():
    """``TRAINED_MODEL_PARAMS`` against the defaults, each as a generator twin of ``real_ep64``
    (same shape and sample size): every statistic of the calibration table is nearer the real
    model's (its 10 % checkpoint for drift), and the defaults still give the documented values."""
    from placement.sources.generator import TRAINED_MODEL_PARAMS
    from placement.sources.realroute.cli import _twin

    final, early = read_instance(INSTANCES / "real_ep64.json"), read_instance(INSTANCES / "real_ep64_c10.json")
    E = final.model.num_experts

    def summary(now, before):
        """The table's statistics of ``now``, and its drift from ``before``."""
        med = lambda x: float(np.median(x))  # noqa: E731
        return {
            "load": med(stats.load_max_mean(now, E)),
            "ratio": med(stats.partner_share(now, E) / stats.partner_share(now, E, null=True)),
            "source_tv": med(stats.source_tv(now, E)),
            "drift_tv": med(stats.load_tv(before, now, E)),
            "partners_kept": med(stats.partner_overlap(before, now, E)),
        }

    real = summary(final.routing.topk, early.routing.topk)
    default, fitted = [summary(w0, w1) for w0, w1 in (_twin(final), _twin(final, TRAINED_MODEL_PARAMS))]
    assert default["load"] == pytest.approx(1.858, abs=5e-4) and default["ratio"] == pytest.approx(1.467, abs=5e-4)
    for k in real:
        assert abs(fitted[k] - real[k]) < abs(default[k] - real[k]), (k, real[k], default[k], fitted[k])
    assert abs(fitted["load"] / real["load"] - 1) < 0.10 and abs(fitted["ratio"] / real["ratio"] - 1) < 0.10
