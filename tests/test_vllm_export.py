"""`export --format vllm` consumed by vLLM's own EPLB code (vLLM 0.34.0, run on CPU).

vLLM has no file loader for expert maps: a mapping enters its EPLB state through
``EplbState.update_mapping`` (what ``EplbState.from_mapping`` calls) or ``_commit_eplb_maps`` (what
a rearrangement commits), both in ``vllm/distributed/eplb/eplb_state.py``; both derive
``logical_to_physical_map`` and ``logical_replica_count`` from ``physical_to_logical_map`` with
``compute_logical_maps``, and each MoE layer reads its rows through ``EplbLayerState.set_layer_state``.
These tests feed our exported ``physical_to_logical_map`` to those functions and check that vLLM's
maps equal the ones we export, every physical slot of every logical expert of every MoE layer.
The MoE router's replica pick (``eplb_map_to_physical_and_record``) is a Triton kernel on CUDA and
the identity elsewhere, so it does not run here.

.ci/run installs vllm with ``--no-deps`` (its full dependency set needs CUDA); the ``consumers``
extra has the few modules ``import vllm.distributed.eplb.eplb_state`` needs beyond torch.
"""
from __future__ import annotations

import copy
import importlib
import json
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from placement.consumers import export as ex
from placement.core.model import InvalidInputError, Placement
from tests.test_replicas import replica_pair

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def eplb_module():
    """vLLM's EPLB module, imported when these tests run rather than when pytest collects the suite:
    ``import vllm`` sets environment variables (vllm/env_override.py), restored after this file."""
    global eplb
    saved = dict(os.environ)
    try:
        eplb = importlib.import_module("vllm.distributed.eplb.eplb_state")
    except ImportError as exc:
        # .ci/run installs vllm and the consumers extra: there a failed import is a missing install
        # step (a clean-clone rehearsal once skipped these tests for want of cloudpickle), not a skip.
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM's EPLB module does not import under CI: {exc}")
        pytest.skip(f"vllm is not installed or incomplete ({exc}); .ci/run installs vllm==0.34.0 --no-deps")
    yield eplb
    os.environ.clear()
    os.environ.update(saved)


eplb: Any = None  # set by eplb_module


def _vllm_state(num_layers: int, num_logical: int, num_physical: int, monkeypatch):
    """vLLM's EplbState holding one model's maps as ``EplbState.add_model`` allocates them.

    ``add_model`` itself needs a process group, the model's weights and the EPLB communicator; the
    tensors it allocates are rebuilt here from vLLM's own initial arrangement
    (``build_initial_global_physical_to_logical_map``), with the same shapes and dtypes.
    """
    monkeypatch.setattr(eplb, "PIN_MEMORY", False)  # no accelerator: vLLM's CPU platform says False too
    monkeypatch.setattr(eplb, "hash_config_cached", lambda _config: "model")
    num_redundant = num_physical - num_logical
    initial = torch.tensor(eplb.EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant))
    p2l_buffer = initial.unsqueeze(0).expand(num_layers, -1).contiguous()
    l2p = torch.full((num_layers, num_logical, num_redundant + 1), -1, dtype=torch.long)
    model_state = eplb.EplbModelState(
        physical_to_logical_map=p2l_buffer[:, :num_physical],
        physical_to_logical_map_buffer=p2l_buffer,
        logical_to_physical_map=l2p,
        logical_replica_count=torch.zeros((num_layers, num_logical), dtype=torch.long),
        expert_load_pass=torch.zeros((num_layers, num_physical), dtype=torch.int32),
        expert_load_pass_buffer=torch.zeros((num_layers, num_physical), dtype=torch.int32),
        expert_load_window=torch.zeros((1, num_layers, num_physical), dtype=torch.int32),
        last_expert_load=torch.ones((num_layers, num_logical), dtype=torch.int64),
        model_name="placement-export",
        model=SimpleNamespace(num_logical_experts=num_logical, num_physical_experts=num_physical,
                              num_moe_layers=num_layers),
        expert_buffer=[],
        rebalanced=False,
        eplb_stats=None,
        device_index=None,
        communicator=None,  # no weights move here
    )
    state = eplb.EplbState(parallel_config=SimpleNamespace(), device=torch.device("cpu"))
    state.model_states["model"] = model_state
    return state, model_state


def check_with_vllm(doc: dict, monkeypatch) -> None:
    """Load ``doc`` (our vllm export) into vLLM's EPLB state by vLLM's code; assert every slot agrees.

    Raises AssertionError naming the first layer / expert whose slots vLLM derives differently.
    """
    p2l = np.asarray(doc["physical_to_logical_map"], dtype=np.int64)
    ours_l2p = np.asarray(doc["logical_to_physical_map"], dtype=np.int64)
    ours_count = np.asarray(doc["logical_replica_count"], dtype=np.int64)
    num_layers, num_physical = p2l.shape
    num_logical = ours_count.shape[1]
    assert doc["meta"]["num_redundant_experts"] == num_physical - num_logical
    assert ours_l2p.shape == (num_layers, num_logical, num_physical - num_logical + 1)

    # 1. the derivation every path uses
    l2p, count = eplb.compute_logical_maps(torch.tensor(p2l), num_logical)
    np.testing.assert_array_equal(count.numpy(), ours_count, err_msg="compute_logical_maps: replica counts")
    width = l2p.shape[-1]
    np.testing.assert_array_equal(l2p.numpy(), ours_l2p[..., :width], err_msg="compute_logical_maps: slots")
    assert (ours_l2p[..., width:] == -1).all(), "our padding beyond the most-replicated expert is not -1"

    # 2. EplbState.update_mapping (the body of EplbState.from_mapping), then each layer's view
    state, model_state = _vllm_state(num_layers, num_logical, num_physical, monkeypatch)
    state.update_mapping(SimpleNamespace(), torch.tensor(p2l))
    np.testing.assert_array_equal(model_state.physical_to_logical_map.numpy(), p2l)
    for li in range(num_layers):
        layer = eplb.EplbLayerState()
        layer.set_layer_state(li, model_state.expert_load_pass, model_state.logical_to_physical_map,
                              model_state.logical_replica_count)
        assert layer.logical_to_physical_map is not None and layer.logical_replica_count is not None
        for e in range(num_logical):
            got = layer.logical_to_physical_map[e].tolist()
            n = int(layer.logical_replica_count[e])
            assert got == ours_l2p[li, e].tolist() and n == ours_count[li, e], (
                f"layer {li} expert {e}: vLLM routes to {got[:n]} (count {n}), "
                f"we export {ours_l2p[li, e].tolist()} (count {ours_count[li, e]})")
            # every physical slot vLLM may pick for e holds e in our physical_to_logical_map
            assert all(p2l[li, slot] == e for slot in got[:n]) and all(s == -1 for s in got[n:])

    # 3. _commit_eplb_maps: what a rearrangement commits, from a fresh initial state
    _, committed = _vllm_state(num_layers, num_logical, num_physical, monkeypatch)
    eplb._commit_eplb_maps(committed, torch.tensor(p2l))
    np.testing.assert_array_equal(committed.physical_to_logical_map.numpy(), p2l)
    np.testing.assert_array_equal(committed.logical_to_physical_map.numpy(), ours_l2p, err_msg="_commit_eplb_maps")
    np.testing.assert_array_equal(committed.logical_replica_count.numpy(), ours_count)


@pytest.mark.parametrize("rule", ["hottest", "eplb"])
def test_vllm_builds_its_eplb_state_from_our_file(tmp_path, monkeypatch, rule):
    inst, ipath, ppath, rmap = replica_pair(tmp_path, n=4, rule=rule)
    out = tmp_path / "vllm.json"
    ex.export_file("vllm", ppath, out, ipath)
    doc = json.loads(out.read_text())
    assert (rmap.logcnt > 1).any()  # some expert really has a replica
    np.testing.assert_array_equal(np.asarray(doc["physical_to_logical_map"]), rmap.phy2log)
    check_with_vllm(doc, monkeypatch)


def _corruptions(doc: dict) -> list[tuple[str, dict]]:
    p2l = np.asarray(doc["physical_to_logical_map"])
    l2p = np.asarray(doc["logical_to_physical_map"])
    count = np.asarray(doc["logical_replica_count"])
    li, e = map(int, np.argwhere(count > 1)[0])  # an expert with a replica
    out = []
    swapped = copy.deepcopy(doc)  # its slots out of vLLM's ascending order
    swapped["logical_to_physical_map"][li][e][0], swapped["logical_to_physical_map"][li][e][1] = (
        int(l2p[li, e, 1]), int(l2p[li, e, 0]))
    out.append(("slot order", swapped))
    dropped = copy.deepcopy(doc)  # the replica's slot moved to another expert in phy2log only
    slot = int(l2p[li, e, 1])
    dropped["physical_to_logical_map"][li][slot] = (e + 1) % count.shape[1]
    out.append(("phy2log", dropped))
    recount = copy.deepcopy(doc)
    recount["logical_replica_count"][li][e] = 1
    out.append(("count", recount))
    shifted = copy.deepcopy(doc)  # a whole layer one physical slot off
    shifted["physical_to_logical_map"][-1] = np.roll(p2l[-1], 1).tolist()
    out.append(("layer rolled", shifted))
    return out


def test_vllm_check_fails_on_a_corrupted_map(tmp_path, monkeypatch):
    inst, ipath, ppath, rmap = replica_pair(tmp_path, n=4)
    out = tmp_path / "vllm.json"
    ex.export_file("vllm", ppath, out, ipath)
    doc = json.loads(out.read_text())
    check_with_vllm(doc, monkeypatch)
    names = []
    for name, bad in _corruptions(doc):
        with pytest.raises(AssertionError):
            check_with_vllm(bad, monkeypatch)
        with pytest.raises(InvalidInputError, match="^vllm: "):  # and our own reader refuses it too
            ex.parse_vllm_eplb_maps(bad)
        names.append(name)
    assert names == ["slot order", "phy2log", "count", "layer rolled"]


def test_vllm_state_from_its_documented_example(monkeypatch):
    # vLLM's own example (EplbModelState field docs, vllm/distributed/eplb/eplb_state.py, 0.34.0):
    # 2 MoE layers, 6 physical and 4 logical experts on 3 EP ranks, through our exporter and vLLM's code
    p2l = np.array([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]])
    doc = ex.vllm_eplb_maps(Placement(np.arange(3), p2l), SimpleNamespace(
        model=SimpleNamespace(num_experts=4, moe_layers=(0, 1)), parallel=SimpleNamespace(ep=3),
        name="example", sha256=""))
    check_with_vllm(doc, monkeypatch)
    _, model_state = _vllm_state(2, 4, 6, monkeypatch)
    eplb._commit_eplb_maps(model_state, torch.tensor(p2l))
    assert model_state.logical_replica_count.tolist() == [[2, 2, 1, 1], [3, 1, 1, 1]]
