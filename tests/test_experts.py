"""The expert placer (solvers/experts/) and its bounds (solvers/experts/bounds.py).

References are brute force over every map on small random instances, and the evaluator
(placement.predict.cost.evaluate) for every cost the placer computes itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.core.checker import check, violates_group_preservation
from placement.predict.cost import evaluate
from placement.core.model import InvalidInputError, Placement
from solvers.base import SolveOptions
from solvers.default import default_rank2gpu
from solvers.experts import (
    LayerWorker,
    StopCheck,
    balance_ranks,
    build_layer_problem,
    deterministic_budget,
    greedy_expert_domains,
    group_search,
    linear_costs,
    net_crossings,
    per_pair_class_bound,
    place_experts,
    rank_load_ratio,
    sum_bounds,
    transport_optimum,
)
from tests.conftest import random_instance, random_placement


def _straddling(rng, **kw):
    """A random instance and a random rank layout (so stages straddle domains)."""
    inst = random_instance(rng, **kw)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    return inst, r2g


def _all_class_maps(capacity):
    """Every expert -> class map with exactly ``capacity[c]`` experts in class ``c`` (each once)."""
    E = int(sum(capacity))

    def rec(free, c, e2c):
        if c == len(capacity) - 1:
            e2c[list(free)] = c
            yield e2c.copy()
            return
        for chosen in itertools.combinations(free, int(capacity[c])):
            e2c[list(chosen)] = c
            yield from rec(tuple(e for e in free if e not in chosen), c + 1, e2c)

    yield from rec(tuple(range(E)), 0, np.empty(E, dtype=np.int64))


def _all_group_preserving_maps(problem):
    """Every expert -> class map in which some bijection of expert groups onto group positions gives
    each group its position's class counts (the definition :func:`_group_preserving` checks), made
    directly: per bijection, every arrangement of each group's experts over its position's classes.
    (Filtering every class map instead grows as the multinomial of all experts over all classes,
    hours once a straddling layout has one class per EP rank.)"""
    gs, B = problem.expert_group_size, problem.num_group_positions
    s2c = problem.slot2class
    seen = set()
    for perm in itertools.permutations(range(B)):
        per_group = []
        for p in range(B):
            classes = sorted(s2c[perm[p] * gs:(perm[p] + 1) * gs].tolist())
            per_group.append(sorted(set(itertools.permutations(classes))))
        for choice in itertools.product(*per_group):
            key = tuple(c for arrangement in choice for c in arrangement)
            if key not in seen:
                seen.add(key)
                yield np.array(key, dtype=np.int64)


def _group_preserving(problem, e2c):
    """Independent check: some bijection of expert groups onto group positions matches every group's class counts."""
    gs, B, C = problem.expert_group_size, problem.num_group_positions, problem.num_classes
    s2c = problem.slot2class
    block = [np.bincount(s2c[b * gs:(b + 1) * gs], minlength=C).tolist() for b in range(B)]
    group = [np.bincount(e2c[p * gs:(p + 1) * gs], minlength=C).tolist() for p in range(B)]
    return any(all(group[p] == block[perm[p]] for p in range(B)) for perm in itertools.permutations(range(B)))


# ---------------------------------------------------------------------------------------------
# Costs agree with the evaluator
# ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]), tp=st.sampled_from([1, 2]),
       ep=st.sampled_from([2, 4]))
def test_net_crossings_match_the_evaluator(seed, mode, tp, ep):
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=3, ep=ep, dp=4 // tp, tp=tp, pp=2, num_domains=3,
                           trays_per_domain=2, gpus_per_tray=2, tokens=7, moe_layers=3, cost_mode=mode)
    pl = random_placement(rng, inst)
    metrics = evaluate(inst, pl)
    e2r = pl.expert2eprank(inst.experts_per_rank)
    for li in range(inst.model.num_moe_layers):
        want = metrics.cross_domain_bytes_per_layer[li]
        problem = build_layer_problem(inst, pl.rank2gpu, li, group_preserving=False, validation_fraction=0.25)
        e2c = problem.rank2class[e2r[li]]
        got = net_crossings(problem.nets_all, e2c, problem.class_sig, mode) * problem.bytes_per_crossing
        assert got == pytest.approx(want, rel=1e-12)
        # the fit and validation parts partition the sampled tokens
        parts = [net_crossings(n, e2c, problem.class_sig, mode) for n in (problem.nets_fit, problem.nets_val)]
        if not problem.trivial:
            assert sum(parts) * problem.bytes_per_crossing == pytest.approx(want, rel=1e-12)
            assert problem.nets_fit.num_tokens + problem.nets_val.num_tokens == problem.nets_all.num_tokens


def test_net_crossings_on_the_held_out_window_match_the_evaluator():
    rng = np.random.default_rng(3)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, tokens=6)
    pl = random_placement(rng, inst)
    held = evaluate(inst, pl, window="heldout").cross_domain_bytes_per_layer
    e2r = pl.expert2eprank(inst.experts_per_rank)
    as_sampled = dataclasses.replace(inst, routing=dataclasses.replace(inst.routing, topk=inst.routing.heldout_topk))
    for li in range(3):
        problem = build_layer_problem(as_sampled, pl.rank2gpu, li, group_preserving=False, validation_fraction=0)
        got = net_crossings(problem.nets_all, problem.rank2class[e2r[li]], problem.class_sig, inst.cost_mode)
        assert got * problem.bytes_per_crossing == pytest.approx(held[li], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Small instances: the pipeline returns the proved optimum (brute force over every map)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_free_mode_returns_the_brute_force_optimum(seed, mode):
    rng = np.random.default_rng(seed)
    inst, r2g = _straddling(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                            gpus_per_tray=2, tokens=10, moe_layers=2, cost_mode=mode)
    opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1, group_preserving=False)
    plan = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, validation_fraction=0.0, deterministic_time=20.0)
    pl = Placement(r2g, plan.phy2log)
    assert check(inst, pl) == []
    assert plan.objective_bytes == pytest.approx(evaluate(inst, pl).cross_domain_bytes_per_step)
    for li, d in enumerate(plan.details["layers"]):
        problem = build_layer_problem(inst, r2g, li, group_preserving=False, validation_fraction=0)
        if problem.trivial:
            assert d["objective_crossings"] == 0
            continue
        cap = problem.load_cap(d["load_tolerance"])
        space = [m for m in _all_class_maps(problem.class_capacity) if (problem.class_loads(m) <= cap).all()]
        space.append(problem.default_expert2class)  # the default map is always a candidate
        best = min(net_crossings(problem.nets_all, m, problem.class_sig, mode) for m in space)
        assert d["objective_crossings"] == best, d
        assert d["status"] == "optimal" and d["bound_crossings"] == best
    assert plan.bound_bytes == pytest.approx(plan.objective_bytes)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_group_preserving_mode_returns_the_brute_force_optimum_and_keeps_groups(seed):
    rng = np.random.default_rng(seed)
    inst, r2g = _straddling(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                            gpus_per_tray=2, tokens=10, moe_layers=2, num_groups=2, groups_per_token=1)
    opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1, apply="checkpoint")
    assert opts.group_preserving_for(inst)
    plan = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, validation_fraction=0.0, deterministic_time=20.0)
    pl = Placement(r2g, plan.phy2log)
    assert check(inst, pl) == [] and violates_group_preservation(inst, pl) == []
    for li, d in enumerate(plan.details["layers"]):
        problem = build_layer_problem(inst, r2g, li, group_preserving=True, validation_fraction=0)
        if problem.trivial:
            continue
        cap = problem.load_cap(d["load_tolerance"])
        space = [m for m in _all_class_maps(problem.class_capacity)
                 if _group_preserving(problem, m) and (problem.class_loads(m) <= cap).all()]
        space.append(problem.default_expert2class)
        best = min(net_crossings(problem.nets_all, m, problem.class_sig, "per_domain") for m in space)
        assert d["objective_crossings"] == best and d["bound_crossings"] == best, d


@pytest.mark.parametrize("seed", [7, 8])
def test_group_search_bound_is_valid_and_its_map_preserves_groups(seed):
    rng = np.random.default_rng(seed)
    inst, r2g = _straddling(rng, num_experts=12, top_k=3, ep=6, dp=6, pp=1, num_domains=3, trays_per_domain=2,
                            gpus_per_tray=2, tokens=12, moe_layers=1, num_groups=3, groups_per_token=2)
    problem = build_layer_problem(inst, r2g, 0, group_preserving=True, validation_fraction=0)
    if problem.trivial:
        pytest.skip("layout put the stage in one domain")
    cap = problem.load_cap(10.0)  # no load cap: compare with every group-preserving map
    start = problem.default_expert2class
    res = group_search(problem, problem.nets_all, cap, start, deterministic_time=0.0, seed=0,
                       stop=StopCheck(time.monotonic() + 60))
    assert res is not None
    space = list(_all_group_preserving_maps(problem))
    assert space and all(_group_preserving(problem, m) for m in space)
    best = min(net_crossings(problem.nets_all, m, problem.class_sig, "per_domain") for m in space)
    assert res.bound <= best <= res.crossings
    assert _group_preserving(problem, res.best)
    assert res.crossings == net_crossings(problem.nets_all, res.best, problem.class_sig, "per_domain")


# ---------------------------------------------------------------------------------------------
# The validation guard, the committed tiny instance, determinism
# ---------------------------------------------------------------------------------------------
def test_never_worse_than_the_default_on_the_validation_part(tiny):
    inst = tiny.for_solver()
    r2g = np.random.default_rng(0).permutation(np.flatnonzero(inst.cluster.available))[: inst.parallel.world_size]
    for gp in (True, False):
        opts = SolveOptions(time_limit_s=10, seed=1, num_workers=1, group_preserving=gp)
        plan = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60)
        for d in plan.details["layers"]:
            if d["status"] != "trivial":
                assert d["validation_crossings"] <= d["default_validation_crossings"], d
        pl = Placement(r2g, plan.phy2log)
        assert check(inst, pl) == []
        assert (violates_group_preservation(inst, pl) == []) or not gp


def test_same_seed_same_maps_in_process_and_in_a_pool(tiny):
    inst = tiny.for_solver()
    r2g = default_rank2gpu(inst)
    # apply checkpoint: the group-preserving search, whose tiny layers never reach CP-SAT's wall-clock cut (free
    # layers run CP-SAT with a wall limit that a loaded machine can hit, which the details then record).
    plans = [place_experts(inst, r2g, SolveOptions(time_limit_s=8, seed=3, num_workers=w, apply="checkpoint"),
                           deadline=time.monotonic() + 60,
                           deterministic_time=0.5, use_pool=w > 1)
             for w in (1, 1, 2)]
    assert np.array_equal(plans[0].phy2log, plans[1].phy2log)
    assert np.array_equal(plans[0].phy2log, plans[2].phy2log)  # the pool gives what one process gives
    assert plans[0].details == plans[1].details == plans[2].details


def test_the_pool_workers_payload_file_is_removed_and_an_unwritable_one_solves_in_process(tiny, tmp_path,
                                                                                          monkeypatch, caplog):
    """The pool's workers read the instance from a temporary file (so that a worker dying while it
    starts cannot block the parent in a pipe write): the file is gone when the solve returns, and
    when it cannot be written the layers are solved in this process, with the same maps."""
    import tempfile

    import solvers.experts.pool as pool_module

    inst = tiny.for_solver()
    r2g = default_rank2gpu(inst)
    opts = SolveOptions(time_limit_s=8, seed=3, num_workers=2, apply="checkpoint")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written: list[str] = []
    real_write = pool_module._write_worker_payload

    def recording_write(worker):
        written.append(real_write(worker))
        return written[-1]

    monkeypatch.setattr(pool_module, "_write_worker_payload", recording_write)
    pooled = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, deterministic_time=0.5, use_pool=True)
    assert len(written) == 1 and written[0].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []

    def full_disk(worker):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pool_module, "_write_worker_payload", full_disk)
    with caplog.at_level("WARNING", logger="solvers.experts.pool"):
        fallback = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, deterministic_time=0.5,
                                 use_pool=True)
    assert "cannot write the pool workers' payload" in caplog.text and "No space left" in caplog.text
    assert np.array_equal(pooled.phy2log, fallback.phy2log)


@pytest.mark.exclusive  # a wall-clock bound (tests/machine_share.py)
def test_a_stop_request_returns_default_maps_at_once(tiny):
    import threading

    inst = tiny.for_solver()
    stop = threading.Event()
    stop.set()
    opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1, stop_event=stop)
    t0 = time.monotonic()
    plan = place_experts(inst, default_rank2gpu(inst), opts, deadline=time.monotonic() + 30)
    assert time.monotonic() - t0 < 5
    assert check(inst, Placement(default_rank2gpu(inst), plan.phy2log)) == []
    assert all(d["status"] in ("trivial", "heuristic") for d in plan.details["layers"])


def test_an_expert_map_hint_is_used_as_a_start(tiny, monkeypatch):
    """Every straddling layer's local search starts from the hint's class map too (a spy on the
    search records its starts), and a hint of the wrong shape is refused naming the parameter."""
    import solvers.experts.layer as layer_module

    inst = tiny.for_solver()
    r2g = default_rank2gpu(inst)
    opts = SolveOptions(time_limit_s=8, seed=0, num_workers=1, group_preserving=False)
    E = inst.model.num_experts
    hint = np.stack([np.random.default_rng(li).permutation(E) for li in range(inst.model.num_moe_layers)])
    starts: list[tuple[int, np.ndarray]] = []

    class Spy(layer_module.SwapSearch):
        def run(self, e2c, cap, **kw):
            starts.append((self.p.layer, np.array(e2c)))
            return super().run(e2c, cap, **kw)

    monkeypatch.setattr(layer_module, "SwapSearch", Spy)
    place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, hint_phy2log=hint, class_tolerance=10.0,
                  use_pool=False)
    checked = 0
    for li in range(inst.model.num_moe_layers):
        problem = build_layer_problem(inst, r2g, li, group_preserving=False)
        if problem.trivial:
            continue
        want = np.empty(E, dtype=np.int64)
        want[hint[li]] = problem.slot2class  # the class of the slot each expert sits on
        assert any(layer == li and np.array_equal(m, want) for layer, m in starts), li
        checked += 1
    assert checked > 0
    with pytest.raises(InvalidInputError, match="hint_phy2log"):
        place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, hint_phy2log=hint[:1])


# ---------------------------------------------------------------------------------------------
# Pieces: greedy, balancing, bounds, budgets
# ---------------------------------------------------------------------------------------------
def test_greedy_expert_domains_respects_capacities_and_ranks():
    rng = np.random.default_rng(11)
    inst, r2g = _straddling(rng, num_experts=16, top_k=4, ep=8, dp=8, pp=1, num_domains=3, trays_per_domain=2,
                            gpus_per_tray=2, tokens=20, moe_layers=1)
    problem = build_layer_problem(inst, r2g, 0, group_preserving=False)
    for tol in (None, 0.2):
        for ls in (False, True):
            g = greedy_expert_domains(problem, load_tolerance=tol, local_search=ls)
            assert np.array_equal(np.bincount(g.expert2class, minlength=problem.num_classes), problem.class_capacity)
            assert np.array_equal(problem.rank2class[g.expert2eprank], g.expert2class)
            assert np.array_equal(np.bincount(g.expert2eprank, minlength=problem.ep),
                                  np.full(problem.ep, problem.experts_per_rank))
            assert g.crossings == net_crossings(problem.nets_all, g.expert2class, problem.class_sig, "per_domain")
    plain = greedy_expert_domains(problem)
    polished = greedy_expert_domains(problem, local_search=True)
    assert polished.crossings <= plain.crossings


def test_balancing_meets_the_gpu_tolerance_when_loads_allow_and_keeps_classes():
    rng = np.random.default_rng(12)
    inst, r2g = _straddling(rng, num_experts=64, top_k=4, ep=4, dp=4, pp=1, num_domains=2, trays_per_domain=1,
                            gpus_per_tray=4, tokens=400, moe_layers=1)
    problem = build_layer_problem(inst, r2g, 0, group_preserving=False)
    e2c = problem.default_expert2class
    slots = balance_ranks(problem, e2c)
    assert np.array_equal(np.sort(slots), np.arange(problem.num_experts))
    assert np.array_equal(problem.slot2class[slots], e2c)  # balancing never changes a class
    ratio = rank_load_ratio(problem, slots)
    assert ratio <= 1.10
    assert ratio <= rank_load_ratio(problem, np.arange(problem.num_experts))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), pp=st.sampled_from([1, 2]), domains=st.sampled_from([2, 3]))
def test_rebalancing_within_domains_keeps_the_cross_domain_bytes_and_never_raises_the_load(seed, pp, domains):
    from solvers.experts.balance import rebalanced_within_domains

    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=4, pp=pp, num_domains=domains,
                           trays_per_domain=2, gpus_per_tray=2, tokens=40, moe_layers=2)
    start = random_placement(rng, inst)
    out = Placement(start.rank2gpu, rebalanced_within_domains(inst, start.rank2gpu, start.phy2log))
    E = inst.model.num_experts
    assert all(np.array_equal(np.sort(row), np.arange(E)) for row in out.phy2log)
    assert check(inst, out) == []
    before, after = evaluate(inst, start), evaluate(inst, out)
    assert np.allclose(after.cross_domain_bytes_per_layer, before.cross_domain_bytes_per_layer, rtol=1e-12)
    assert np.all(np.asarray(after.expert_load_max_over_mean_per_layer)
                  <= np.asarray(before.expert_load_max_over_mean_per_layer) + 1e-9)


def test_transport_optimum_is_the_brute_force_optimum_and_the_lp_bounds_it():
    rng = np.random.default_rng(13)
    inst, r2g = _straddling(rng, num_experts=8, top_k=3, ep=4, dp=4, pp=1, num_domains=3, trays_per_domain=2,
                            gpus_per_tray=2, tokens=9, moe_layers=1, cost_mode="per_pair")
    problem = build_layer_problem(inst, r2g, 0, group_preserving=False, validation_fraction=0)
    if problem.trivial:
        pytest.skip("layout put the stage in one domain")
    nets = problem.nets_all
    maps = list(_all_class_maps(problem.class_capacity))
    costs = [net_crossings(nets, m, problem.class_sig, "per_pair") for m in maps]
    opt, e2c = transport_optimum(linear_costs(problem, nets), problem.class_capacity)
    assert opt == net_crossings(nets, e2c, problem.class_sig, "per_pair")
    assert opt == min(costs) == net_crossings(nets, e2c, problem.class_sig, "per_pair")
    exact = per_pair_class_bound(problem, nets, None)
    assert exact.integral and exact.bound == min(costs)
    cap = problem.load_cap(0.1)
    within = [c for m, c in zip(maps, costs) if (problem.class_loads(m) <= cap).all()]
    lp = per_pair_class_bound(problem, nets, cap)
    if within:
        assert lp.bound is not None and lp.bound <= min(within) + 1e-6
    assert sum_bounds([1.0, 2.0]) == 3.0 and sum_bounds([1.0, None]) is None


def test_deterministic_budget_depends_only_on_its_arguments():
    a = deterministic_budget(100.0, 2, [1.0, 3.0, 0.0], [10.0, 10.0, 0.0])
    b = deterministic_budget(100.0, 2, [1.0, 3.0, 0.0], [10.0, 10.0, 0.0])
    assert a == b and a[2] == 0.0 and a[1] == pytest.approx(3 * a[0])
    assert deterministic_budget(1.0, 2, [1.0], [1e9]) == [0.0]  # no time left: no CP-SAT


def test_unsolved_layer_keeps_the_layouts_map(tiny):
    """A layer cut by the deadline keeps the map its rank layout was scored with, when valid."""
    inst = tiny.for_solver()
    worker = LayerWorker(inst, default_rank2gpu(inst), True, 0.25)
    E = tiny.model.num_experts
    hint = np.concatenate([np.arange(4, 8), np.arange(4)[::-1], np.arange(8, E)])  # groups swapped
    kept = worker.fallback(0, "deadline reached", hint)
    assert kept.details["chosen"] == "layout_hint"
    assert (hint[kept.expert2slot] == np.arange(E)).all()  # expert2slot inverts phy2log
    broken = hint.copy()
    broken[[0, 4]] = broken[[4, 0]]  # mixes two groups in one group position: not allowed
    assert worker.fallback(0, "deadline reached", broken).details["chosen"] == "default"
    assert worker.fallback(0, "deadline reached", None).details["chosen"] == "default"


def _pool_initializer_raises(*args):
    """A pool initializer that fails the way a worker that cannot import its modules does."""
    raise ImportError("test: this worker cannot import its modules")


def _pool_initializer_exits(*args):
    """A pool initializer whose process dies at once, with no exception to report."""
    import os

    os._exit(3)


@pytest.mark.parametrize("initializer", [_pool_initializer_raises, _pool_initializer_exits])
def test_a_pool_whose_workers_cannot_start_ends_by_the_deadline(initializer, caplog):
    from placement.formats import read_instance
    from tests.conftest import INSTANCES

    inst = read_instance(INSTANCES / "dsv3_256.json").for_solver()
    r2g = default_rank2gpu(inst)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="solvers.experts.pool"):
        # a work budget far beyond the deadline: only the deadline can end the in-process fallback
        plan = place_experts(inst, r2g, SolveOptions(time_limit_s=8, seed=1, num_workers=2), deadline=t0 + 8,
                             deterministic_time=1000.0, use_pool=True, pool_initializer=initializer)
    elapsed = time.monotonic() - t0
    assert "process pool broke" in caplog.text
    assert elapsed < 8 + 30, f"returned {elapsed - 8:.0f} s after the deadline"
    assert check(inst, Placement(r2g, plan.phy2log)) == []


@pytest.mark.parametrize("error", [OSError("handle is closed"), ValueError("bad value(s) in fds_to_keep")],
                         ids=["handle_closed", "fd_reused"])
def test_an_os_error_while_the_pool_starts_a_worker_is_a_broken_pool(error, monkeypatch, caplog):
    """``submit`` failing with ``OSError: handle is closed`` or ``ValueError: bad value(s) in
    fds_to_keep`` (the executor closed its queues after a worker died, before it marked itself
    broken; in the second a new pipe reused a closed descriptor's number) takes the broken-pool
    path: the remaining layers are solved in-process and the placement is valid, instead of the
    error reaching the caller."""
    import solvers.experts.pool as pool_module
    from placement.formats import read_instance
    from tests.conftest import INSTANCES

    class ClosingPool(pool_module.ProcessPoolExecutor):
        calls = 0

        def submit(self, *args, **kwargs):
            ClosingPool.calls += 1
            if ClosingPool.calls == 2:
                raise error
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(pool_module, "ProcessPoolExecutor", ClosingPool)
    inst = read_instance(INSTANCES / "dsv3_256.json").for_solver()
    r2g = default_rank2gpu(inst)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="solvers.experts.pool"):
        plan = place_experts(inst, r2g, SolveOptions(time_limit_s=20, seed=1, num_workers=2), deadline=t0 + 20,
                             deterministic_time=2.0, use_pool=True)
    assert ClosingPool.calls >= 2
    assert "process pool broke" in caplog.text and str(error) in caplog.text
    assert check(inst, Placement(r2g, plan.phy2log)) == []


def test_only_the_reused_descriptor_value_error_of_submit_is_a_broken_pool():
    """The broken-pool reading of ``submit``'s ``ValueError`` is kept to the one message CPython
    gives for a descriptor passed twice; any other ``ValueError`` is a bug and reaches the caller."""
    import solvers.experts.pool as pool_module

    class FailingPool:
        def __init__(self, error):
            self.error = error

        def submit(self, *args, **kwargs):
            raise self.error

    with pytest.raises(pool_module.BrokenProcessPool, match="fds_to_keep"):
        pool_module._submit(FailingPool(ValueError("bad value(s) in fds_to_keep")), None)
    with pytest.raises(ValueError, match="something else"):
        pool_module._submit(FailingPool(ValueError("something else")), None)


def test_a_stop_request_reaches_the_pool_workers_and_their_layers_answer(caplog):
    """A stop request while pool workers are inside their layers: the request is relayed to them and
    the layers in flight return their best maps so far (no fallback), the rest keep their fallback
    map, and the call returns promptly.  Before the relay the workers were killed at once and every
    unsolved layer, those in flight included, fell back."""
    import threading

    from placement.formats import read_instance
    from tests.conftest import INSTANCES

    inst = read_instance(INSTANCES / "dsv3_ep256.json").for_solver()  # layers long enough to be in flight
    r2g = default_rank2gpu(inst)
    stop = threading.Event()
    timer = threading.Timer(10.0, stop.set)  # the spawned workers are inside their first layers by then
    t0 = time.monotonic()
    timer.start()
    try:
        # a work budget far beyond the deadline: only the stop can end the layers in flight
        plan = place_experts(inst, r2g, SolveOptions(time_limit_s=120, seed=1, num_workers=2, stop_event=stop),
                             deadline=t0 + 120, deterministic_time=5000.0, use_pool=True)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0 + 30.0, f"returned {elapsed - 10:.0f} s after the stop"
    layers = [d for d in plan.details["layers"] if d.get("status") != "trivial"]
    answered = [d for d in layers if "fallback_reason" not in d]
    assert answered, "no layer in flight returned its incumbent"
    assert all(d["stopped_early"] for d in answered)
    assert any("fallback_reason" in d for d in layers)  # the stop did end the solve early
    assert check(inst, Placement(r2g, plan.phy2log)) == []
