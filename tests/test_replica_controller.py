"""placement.plan.controller.ReplicaController in one process: replicas follow the recent routing.

The routing hooks' counters (``InstalledReplicas._seen``) are filled by hand, as Megatron-Core's
``MoELayer.route`` wrapper fills them in a job, and ``replan`` is replaced by the live map's
``update`` (the state transfer, :func:`placement.consumers.migrate.migrate`, runs in the multi-process job
of tests/stacks/test_replicas_stacks.py, where this controller re-plans EP2 x expert-DP2 live).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from placement.plan.controller import ReplicaController  # noqa: E402
from placement.consumers.migrate import MigrationReport  # noqa: E402
from placement.core.model import InvalidInputError  # noqa: E402
from placement.consumers.replica_runtime import InstalledReplicas, _slot_table, replica_plan  # noqa: E402

E, EP = 8, 4
# 3 slots per EP rank: 2 experts of the permutation, then one redundant slot
START = [0, 1, 0, 2, 3, 0, 4, 5, 0, 6, 7, 0]
BASE = np.array([10, 11, 12, 13, 14, 9, 15, 16])  # tokens per step; expert 5 the coldest


class _Replicas(InstalledReplicas):
    """A real InstalledReplicas over two layers without a model: ``replan`` only switches the maps."""

    def __init__(self) -> None:
        super().__init__("Megatron", E)
        self.replans: list[dict[int, list[int]]] = []
        for layer in (0, 1):
            p2l = np.array(START)
            self._layers[layer] = (p2l, 0, [[] for _ in range(len(START) // EP)])
            self._route[layer] = _slot_table(torch, p2l, E, torch.device("cpu"))
            self._seen[layer] = torch.zeros(E, dtype=torch.long)

    def replan(self, layers, optimizer, group=None, state_group=None):  # type: ignore[override]
        self.replans.append({k: np.asarray(v).tolist() for k, v in layers.items()})
        self.update(layers)
        return MigrationReport({int(k): 0 for k in layers})

    def route(self, hot: int, extra: int) -> None:
        """One step's tokens on this rank: BASE, plus ``extra`` to expert ``hot`` (layer 0) and to
        expert ``7 - hot`` (layer 1)."""
        for layer, e in ((0, hot), (1, 7 - hot)):
            counts = torch.tensor(BASE)
            counts[e] += extra
            self._seen[layer].add_(counts)


def _redundant(installed: InstalledReplicas, layer: int) -> set[int]:
    return {int(x) for x in installed.phy2log(layer).reshape(EP, -1)[:, -1]}


def _run(window_steps: int, rule: str = "hottest") -> tuple[_Replicas, list]:
    """Eight steps, a re-plan every four: expert 5 hot in steps 0-3 (100 more tokens a step),
    expert 2 in steps 4-7 (60 more), so over the whole history 5 is still the hotter (440 vs 280)."""
    installed = _Replicas()
    ctl = ReplicaController(installed, None, rule=rule, every_steps=4, window_steps=window_steps)
    entries = []
    for step in range(8):
        installed.route(5 if step < 4 else 2, 100 if step < 4 else 60)
        entries.append(ctl.after_step(step))
    return installed, entries


@pytest.mark.parametrize("rule", ["hottest", "eplb"])
def test_a_routing_shift_moves_the_replicas_to_the_new_hot_expert_at_the_next_boundary(rule):
    installed, entries = _run(window_steps=2, rule=rule)
    assert [e is not None for e in entries] == [False, False, False, True] * 2
    first, second = entries[3], entries[7]
    # the window holds steps 2-3, then steps 6-7, counted by hand
    want0 = 2 * BASE
    want0[5] += 200
    assert first["loads"][0] == want0.tolist() and first["window_steps"] == 2
    want1 = 2 * BASE
    want1[2] += 120
    assert second["loads"][0] == want1.tolist()
    assert first["decision"] == second["decision"] == "applied" and len(installed.replans) == 2
    # after the first boundary 5 (layer 0) and 2 (layer 1) hold the redundant slots they need; after
    # the second 2 and 5, and the stale hot expert is back to its one slot
    assert installed.replans[0][0].count(5) >= 2 and installed.replans[0][1].count(2) >= 2
    assert installed.replans[1][0].count(2) >= 2 and installed.replans[1][0].count(5) == 1
    assert installed.replans[1][1].count(5) >= 2 and installed.replans[1][1].count(2) == 1
    assert installed.phy2log(0).tolist() == installed.replans[1][0]
    for layer in (0, 1):
        p2l = installed.phy2log(layer)
        # the permutation slots kept, every expert still present, the hooks' tables follow
        assert p2l.reshape(EP, -1)[:, :2].tolist() == np.array(START).reshape(EP, -1)[:, :2].tolist()
        assert set(p2l.tolist()) == set(range(E))
        cnt, _table = installed._route[layer]
        assert cnt.tolist() == np.bincount(p2l, minlength=E).tolist()
    assert 2 in _redundant(installed, 0) and 5 not in _redundant(installed, 0)


@pytest.mark.parametrize("rule", ["hottest", "eplb"])
def test_the_whole_history_would_keep_the_stale_hot_expert(rule):
    # the same job with a window reaching back to step 0: a replica stays on 5, the criticism of
    # EPLB's long history the window answers (this is what makes the test above able to fail)
    installed, entries = _run(window_steps=8, rule=rule)
    assert entries[7]["loads"][0][5] == 8 * BASE[5] + 400
    assert 5 in _redundant(installed, 0) and installed.phy2log(0).tolist().count(5) >= 2


def test_an_unchanged_plan_moves_nothing():
    installed = _Replicas()
    ctl = ReplicaController(installed, None, every_steps=1, window_steps=1)
    installed.route(5, 100)
    ctl.after_step(0)
    installed.route(5, 100)
    entry = ctl.after_step(1)
    assert entry is not None and entry["decision"] == "unchanged" and len(installed.replans) == 1


def test_replica_plan_keeps_the_permutation_and_gives_the_hot_expert_slots():
    p2l = replica_plan(START, [1, 1, 1, 1, 1, 50, 1, 1], E, EP, "eplb")
    assert p2l.reshape(EP, -1)[:, :2].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p2l.tolist().count(5) == EP  # one slot on every EP rank (the cap), 50 / 4 > 1
    with pytest.raises(InvalidInputError, match="loads"):
        replica_plan(START, [1, 1, 1], E, EP)


@pytest.mark.parametrize("kwargs", [{"rule": "round"}, {"every_steps": 0}, {"window_steps": 0}])
def test_bad_settings_are_refused_naming_the_field(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InvalidInputError, match=name):
        ReplicaController(_Replicas(), None, **kwargs)


def test_the_route_hook_counts_logical_tokens_and_splits_them_by_arrival():
    from placement.consumers.replica_runtime import _wrap_route

    class _Layer:
        def route(self, _x):
            # 3 tokens, 4 logical experts: token 0 -> {0, 1}, token 1 -> {0, 2}, token 2 -> {0, 1}
            rmap = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
            return rmap.float() * 0.5, rmap

    p2l = np.array([0, 1, 2, 3, 0])  # expert 0 in slots 0 and 4
    cnt, table_t = _slot_table(torch, p2l, 4, torch.device("cpu"))
    seen = torch.zeros(4, dtype=torch.long)
    layer = _Layer()
    _wrap_route(layer, cnt, table_t, 5, seen)
    probs, rmap = layer.route(None)
    assert seen.tolist() == [3, 2, 1, 0]
    # expert 0's tokens in index order go to slots 0, 4, 0
    assert rmap.int().tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 0, 1], [1, 1, 0, 0, 0]]
    installed = InstalledReplicas("Megatron", 4)
    installed._layers[0] = (p2l, 0, [[]] * 5)
    installed._seen[0] = seen
    assert installed.take_counts()[0].tolist() == [3, 2, 1, 0] and seen.tolist() == [0, 0, 0, 0]
