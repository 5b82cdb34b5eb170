"""The peers measured in benchmarks/peers.py: packed layout, DeepSeek EPLB's packing, Mt-KaHyPar."""

from __future__ import annotations

import dataclasses
import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers.eplb
import solvers.kahypar
from placement.core.checker import check
from placement.predict.cost import evaluate
from placement.core.model import Instance, InvalidInputError, Placement
from solvers import SOLVERS, SolveOptions
from solvers.default import default_placement
from solvers.eplb import balanced_packing, hierarchical_packing, pack_within_nodes, stage_rank_nodes
from solvers.kahypar import km1, layer_nets, repair_capacities
from solvers.packed import packed_rank2gpu
from tests.conftest import random_instance

PEERS = ["packed", "eplb", "kahypar"]


def _with_available(inst: Instance, available: np.ndarray) -> Instance:
    return dataclasses.replace(inst, cluster=dataclasses.replace(inst.cluster, available=available))


def _run(name: str, inst: Instance):
    if name == "kahypar":
        pytest.importorskip("mtkahypar")
    return SOLVERS[name](inst.for_solver(), SolveOptions(time_limit_s=30, seed=0, num_workers=1))


def test_doctests():
    for module in (solvers.eplb, solvers.kahypar):
        assert doctest.testmod(module).failed == 0


# --------------------------------------------------------------------------------------------- all
@pytest.mark.parametrize("name", PEERS)
def test_peer_placement_passes_checker(name, tiny):
    result = _run(name, tiny)
    assert result.solver == name
    assert check(tiny, result.placement) == []
    assert result.objective_bytes == pytest.approx(evaluate(tiny, result.placement).cross_domain_bytes_per_step)


@pytest.mark.parametrize("name", PEERS)
def test_peer_on_random_instance_with_two_groups_per_stage(name):
    inst = random_instance(np.random.default_rng(3), num_experts=8, ep=2, dp=4, pp=2, num_domains=3,
                           trays_per_domain=1, gpus_per_tray=3, tokens=12)
    assert inst.parallel.ep_groups_per_stage == 2
    result = _run(name, inst)
    assert check(inst, result.placement) == []


# --------------------------------------------------------------------------------------------- packed
def test_packed_puts_each_group_in_one_rack_when_one_fits():
    # 4 racks of 8 GPUs; free GPUs per rack 7, 4, 8, 5; two EP groups of 4 (pp=2, dp=4, ep=4).
    inst = random_instance(np.random.default_rng(0), ep=4, dp=4, pp=2, num_domains=4,
                           trays_per_domain=4, gpus_per_tray=2)
    avail = np.ones(32, dtype=bool)
    avail[[0]] = False  # rack 0: 7 free
    avail[8:12] = False  # rack 1: 4 free
    avail[24:27] = False  # rack 3: 5 free
    inst = _with_available(inst, avail)
    r2g = packed_rank2gpu(inst)
    dom = inst.cluster.gpu2domain[r2g[inst.parallel.stage_ep_groups.reshape(-1, 4)]]
    # Best fit: group 0 into rack 1 (exactly 4 free), then group 1 into rack 3 (5 free, the fewest >= 4).
    assert dom[0].tolist() == [1, 1, 1, 1]
    assert dom[1].tolist() == [3, 3, 3, 3]
    assert check(inst, Placement(r2g, np.tile(np.arange(8), (3, 1)))) == []


def test_packed_leftover_groups_use_as_few_racks_as_possible():
    # 3 racks of 8, 2 free in rack 0, 6 free in rack 1, 4 free in rack 2; one EP group of 8.
    inst = random_instance(np.random.default_rng(0), ep=8, dp=8, pp=1, num_domains=3,
                           trays_per_domain=4, gpus_per_tray=2, moe_layers=2)
    avail = np.zeros(24, dtype=bool)
    avail[[0, 1]] = True
    avail[8:14] = True
    avail[16:20] = True
    inst = _with_available(inst, avail)
    r2g = packed_rank2gpu(inst)
    racks = set(inst.cluster.gpu2domain[r2g].tolist())
    # Brute force: the fewest racks whose free GPUs cover 8.
    free = np.bincount(inst.cluster.gpu2domain[inst.cluster.available_gpus], minlength=3)
    fewest = min(len(c) for n in range(1, 4) for c in itertools.combinations(range(3), n) if free[list(c)].sum() >= 8)
    assert len(racks) == fewest == 2
    assert racks == {0, 1}  # the largest rack (6 free), then the best fit for the remaining 2 (rack 0)
    assert sorted(r2g.tolist()) == r2g.tolist()  # EP ranks in sorted GPU order


# --------------------------------------------------------------------------------------------- EPLB
def test_balanced_packing_respects_counts_and_beats_contiguous_on_skew():
    rng = np.random.default_rng(1)
    w = rng.zipf(1.6, size=64).astype(float)
    packs = balanced_packing(w, np.full(16, 4))
    assert np.bincount(packs, minlength=16).tolist() == [4] * 16
    lpt = np.bincount(packs, weights=w, minlength=16)
    contiguous = w.reshape(16, 4).sum(axis=1)
    assert lpt.max() / lpt.mean() <= contiguous.max() / contiguous.mean()
    assert lpt.max() < contiguous.max()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=6, max_size=6), st.sampled_from([(3, 3), (2, 2, 2), (4, 2)]))
def test_balanced_packing_max_pack_close_to_brute_force(weights, caps):
    w = np.array(weights, dtype=float)
    packs = balanced_packing(w, np.array(caps))
    assert (np.bincount(packs, minlength=len(caps)) <= np.array(caps)).all()
    got = np.bincount(packs, weights=w, minlength=len(caps)).max()
    best = np.inf
    for assign in itertools.product(range(len(caps)), repeat=len(w)):
        a = np.array(assign)
        if (np.bincount(a, minlength=len(caps)) == np.array(caps)).all():
            best = min(best, np.bincount(a, weights=w, minlength=len(caps)).max())
    # LPT with equal cardinalities is within 4/3 of the optimum plus the largest item (loose, safe).
    assert got <= best * 4 / 3 + w.max() + 1e-9


def test_balanced_packing_rejects_too_small_packs():
    with pytest.raises(InvalidInputError, match="do not fit"):
        balanced_packing(np.ones(5), np.array([2, 2]))


def test_hierarchical_packing_equal_nodes_gives_whole_groups_and_equal_counts():
    rng = np.random.default_rng(7)
    num_experts, num_groups, ep, epr = 32, 8, 8, 4
    load = rng.zipf(1.5, size=num_experts).astype(float)
    rank2node = np.repeat(np.arange(4), 2)  # 4 nodes of 2 GPUs
    phy2log = hierarchical_packing(load, num_groups, rank2node, epr)
    assert sorted(phy2log.tolist()) == list(range(num_experts))
    expert2rank = np.empty(num_experts, dtype=int)
    expert2rank[phy2log] = np.arange(num_experts) // epr
    expert2node = rank2node[expert2rank]
    # Every group whole on one node, and every node holds num_groups / num_nodes groups.
    group_node = expert2node.reshape(num_groups, -1)
    assert (group_node == group_node[:, :1]).all()
    assert np.bincount(group_node[:, 0], minlength=4).tolist() == [2, 2, 2, 2]
    # Groups to nodes: heaviest group first into the lightest node with room (EPLB's rule).
    group_load = load.reshape(num_groups, -1).sum(axis=1)
    heaviest = np.argsort(-group_load, kind="stable")
    assert group_node[heaviest[0], 0] == 0 and group_node[heaviest[1], 0] == 1
    # Load per GPU balances better than the contiguous map.
    gpu = np.bincount(expert2rank, weights=load, minlength=ep)
    contiguous = load.reshape(ep, epr).sum(axis=1)
    assert gpu.max() / gpu.mean() < contiguous.max() / contiguous.mean()


def test_hierarchical_packing_unequal_nodes_is_capacity_proportional():
    load = np.arange(32, 0, -1, dtype=float)
    # ep = 8, 4 experts per rank, 8 groups of 4: node 0 has 6 GPUs (24 slots = 6 groups), node 1 has 2.
    rank2node = np.array([0, 0, 0, 1, 1, 0, 0, 0])
    phy2log = hierarchical_packing(load, 8, rank2node, 4)
    expert2rank = np.empty(32, dtype=int)
    expert2rank[phy2log] = np.arange(32) // 4
    group_node = rank2node[expert2rank].reshape(8, 4)
    assert (group_node == group_node[:, :1]).all()
    assert np.bincount(group_node[:, 0], minlength=2).tolist() == [6, 2]


def test_hierarchical_packing_splits_only_groups_that_fit_nowhere():
    load = np.ones(16)
    # ep 8, 2 experts per rank, 2 groups of 8: nodes of 3 and 5 GPUs hold 6 and 10 experts.
    rank2node = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    phy2log = hierarchical_packing(load, 2, rank2node, 2)
    expert2rank = np.empty(16, dtype=int)
    expert2rank[phy2log] = np.arange(16) // 2
    expert2node = rank2node[expert2rank]
    assert np.bincount(expert2node, minlength=2).tolist() == [6, 10]
    whole = [g for g in range(2) if len(set(expert2node[g * 8 : (g + 1) * 8].tolist())) == 1]
    assert len(whole) == 1  # one group fits whole in the 10-slot node, the other is split


def test_pack_within_nodes_rejects_wrong_counts():
    with pytest.raises(InvalidInputError, match="node 0 got"):
        pack_within_nodes(np.ones(4), np.array([0, 0, 0, 1]), np.array([0, 1]), 2)


def test_stage_rank_nodes_refines_domains_over_groups():
    inst = random_instance(np.random.default_rng(0), num_experts=8, ep=4, dp=8, pp=1, num_domains=3,
                           trays_per_domain=2, gpus_per_tray=2, moe_layers=1)
    # Two EP groups of 4 ranks: group 0 on GPUs 0..3 (domain 0), group 1 on GPUs 6, 7 (domain 1)
    # and 8, 9 (domain 2): EP ranks 0, 1 share domains in both groups, and so do 2, 3.
    r2g = np.array([0, 1, 2, 3, 6, 7, 8, 9])
    assert stage_rank_nodes(inst, r2g, 0).tolist() == [0, 0, 1, 1]
    r2g = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # group 1 in domain 1 entirely
    assert stage_rank_nodes(inst, r2g, 0).tolist() == [0, 0, 0, 0]


def test_eplb_balances_better_than_default_on_tiny(tiny):
    result = _run("eplb", tiny)
    assert evaluate(tiny, result.placement).expert_load_max_over_mean < evaluate(
        tiny, default_placement(tiny)
    ).expert_load_max_over_mean


# --------------------------------------------------------------------------------------------- kahypar
def test_km1_against_sets():
    rng = np.random.default_rng(5)
    nets = rng.integers(0, 10, size=(40, 4))
    weights = rng.integers(1, 5, size=40)
    v2b = rng.integers(0, 3, size=10)
    want = sum(int(w) * (len({int(v2b[v]) for v in row}) - 1) for row, w in zip(nets, weights))
    assert km1(nets, weights, v2b) == want


def test_repair_capacities_fixes_overfull_blocks_with_the_cheapest_move():
    # Experts 0..3, source vertices 4 (block 0) and 5 (block 1); block capacities 2 and 2.
    nets = np.array([[4, 0, 1], [4, 0, 2], [5, 3, 2], [5, 3, 3]])
    weights = np.array([5, 1, 1, 1])
    v2b = np.array([0, 0, 0, 1, 0, 1])  # block 0 holds experts 0, 1, 2: one too many
    out = repair_capacities(nets, weights, v2b, np.arange(4), np.array([2, 2]))
    assert np.bincount(out[:4], minlength=2).tolist() == [2, 2]
    # Moving expert 2 costs 1 - 1 = 0 (joins net 2's block, leaves net 1 cut); 0 or 1 would cost more.
    assert out[2] == 1 and out[4:].tolist() == [0, 1]
    brute = min(
        km1(nets, weights, np.array([*a, 0, 1]))
        for a in itertools.product(range(2), repeat=4)
        if sum(a) == 2
    )
    assert km1(nets, weights, out) == brute
    untouched = repair_capacities(nets, weights, out, np.arange(4), np.array([2, 2]))
    assert (untouched == out).all()


def test_layer_nets_merge_identical_tokens():
    topk = np.array([[[0, 1], [1, 0], [2, 3]]])  # one source, three tokens; the first two identical
    nets, weights = layer_nets(topk, np.zeros((1, 3), dtype=int), 4, "per_domain")
    assert nets.tolist() == [[4, 0, 1], [4, 2, 3]] and weights.tolist() == [2, 1]
    nets, weights = layer_nets(topk, np.zeros((1, 3), dtype=int), 4, "per_pair")
    assert nets.tolist() == [[4, 0], [4, 1], [4, 2], [4, 3]] and weights.tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("cost_mode", ["per_domain", "per_pair"])
def test_kahypar_respects_capacities_matches_evaluator_and_beats_default(tiny, cost_mode):
    inst = tiny.with_cost_mode(cost_mode)
    result = _run("kahypar", inst)
    assert check(inst, result.placement) == []
    assert result.details["unsolved_layers"] == []
    for facts in result.details["layers"]:
        if facts["km1_initial"] is not None:  # the best of the starts, never worse than the default
            assert facts["km1"] <= min(facts["km1_initial"], facts["km1_refined"])
    # KM1 summed over layers is the evaluator's crossing count (one EP group per stage: exact).
    par, m = inst.parallel, inst.model
    copies = sum(f["km1"] for f in result.details["layers"])
    weight = par.tokens_per_dp_rank_per_step / inst.routing.tokens_per_source
    cross = evaluate(inst, result.placement).cross_domain_bytes_per_step
    assert cross == pytest.approx(copies * weight * m.roundtrip_bytes_per_copy)
    assert cross <= evaluate(inst, default_placement(inst)).cross_domain_bytes_per_step + 1e-6


def test_kahypar_is_deterministic(tiny):
    a = _run("kahypar", tiny).placement
    b = _run("kahypar", tiny).placement
    assert (a.phy2log == b.phy2log).all()


def test_kahypar_missing_module_gives_install_hint(monkeypatch, tiny):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "mtkahypar":
            raise ImportError("no mtkahypar")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    from placement.core.model import SolverError

    with pytest.raises(SolverError, match=r"pip install -e '\.\[peers\]'"):
        SOLVERS["kahypar"](tiny.for_solver(), SolveOptions(time_limit_s=5))


def _tiny_layer_job(tiny):
    from placement.predict.cost import LayoutIndex
    from solvers.default import default_rank2gpu

    r2g = default_rank2gpu(tiny)
    layout = LayoutIndex(tiny, r2g, tiny.routing.tokens_per_source)
    rank2node = stage_rank_nodes(tiny, r2g, 0)
    epr = tiny.experts_per_rank
    return {"topk": np.asarray(tiny.routing.topk[0]), "src_block": rank2node[layout.rank2eprank[layout.src_rank[0]]],
            "capacities": np.bincount(rank2node) * epr, "cost_mode": tiny.cost_mode,
            "initial": rank2node[np.arange(tiny.model.num_experts) // epr], "seed": 0, "num_threads": 1}


def test_partition_layer_starts_stream_improving_bests_ending_in_partition_layer(tiny):
    pytest.importorskip("mtkahypar")
    job = _tiny_layer_job(tiny)
    steps = list(solvers.kahypar.partition_layer_starts(**job))
    assert [f["start"] for _, f in steps][0] == "initial" and len(steps) == 3
    assert [f["complete"] for _, f in steps] == [False, False, True]
    values = [f["km1"] for _, f in steps]
    assert values == sorted(values, reverse=True)  # each item is the best so far
    assert steps[0][1]["km1"] == steps[0][1]["km1_initial"] and steps[0][1]["km1_refined"] is None
    e2b, facts = solvers.kahypar.partition_layer(**job)
    assert (e2b == steps[-1][0]).all() and facts == {k: v for k, v in steps[-1][1].items() if k != "complete"}
    assert facts["km1"] == min(facts["km1_initial"], facts["km1_refined"], km1(
        *layer_nets(job["topk"], job["src_block"], tiny.model.num_experts, tiny.cost_mode),
        np.concatenate([e2b, np.arange(len(job["capacities"]))])))


def test_kahypar_worker_reraises_the_childs_error(tiny):
    pytest.importorskip("mtkahypar")
    import time

    job = _tiny_layer_job(tiny)
    job["initial"] = np.zeros_like(job["initial"])  # every expert in block 0: over its capacity
    with pytest.raises(InvalidInputError, match="initial map exceeds"):
        solvers.kahypar._partition_until(job, SolveOptions(), time.monotonic() + 60, lambda: None)


# Wall-clock slack allowed past a tiny limit on the wide instance: killing the child, then balancing
# the one cut layer and scoring (measured 0.6-1.9 s on the loaded 2-core build machine; before the
# child process, a single layer ran 25-60 s past any limit).
WIDE_SLACK_S = 20.0


@pytest.mark.exclusive  # a wall-clock bound (tests/machine_share.py)
def test_kahypar_honours_a_tiny_time_limit_inside_a_wide_layer():
    """Mt-KaHyPar cannot be interrupted; the peer kills its child at the deadline, keeps the best
    start finished by then and returns a valid placement."""
    pytest.importorskip("mtkahypar")
    import time

    from placement.formats import read_instance
    from placement.core.model import Routing
    from tests.conftest import INSTANCES

    inst = read_instance(INSTANCES / "real_ep64.json").for_solver()
    num_layers, dp, _, k = inst.routing.topk.shape
    # real_ep64's shape (EP64 over 4 domains) with 1,400 random group-limited tokens per source (4 of
    # 8 groups, 8 of their 32 experts): ~90k distinct nets per layer, 25-60 s per layer on the build
    # machine.
    rng = np.random.default_rng(0)
    m = inst.model
    gs = m.num_experts // m.num_groups
    groups = np.argsort(rng.random((num_layers, dp, 1400, m.num_groups)), axis=-1)[..., :m.groups_per_token]
    pick = np.argsort(rng.random((num_layers, dp, 1400, m.groups_per_token * gs)), axis=-1)[..., :k]
    topk = np.take_along_axis(groups, pick // gs, axis=-1) * gs + pick % gs
    inst = dataclasses.replace(inst, routing=Routing(topk, None))
    limit_s = 2.0
    t0 = time.monotonic()
    result = SOLVERS["kahypar"](inst, SolveOptions(time_limit_s=limit_s, seed=0, num_workers=1))
    wall_s = time.monotonic() - t0
    assert wall_s <= limit_s + WIDE_SLACK_S
    assert check(inst, result.placement) == []
    facts = result.details["layers"]
    assert [f["layer"] for f in facts] == list(range(num_layers))
    identity = np.arange(inst.model.num_experts)
    for f in facts:
        if f["layer"] in result.details["unsolved_layers"]:
            assert (result.placement.phy2log[f["layer"]] == identity).all()
        else:
            assert f["solved"] or f["layer"] in result.details["cut_layers"]


# --------------------------------------------------------------------------------------------- benchmark
def _benchmark_module():
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("peers_benchmark", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_runs_on_tiny_and_writes_json(tmp_path, capsys):
    import json

    bench = _benchmark_module()
    out = tmp_path / "peers.json"
    assert bench.main(["--instances", "tiny", "--peers", "default,packed,eplb", "--time-limit", "5",
                       "--workers", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (inst,) = doc["instances"]
    rows = {r["solver"]: r for r in inst["rows"]}
    assert set(rows) >= {"default", "packed", "eplb", bench.OURS}
    best = inst["target"]["best_peer"]
    assert rows[best]["ratio_to_best_peer"] == pytest.approx(1.0)
    for name in ("default", "packed", "eplb"):
        assert rows[name]["ratio_to_best_peer"] >= 1.0 - 1e-12
        assert rows[name]["metrics"]["heldout_cross_domain_bytes_per_step"] > 0
    for r in rows.values():  # the limit removes communication only: never below the step it bounds
        m = r["metrics"]
        for setting in bench.SETTINGS:
            limit = m[f"heldout_compute_bound_tflops_per_gpu_{setting}"]
            assert limit >= m[f"heldout_predicted_tflops_per_gpu_{setting}"] * (1 - 1e-12)
            assert np.isfinite(limit)
        assert r["pipeline_layout"].count("|") + r["pipeline_layout"].count(",") >= 1
    table = capsys.readouterr().out
    assert "| packed |" in table and "lower bound" in table

    # --keep-pipeline-layout keeps the instance's own layout on every row
    assert bench.main(["--instances", "tiny", "--peers", "default", "--time-limit", "5", "--workers", "1",
                       "--keep-pipeline-layout", "--json", str(out)]) == 0
    from placement.formats import read_instance
    from placement.core.pipeline_layout import instance_chunks, render_layout
    from tests.conftest import ROOT

    kept = render_layout(instance_chunks(read_instance(ROOT / "instances" / "tiny.json")))
    assert {r["pipeline_layout"] for r in json.loads(out.read_text())["instances"][0]["rows"]} == {kept}


def test_target_check_against_hand_made_rows():
    bench = _benchmark_module()

    def row(name, held, load, wall):
        return {"solver": name, "wall_s": wall,
                "metrics": {"heldout_cross_domain_bytes_per_step": held, "heldout_expert_load_max_over_mean": load}}

    rows = [row("default", 100.0, 1.5, 1.0), row("packed", 80.0, 1.4, 2.0), row(bench.OURS, 78.0, 1.3, 3.0)]
    t = bench.target_check(rows)
    assert t["best_peer"] == "packed" and t["ratio"] == pytest.approx(78 / 80)
    assert not t["ratio_ok"] and t["load_ok"] and t["time_ok"] and t["met"] is False
    rows[-1] = row(bench.OURS, 76.0 * 0.9, 1.45, 5.0)
    t = bench.target_check(rows)
    assert t["ratio_ok"] and not t["load_ok"] and not t["time_ok"]
    assert bench.target_check(rows[:2])["met"] is None


def test_kahypar_stops_at_the_deadline_with_a_valid_placement(tiny):
    pytest.importorskip("mtkahypar")
    import time

    options = SolveOptions(time_limit_s=1, seed=0, num_workers=1, deadline=time.monotonic() - 1)
    result = SOLVERS["kahypar"](tiny.for_solver(), options)
    assert result.details["unsolved_layers"] == list(range(tiny.model.num_moe_layers))
    assert check(tiny, result.placement) == []
    assert (result.placement.phy2log == default_placement(tiny).phy2log).all()


# --------------------------------------------------------------------------------------------- ours vs peers
@pytest.fixture(scope="module")
def tiny_ours_and_peers():
    """Ours in its default mode (apply runtime, step_time) and every peer of benchmarks/peers.py on
    tiny, solved once for the tests below."""
    import placement
    from placement.formats import read_instance
    from tests.conftest import INSTANCES

    inst = read_instance(INSTANCES / "tiny.json")
    ours = placement.solve(inst, time_limit_s=10, seed=0, num_workers=1)
    peers = {}
    for name in ["default", *PEERS]:
        if name == "kahypar":
            try:
                import mtkahypar  # noqa: F401
            except ImportError:
                continue
        peers[name] = placement.solve(inst, solver=name, time_limit_s=30, seed=0, num_workers=1)
    return ours, peers


def test_ours_default_mode_predicts_at_least_every_peer_on_the_sampled_window_at_every_setting(tiny_ours_and_peers):
    """issue 21 item 6 on the small instance, on what the solve sees: ours in its default mode against
    every peer of benchmarks/peers.py, in predicted TFLOP/s per GPU on the sampled window at the low,
    mid and high settings of the step-time model (each with the pipeline split its solve chose), and
    the choice made in the drift scenario with the packed peer's layout among the candidates."""
    from placement.predict.performance import SETTINGS

    ours, peers = tiny_ours_and_peers
    assert ours.params["apply"] == "runtime"
    for name, peer in peers.items():
        for setting in SETTINGS:
            key = f"predicted_tflops_per_gpu_{setting}"
            assert ours.metrics[key] >= peer.metrics[key] * (1 - 1e-9), (name, setting, ours.metrics[key], peer.metrics[key])
    check = ours.details["step_time_check"]
    assert "packed layout, contiguous experts" in check["candidates"]
    top = max(c["drift_worst_ratio"] for c in check["candidates"].values())
    assert check["candidates"][check["returned"]]["drift_worst_ratio"] >= top * (1 - 1e-9)


@pytest.mark.xfail(strict=True, reason=(
    "tiny's held-out window drifts away from its one sampled window (generator drift 0.7; the slope of "
    "held-out expert loads on sampled ones, solvers.experts.windows.gain_kept, is 0): every map fitted to "
    "the sampled loads loses its balance there (expert load max/mean 1.13 sampled -> 1.43 held-out, against "
    "1.26 for contiguous experts). Ours predicts 87.4 / 90.2 / 94.8 held-out TFLOP/s against packed's "
    "89.7 / 92.7 / 97.7 (low / mid / high), while on the sampled window ours leads packed 102.6 against "
    "89.4 at mid with packed's layout among the candidates, and a work budget 7x larger returns the same "
    "placement. Since the chosen pipeline split (with the instance's split ours leads on held-out too, "
    "70.1 against 69.0 at mid); one sampled window cannot measure this drift"))
def test_ours_default_mode_predicts_at_least_every_peer_held_out_tflops_at_every_setting(tiny_ours_and_peers):
    """issue 21 item 6 on the small instance: ours in its default mode (apply runtime, step_time) against
    every peer of benchmarks/peers.py, in predicted held-out TFLOP/s per GPU at the low, mid and high
    settings of the step-time model."""
    from placement.predict.performance import SETTINGS

    ours, peers = tiny_ours_and_peers
    for name, peer in peers.items():
        for setting in SETTINGS:
            key = f"heldout_predicted_tflops_per_gpu_{setting}"
            assert ours.metrics[key] >= peer.metrics[key] * (1 - 1e-9), (name, setting, ours.metrics[key], peer.metrics[key])
