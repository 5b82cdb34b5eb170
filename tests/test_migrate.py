"""placement.consumers.migrate's pure parts and placement.plan.controller's decision, in one process.

The multi-process migrations on the stacks' own code are tests/stacks/test_migrate_stacks.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.plan.controller import ReplacementController
from placement.consumers.migrate import MAP_KIND, MigrationError, load_map, map_state, maps_from_state, plan_moves, save_map
from placement.core.model import InvalidInputError


def _apply(old: list[int], moves: list[tuple[int, int]]) -> list[int]:
    """Slot contents after every (src, dst) copy reads the *old* slots (scratch first, then commit)."""
    new = list(old)
    for src, dst in moves:
        new[dst] = old[src]
    return new


@pytest.mark.parametrize("seed", range(20))
def test_plan_turns_the_old_map_into_the_new_one_and_moves_only_what_changes(seed):
    rng = np.random.default_rng(seed)
    n, ep = 8, [1, 2, 4, 8][seed % 4]
    old, new = rng.permutation(n).tolist(), rng.permutation(n).tolist()
    moves = plan_moves(old, new, ep)
    assert _apply(old, moves) == new
    assert [d for _, d in moves] == sorted(d for _, d in moves)  # one order on every rank
    assert {d for _, d in moves} == {p for p in range(n) if old[p] != new[p]}
    per_rank = n // ep
    cross = sum(s // per_rank != d // per_rank for s, d in moves)
    # brute force: logical experts whose EP rank changes
    rank_old = {e: p // per_rank for p, e in enumerate(old)}
    rank_new = {e: p // per_rank for p, e in enumerate(new)}
    assert cross == sum(rank_old[e] != rank_new[e] for e in range(n))


def test_plan_refuses_maps_that_lose_an_expert():
    with pytest.raises(InvalidInputError, match="every expert"):
        plan_moves([0, 1, 2, 2], [0, 1, 2, 3], 2)
    with pytest.raises(InvalidInputError, match="every expert"):  # a re-plan dropping expert 3's last slot
        plan_moves([0, 1, 2, 3, 3, 0], [0, 1, 2, 0, 1, 2], 2)
    with pytest.raises(InvalidInputError, match="every expert"):
        plan_moves([0, 1, 2, 3], [0, 1, 2, 3, 0, 1], 2)
    with pytest.raises(InvalidInputError, match="do not split"):
        plan_moves([0, 1, 2], [2, 1, 0], 2)


def test_plan_of_replicas_counted_by_hand():
    # 4 experts, 6 slots on 2 ranks (3 a rank): expert 0 replicated on rank 1, then expert 2 instead,
    # and expert 1's rank-0 slot swapped with expert 3's
    old = [0, 1, 2, 3, 0, 1]
    new = [0, 3, 2, 1, 2, 1]
    # slot 1 takes 3 from slot 3 (rank 1, the only holder); slot 3 takes 1 from slot 5 (its own rank,
    # not slot 1 on rank 0); slot 4 takes 2 from slot 2 (the only holder)
    assert plan_moves(old, new, 2) == [(3, 1), (5, 3), (2, 4)]
    assert plan_moves(old, old, 2) == []


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_plan_of_replica_maps_reaches_the_new_map_copying_each_expert_from_a_holder(data):
    ep = data.draw(st.sampled_from([1, 2, 4]))
    e = data.draw(st.integers(2, 8))
    n = ep * data.draw(st.integers(-(-e // ep), -(-e // ep) + 2))

    def a_map() -> list[int]:
        extra = data.draw(st.lists(st.integers(0, e - 1), min_size=n - e, max_size=n - e))
        return data.draw(st.permutations(list(range(e)) + extra))

    old, new = a_map(), a_map()
    moves = plan_moves(old, new, ep)
    assert _apply(old, moves) == new
    assert [d for _, d in moves] == sorted({d for _, d in moves})
    assert {d for _, d in moves} == {p for p in range(n) if old[p] != new[p]}
    per_rank = n // ep
    for s, d in moves:  # a local holder is preferred when the rank has one
        holders_here = [p for p in range(n) if old[p] == new[d] and p // per_rank == d // per_rank]
        assert (s // per_rank == d // per_rank) == bool(holders_here)


def test_the_map_entry_round_trips_and_rejects_bad_files(tmp_path):
    maps = {3: [1, 0, 3, 2], 1: np.array([0, 1, 2, 3])}
    state = map_state(maps)
    assert state["kind"] == MAP_KIND and list(state["layers"]) == ["1", "3"]
    assert {k: v.tolist() for k, v in maps_from_state(json.loads(json.dumps(state))).items()} == {
        1: [0, 1, 2, 3], 3: [1, 0, 3, 2]}
    save_map(tmp_path / "map.json", maps)
    assert load_map(tmp_path / "map.json")[3].tolist() == [1, 0, 3, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["map.json"]  # no temp file left
    bad = dict(state, layers={"1": [0, 0, 1, 2]})
    with pytest.raises(InvalidInputError, match=r"expert_map: layers.1: expected a permutation"):
        maps_from_state(bad)
    (tmp_path / "v2.json").write_text(json.dumps(dict(state, version=2)))
    with pytest.raises(InvalidInputError, match=r"v2.json: version: expected 1"):
        load_map(tmp_path / "v2.json")


def test_a_replica_map_entry_round_trips_with_its_expert_count(tmp_path):
    maps = {0: [0, 1, 5, 2, 3, 0, 4, 5, 1, 6, 7, 4], 1: list(range(8)) + [0, 1, 2, 3]}
    state = map_state(maps)
    assert state["num_experts"] == 8 and "num_experts" not in map_state({0: [1, 0]})
    save_map(tmp_path / "rep.json", maps)
    assert {k: v.tolist() for k, v in load_map(tmp_path / "rep.json").items()} == maps
    with pytest.raises(InvalidInputError, match=r"layers.0: expected every expert 0..7"):  # expert 7 lost
        maps_from_state(dict(state, layers={"0": [0, 1, 5, 2, 3, 0, 4, 5, 1, 6, 6, 4]}))
    with pytest.raises(InvalidInputError, match=r"layers.0: expected every expert 0..7"):  # an id >= E
        maps_from_state(dict(state, layers={"0": list(range(8)) + [8, 0, 0, 0]}))
    with pytest.raises(InvalidInputError, match=r"expert_map: num_experts: expected a positive integer"):
        maps_from_state(dict(state, num_experts="8"))
    with pytest.raises(InvalidInputError, match=r"layers.0: expected a list of expert ids"):
        maps_from_state(dict(state, layers={"0": [0.5, 1]}))


def test_unsupported_optimizers_are_refused_in_one_line():
    torch = pytest.importorskip("torch")
    from placement.consumers.migrate import _optimizer_states

    class DistributedOptimizer:  # the name Megatron-Core's sharded optimizer has
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])

    with pytest.raises(MigrationError, match="DistributedOptimizer is not supported") as e:
        _optimizer_states(DistributedOptimizer())
    assert "\n" not in str(e.value)
    with pytest.raises(MigrationError, match="object is not supported"):
        _optimizer_states(object())
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class Chained:
        chained_optimizers = [type("Wrapper", (), {"optimizer": sgd})()]

    assert _optimizer_states(Chained()) == [sgd]


def test_precision_aware_distributed_optimizers_are_refused_in_one_line():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from placement.consumers.migrate import _optimizer_states

    class DistributedOptimizer:  # Megatron-Core's, with its shard maps
        model_param_gbuf_map: dict = {}
        ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=True)
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])

    with pytest.raises(MigrationError, match="precision-aware") as e:
        _optimizer_states(DistributedOptimizer())
    assert "\n" not in str(e.value)
    DistributedOptimizer.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    assert _optimizer_states(DistributedOptimizer()) == []  # its state is read shard by shard


@pytest.mark.parametrize("dp,bucket_sizes", [(2, [1024]), (2, [384, 640]), (4, [512, 512]), (3, [768])])
def test_dp_layout_matches_the_owner_of_every_element(dp, bucket_sizes):
    """_dp_layout against a per-element reference: element e of the buffer is owned by DP rank
    (e - bucket.offset) // (bucket numel / dp) of its bucket."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from placement.consumers.migrate import _dp_layout

    offsets = np.cumsum([0] + bucket_sizes)
    buckets = [SimpleNamespace(offset=int(o), grad_data=torch.zeros(n)) for o, n in zip(offsets, bucket_sizes)]
    rng = np.random.default_rng(dp)
    params, index, pos = [], {}, 0
    for b, n in enumerate(bucket_sizes):  # parameters packed into each bucket, sizes at random
        end = int(offsets[b]) + n
        while pos < end:
            size = min(int(rng.integers(1, 300)), end - pos)
            p = torch.nn.Parameter(torch.zeros(size))
            params.append(p)
            index[p] = (pos, pos + size, b)
            pos += size
    buffer = SimpleNamespace(param_index_map=index, buckets=buckets,
                             data_parallel_group=SimpleNamespace(size=lambda: dp))
    for p in params:
        start, end, b = index[p]
        chunk = bucket_sizes[b] // dp
        owners = [(e - int(offsets[b])) // chunk for e in range(start, end)]
        want = [(r, owners.index(r), len(owners) - owners[::-1].index(r)) for r in sorted(set(owners))]
        assert _dp_layout(buffer, p) == want


def _controller(payback: float) -> ReplacementController:
    c = ReplacementController.__new__(ReplacementController)
    c.layers, c.payback_within_steps = [0, 1], payback
    return c


def test_the_controller_applies_only_what_pays_back_in_time():
    doc = {"moe_layers": [0, 1], "moves": {"moved_replicas": 4, "payback_steps": 30.0, "payback_steps_bytes": 5.0}}
    assert _controller(50)._decide(doc)[0] == 1
    code, why = _controller(10)._decide(doc)
    assert code == 2 and "payback 30 steps > 10" in why  # the step-time payback wins over the byte one
    bytes_only = {"moe_layers": [0, 1], "moves": {"moved_replicas": 4, "payback_steps": None, "payback_steps_bytes": 5.0}}
    assert _controller(10)._decide(bytes_only)[0] == 1
    assert _controller(10)._decide({"moe_layers": [0, 1], "moves": {"moved_replicas": 0}})[1] == "the answer moves nothing"
    no_gain = {"moe_layers": [0, 1], "moves": {"moved_replicas": 2, "payback_steps": None, "payback_steps_bytes": None}}
    assert _controller(1e9)._decide(no_gain) == (2, "no predicted gain")
    assert "MoE layers" in _controller(1e9)._decide(dict(doc, moe_layers=[0]))[1]
