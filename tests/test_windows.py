"""Several time-ordered sampled windows: the representation, the formats, the fit objectives and the guard.

References: the evaluator (placement.predict.cost.evaluate) on each window cut out as its own instance, and
brute force over every expert map of small layers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement
from placement.core.checker import check
from placement.cli import main
from placement.predict.cost import evaluate
from placement.formats import read_instance, write_instance
from placement.core.model import InvalidInputError, Placement, Routing
from solvers.base import SolveOptions
from solvers.default import default_rank2gpu
from solvers.experts import build_layer_problem, net_crossings, place_experts
from solvers.experts.windows import merge_nets, robust_value, window_costs
from tests.conftest import INSTANCES, random_instance


def _with_windows(inst, counts, rng):
    """``inst`` with ``len(counts)`` sampled windows of fresh random routing (same shape otherwise;
    under group-limited routing, tokens drawn from the instance's own)."""
    L, dp, T, k = inst.routing.topk.shape
    E = inst.model.num_experts
    if inst.model.group_limited:
        topk = np.asarray(inst.routing.topk)[:, :, rng.integers(0, T, size=sum(counts))]
    else:
        keys = rng.random((L, dp, sum(counts), E))
        topk = np.sort(np.argsort(keys, axis=-1)[..., :k], axis=-1)
    return dataclasses.replace(inst, routing=Routing(topk, inst.routing.heldout_topk, tuple(counts)))


def _window(inst, w):
    """Window ``w`` as an instance of its own (one sampled window)."""
    a, b = inst.routing.window_bounds()[w]
    return dataclasses.replace(inst, routing=Routing(inst.routing.topk[:, :, a:b], inst.routing.heldout_topk))


# ---- the representation and the formats -------------------------------------------------------
def test_routing_checks_its_windows():
    topk = np.zeros((1, 2, 5, 1), dtype=np.int64)
    r = Routing(topk, None, (2, 3))
    assert r.num_windows == 2 and r.window_bounds() == [(0, 2), (2, 5)]
    assert Routing(topk, None).num_windows == 1 and Routing(topk, None).window_bounds() == [(0, 5)]
    for bad in ((5,), (2, 2), (0, 5), (6, -1)):
        with pytest.raises(InvalidInputError, match="routing.window_tokens"):
            Routing(topk, None, bad)


def test_solver_view_keeps_the_windows(tiny):
    inst = _with_windows(tiny, (3, 5), np.random.default_rng(0))
    view = inst.for_solver()
    assert view.routing.heldout_topk is None and view.routing.window_tokens == (3, 5)


def test_windows_round_trip_through_the_formats(tmp_path, tiny):
    inst = _with_windows(tiny, (4, 2, 6), np.random.default_rng(1))
    write_instance(inst, tmp_path / "w.json")
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["routing"]["window_tokens"] == [4, 2, 6]
    again = read_instance(tmp_path / "w.json")
    assert again.routing.window_tokens == (4, 2, 6)
    np.testing.assert_array_equal(again.routing.topk, inst.routing.topk)
    (tmp_path / "again").mkdir()
    write_instance(again, tmp_path / "again" / "w.json")
    assert (tmp_path / "w.json").read_bytes() == (tmp_path / "again" / "w.json").read_bytes()
    assert (tmp_path / "w.npz").read_bytes() == (tmp_path / "again" / "w.npz").read_bytes()


@pytest.mark.parametrize("name", ["tiny", "real_drift", "real_ep64", "dsv3_256"])
def test_one_window_files_have_no_window_field_and_rewrite_identically(tmp_path, name):
    inst = read_instance(INSTANCES / f"{name}.json")
    assert inst.routing.window_tokens is None and inst.routing.num_windows == 1
    write_instance(inst, tmp_path / f"{name}.json")
    assert "window_tokens" not in json.loads((tmp_path / f"{name}.json").read_text())["routing"]


@pytest.mark.parametrize(
    "value,needle",
    [([3], "at least 2 items"), ([3, 0, 5], "integer >= 1"), ([3, 4], "differ from topk"), ("3,5", "an array"),
     ([3, 5.5], "an integer")],
)
def test_bad_window_tokens_exit_2_naming_the_field(tmp_path, tiny, capsys, value, needle):
    inst = _with_windows(tiny, (3, 5), np.random.default_rng(2))
    write_instance(inst, tmp_path / "w.json")
    doc = json.loads((tmp_path / "w.json").read_text())
    doc["routing"]["window_tokens"] = value
    (tmp_path / "w.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="routing.window_tokens") as err:
        read_instance(tmp_path / "w.json")
    assert str(tmp_path / "w.json") in str(err.value)
    assert needle in str(err.value)
    assert main(["evaluate", str(tmp_path / "w.json")]) == 2
    assert "routing.window_tokens" in capsys.readouterr().err


def test_committed_real_robust_is_assembled_from_the_committed_series(tmp_path):
    from placement.sources.realroute.build import assemble_robust

    committed = read_instance(INSTANCES / "real_robust.json")
    c10, c50, final = (read_instance(INSTANCES / f"{n}.json") for n in ("real_ep64_c10", "real_ep64_c50", "real_ep64"))
    assert committed.routing.window_tokens == (c10.routing.tokens_per_source, c50.routing.tokens_per_source)
    np.testing.assert_array_equal(committed.routing.topk, np.concatenate([c10.routing.topk, c50.routing.topk], axis=2))
    np.testing.assert_array_equal(committed.routing.heldout_topk, final.routing.heldout_topk)
    path = assemble_robust(INSTANCES, tmp_path)
    assert path.read_bytes() == (INSTANCES / "real_robust.json").read_bytes()
    assert path.with_suffix(".npz").read_bytes() == (INSTANCES / "real_robust.npz").read_bytes()


# ---- the objectives ---------------------------------------------------------------------------
def _all_class_maps(capacity):
    E = int(sum(capacity))
    for labels in itertools.product(range(len(capacity)), repeat=E):
        e2c = np.array(labels, dtype=np.int64)
        if np.array_equal(np.bincount(e2c, minlength=len(capacity)), capacity):
            yield e2c


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), counts=st.lists(st.integers(1, 5), min_size=2, max_size=3))
def test_robust_objective_is_the_worst_window_by_the_evaluator(seed, counts):
    """For every map of a small layer: the robust value = the largest of the windows' evaluator bytes
    per token, each window cut out as its own instance; the mean fit's crossings = their sum."""
    rng = np.random.default_rng(seed)
    base = random_instance(rng, num_experts=6, top_k=2, ep=3, dp=3, pp=1, num_domains=3, trays_per_domain=1,
                           gpus_per_tray=1, tokens=1, moe_layers=1)
    inst = _with_windows(base, counts, rng)
    r2g = default_rank2gpu(inst)
    for fit in ("robust", "mean"):
        p = build_layer_problem(inst.for_solver(), r2g, 0, group_preserving=False, fit=fit)
        if p.trivial:
            return
        for e2c in _all_class_maps(p.class_capacity):
            # the expert -> slot map that puts every expert in its class (slots of a class in order)
            slots = np.empty(p.num_experts, dtype=np.int64)
            for c in range(p.num_classes):
                slots[np.flatnonzero(e2c == c)] = np.flatnonzero(p.slot2class == c)
            phy2log = np.empty(p.num_experts, dtype=np.int64)
            phy2log[slots] = np.arange(p.num_experts)
            pl = Placement(r2g, phy2log[None, :])
            # the evaluator's bytes per step of each window: crossings per sampled token times a constant
            per_window = [evaluate(_window(inst, w), pl).cross_domain_bytes_per_step for w in range(len(counts))]
            bpc = p.bytes_per_crossing * inst.routing.tokens_per_source * inst.parallel.dp
            all_bytes = evaluate(inst, pl).cross_domain_bytes_per_step
            assert net_crossings(p.nets_all, e2c, p.class_sig, p.cost_mode) * p.bytes_per_crossing == pytest.approx(all_bytes)
            if fit == "robust":
                costs = window_costs(p, p.windows, e2c) * bpc
                np.testing.assert_allclose(costs, per_window, rtol=1e-9, atol=1e-6)
                assert robust_value(p, p.windows, e2c) * bpc == pytest.approx(max(per_window))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), mult=st.lists(st.integers(1, 9), min_size=2, max_size=3))
def test_merged_nets_cost_the_weighted_sum(seed, mult):
    rng = np.random.default_rng(seed)
    base = random_instance(rng, num_experts=6, top_k=2, ep=3, dp=3, pp=1, num_domains=3, trays_per_domain=1,
                           gpus_per_tray=1, tokens=1, moe_layers=1)
    inst = _with_windows(base, [3] * len(mult), rng)
    p = build_layer_problem(inst.for_solver(), default_rank2gpu(inst), 0, group_preserving=False, fit="robust",
                            validation_fraction=0.0)
    if p.trivial:
        return
    merged = merge_nets(p.windows, mult)
    ones = merge_nets(p.windows, [1] * len(mult))
    for _ in range(5):
        e2c = rng.permutation(p.slot2class)
        want = sum(m * net_crossings(w, e2c, p.class_sig, p.cost_mode) for m, w in zip(mult, p.windows))
        assert net_crossings(merged, e2c, p.class_sig, p.cost_mode) == want
        assert net_crossings(ones, e2c, p.class_sig, p.cost_mode) == net_crossings(p.nets_all, e2c, p.class_sig,
                                                                                      p.cost_mode)


def test_window_split_fit_on_earlier_windows_guard_on_the_latest():
    rng = np.random.default_rng(3)
    base = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=1, num_domains=2, trays_per_domain=1,
                           gpus_per_tray=2, tokens=1, moe_layers=1)
    inst = _with_windows(base, (5, 4, 3), rng)
    r2g = default_rank2gpu(inst)
    view = inst.for_solver()
    mean = build_layer_problem(view, r2g, 0, group_preserving=False, fit="mean")
    robust = build_layer_problem(view, r2g, 0, group_preserving=False, fit="robust")
    latest = build_layer_problem(view, r2g, 0, group_preserving=False, fit="latest")
    dp = inst.parallel.dp
    assert (mean.nets_fit.num_tokens, mean.nets_val.num_tokens, mean.nets_all.num_tokens) == (9 * dp, 3 * dp, 12 * dp)
    assert robust.fit_windows == 2 and [w.num_tokens for w in robust.windows] == [5 * dp, 4 * dp, 3 * dp]
    assert robust.nets_val.num_tokens == 3 * dp and not mean.windows
    # latest: the latest window alone, split by index as one window is (3 fit, 0 validation of 3 -> floor)
    assert latest.nets_refit is not None and latest.nets_refit.num_tokens == 3 * dp
    assert latest.nets_all.num_tokens == 12 * dp
    assert latest.nets_fit.num_tokens + latest.nets_val.num_tokens == 3 * dp
    k = inst.model.top_k
    assert latest.load.sum() == 3 * dp * k and mean.load.sum() == robust.load.sum() == 12 * dp * k


# ---- the guard and old instances ----------------------------------------------------------------
def _guard_instance():
    """Two EP ranks in two domains, 4 experts (default: 0, 1 in domain 0; 2, 3 in domain 1), 2 sources
    (source ``j`` in domain ``j``).

    Window 0 (older, 12 tokens per source): tokens {0, 2} and {1, 3}, half each: the default splits
    every token (24 crossings), the map pairing 0 with 2 and 1 with 3 halves that (12).  Window 1
    (latest, 4 per source): source 0 routes {0, 1}, source 1 {2, 3}: 0 crossings on the default,
    8 on the pairing map.  Loads are balanced either way.
    """
    rng = np.random.default_rng(0)
    base = random_instance(rng, num_experts=4, top_k=2, ep=2, dp=2, pp=1, num_domains=2, trays_per_domain=1,
                           gpus_per_tray=1, tokens=1, moe_layers=1)
    w0 = np.tile(np.array([[0, 2], [1, 3]]), (1, 2, 6, 1))  # (1, 2, 12, 2)
    w1 = np.stack([np.tile(np.array([0, 1]), (4, 1)), np.tile(np.array([2, 3]), (4, 1))])[None]  # (1, 2, 4, 2)
    topk = np.concatenate([w0, w1], axis=2)
    return dataclasses.replace(base, routing=Routing(topk, w1, (12, 4)))


@pytest.mark.parametrize("fit", ["robust", "mean"])
def test_guard_keeps_the_default_when_it_is_better_on_the_latest_window(fit):
    inst = _guard_instance()
    r2g = default_rank2gpu(inst)
    view = inst.for_solver()
    opts = SolveOptions(time_limit_s=20, num_workers=1, fit=fit)
    plan = place_experts(view, r2g, opts, deadline=float("inf"), use_pool=False)
    layer = plan.details["layers"][0]
    assert layer["fit"] == fit and plan.details["fit"]["objective"] == fit
    assert layer["candidates"]["local_search"]["fit"] < layer["candidates"]["default"]["fit"]  # the fit wants to move
    assert layer["validation_winner"] == "default" and layer["chosen"] == "default"
    latest = _window(inst, 1)
    got = evaluate(latest, Placement(r2g, plan.phy2log)).cross_domain_bytes_per_step
    default = evaluate(latest, Placement(r2g, np.arange(4)[None, :])).cross_domain_bytes_per_step
    assert got == default == 0
    # Without the guard the mean fit follows the sum (window 0 weighs more) and loses on the latest window.
    if fit == "mean":
        free = place_experts(view, r2g, opts, deadline=float("inf"), use_pool=False, validation_fraction=0.0)
        assert evaluate(latest, Placement(r2g, free.phy2log)).cross_domain_bytes_per_step > default


def test_guard_on_random_instances_never_worse_than_the_default_on_the_latest_window():
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        base = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=3,
                               gpus_per_tray=1, tokens=1, moe_layers=2)
        inst = _with_windows(base, (6, 6, 4), rng)
        for fit in ("robust", "mean"):
            res = placement.solve(inst, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed", fit=fit)
            assert check(inst, res.placement) == []
            assert res.params["fit"] == fit
            latest = _window(inst, 2)
            ours = evaluate(latest, res.placement).cross_domain_bytes_per_layer
            dflt = evaluate(latest, Placement(res.placement.rank2gpu, np.tile(np.arange(8), (2, 1)))).cross_domain_bytes_per_layer
            assert all(a <= b * (1 + 1e-12) for a, b in zip(ours, dflt)), (seed, fit, ours, dflt)


def test_robust_fit_is_no_worse_than_its_start_on_the_worst_window():
    """The chosen map's worst window (over every window) is never above the default's when the
    refit was kept: on random three-window instances, by the evaluator."""
    for seed in range(3):
        rng = np.random.default_rng(200 + seed)
        base = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=1, num_domains=2, trays_per_domain=2,
                               gpus_per_tray=1, tokens=1, moe_layers=1)
        inst = _with_windows(base, (6, 6, 6), rng)
        r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
        plan = place_experts(inst.for_solver(), r2g, SolveOptions(time_limit_s=20, num_workers=1, fit="robust"),
                             deadline=float("inf"), use_pool=False)
        d = plan.details["layers"][0]
        if d.get("status") == "trivial" or d["chosen"] != "refit_all":
            continue
        worst = max(evaluate(_window(inst, w), Placement(r2g, plan.phy2log)).cross_domain_bytes_per_step for w in range(3))
        worst_default = max(evaluate(_window(inst, w), Placement(r2g, np.arange(8)[None, :])).cross_domain_bytes_per_step
                            for w in range(3))
        assert worst <= worst_default * (1 + 1e-12)


def test_one_window_committed_instance_places_the_same_for_every_fit():
    """real_drift (one sampled window), no wall-clock deadline (so the load cannot cut a layer): the
    same maps and the same details for every fit, and no fit entry."""
    inst = read_instance(INSTANCES / "real_drift.json").for_solver()
    r2g = default_rank2gpu(inst)
    plans = [place_experts(inst, r2g, SolveOptions(time_limit_s=10, work_budget_s=2, num_workers=1, fit=fit),
                           deadline=float("inf"), use_pool=False, layers=[0, 3]) for fit in ("robust", "mean", "latest")]
    for p in plans[1:]:
        np.testing.assert_array_equal(p.phy2log, plans[0].phy2log)
        assert json.dumps(p.details, sort_keys=True) == json.dumps(plans[0].details, sort_keys=True)
    assert "fit" not in plans[0].details and all("fit" not in d for d in plans[0].details["layers"])


@pytest.mark.parametrize("name", ["tiny"])
def test_one_window_instances_solve_the_same_for_every_fit(tmp_path, name):
    """The fit only weighs several windows: with one, every value writes the same placement file."""
    args = ["solve", str(INSTANCES / f"{name}.json"), "--time-limit", "30", "--workers", "1", "--layout", "fixed"]
    files = []
    for fit in ("robust", "mean", "latest"):
        out = tmp_path / f"{fit}.json"
        assert main([*args, "-o", str(out), "--fit", fit]) == 0
        doc = json.loads(out.read_text())
        details = doc["solve"]["details"]
        assert "fit" not in doc["params"] and "fit" not in details
        assert all("fit" not in d for d in details["layers"])
        files.append(out.read_bytes())
    assert files[0] == files[1] == files[2]


def test_fit_is_checked():
    with pytest.raises(InvalidInputError, match="fit"):
        placement.solve(read_instance(INSTANCES / "tiny.json"), fit="worst")  # type: ignore[arg-type]


# ---- the importers ------------------------------------------------------------------------------
def test_import_cuts_the_fit_steps_into_time_ordered_windows(tmp_path, capsys):
    from placement.sources.importers import import_instance
    from tests.test_importers import _expected, _routing, _sections, _write_megatron

    ids = _routing(np.random.default_rng(7), steps=7, micro=1, tokens=4)
    paths = _write_megatron(tmp_path / "traces", ids)
    sec = _sections(tmp_path)
    one = import_instance("megatron", paths, **sec, heldout_steps=2)
    three = import_instance("megatron", paths, **sec, heldout_steps=2, windows=3)
    assert one.routing.window_tokens is None
    # fit steps 0..4 -> windows [0], [1, 2], [3, 4] (cuts 5*i//3), each its own equalised window
    assert three.routing.window_tokens == (4, 8, 8)
    np.testing.assert_array_equal(three.routing.topk, _expected(ids, [0, 1, 2, 3, 4]))
    np.testing.assert_array_equal(three.routing.topk, one.routing.topk)
    np.testing.assert_array_equal(three.routing.heldout_topk, _expected(ids, [5, 6]))
    gen = three.extra["generator"]["windows"]
    assert [w["steps"] for w in gen["sampled"]] == [[0], [1, 2], [3, 4]] and gen["heldout"]["steps"] == [5, 6]
    assert "sampled" not in one.extra["generator"]["windows"]
    # through the CLI: written, read back, solved with every fit
    out = tmp_path / "w.json"
    assert main(["import", "--from", "megatron", *paths, "--model", sec["model"], "--parallel", sec["parallel"],
                 "--cluster", sec["cluster"], "--heldout-steps", "2", "--windows", "3", "-o", str(out)]) == 0
    assert "3 sampled windows" in capsys.readouterr().out
    assert read_instance(out).routing.window_tokens == (4, 8, 8)
    for fit in ("robust", "mean", "latest"):
        assert main(["solve", str(out), "--time-limit", "20", "--workers", "1", "--fit", fit,
                     "-o", str(tmp_path / f"p_{fit}.json")]) == 0
        assert json.loads((tmp_path / f"p_{fit}.json").read_text())["params"]["fit"] == fit
        assert main(["verify", str(out), str(tmp_path / f"p_{fit}.json")]) == 0
    with pytest.raises(InvalidInputError, match="--windows"):
        import_instance("megatron", paths, **sec, heldout_steps=2, windows=6)
    with pytest.raises(InvalidInputError, match="--windows"):
        import_instance("megatron", paths, **sec, windows=0)


# -- which maps the search fits (SolveOptions.fit_groups_whole) --------------------------------------
def test_fit_groups_whole_follows_the_measured_drift(tiny):
    """Under group-limited routing with any map valid: one window fits groups whole; two windows
    that repeat each other (gain kept 1) fit free maps; two windows whose loads disagree (gain kept 0)
    fit groups whole; an explicit choice wins; without group-limited routing, free."""
    from solvers.experts.windows import FREE_FIT_MIN_GAIN_KEPT, gain_kept

    opts = SolveOptions(apply="runtime")
    assert tiny.model.group_limited and opts.fit_groups_whole(tiny)
    t = np.asarray(tiny.routing.topk)
    same = dataclasses.replace(tiny, routing=Routing(np.concatenate([t, t], axis=2), None,
                                                     window_tokens=(t.shape[2], t.shape[2])))
    assert gain_kept(same.routing.topk, same.routing.window_bounds(), 16) == 1.0
    assert not opts.fit_groups_whole(same)
    # The second window: every expert relabelled inside its group by a per-layer rotation that
    # makes its loads say nothing of the first's (flat within groups after averaging).
    E, G = tiny.model.num_experts, tiny.model.num_groups
    gs = E // G
    flipped = (t // gs) * gs + (gs - 1 - t % gs)  # hot experts of a group become its cold ones
    other = dataclasses.replace(tiny, routing=Routing(np.concatenate([t, flipped.astype(t.dtype)], axis=2), None,
                                                      window_tokens=(t.shape[2], t.shape[2])))
    kept = gain_kept(other.routing.topk, other.routing.window_bounds(), E)
    assert kept < FREE_FIT_MIN_GAIN_KEPT
    assert opts.fit_groups_whole(other)
    assert not SolveOptions(apply="runtime", group_preserving=False).fit_groups_whole(tiny)
    assert SolveOptions(apply="checkpoint").fit_groups_whole(same)  # required there, whatever the drift
    ungrouped = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, num_groups=1, groups_per_token=1))
    assert not opts.fit_groups_whole(ungrouped)
