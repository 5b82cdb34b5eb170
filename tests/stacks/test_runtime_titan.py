"""The live expert map on TorchTitan 0.3.0's own ``MoE`` (``torchtitan/models/common/moe.py``), in process.

- The hooks read device tensors built once at install: a forward and backward with the map
  installed makes no tensor from Python data in :mod:`placement.consumers.runtime` (``torch.tensor``,
  ``torch.as_tensor``, ``torch.from_numpy`` are watched while the model runs).
- ``InstalledMap.update`` rewrites the same tensors: after the weights move to another order and
  the map is updated, the model again equals the logical one; the tensors keep their storage.
- The project's recorder, registered after the map, records logical ids.
- A TorchTitan MTP module (``mtp_layers.{j}.moe``) is layer ``num_layers + j``.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan imports it unconditionally

from placement.consumers import checkpoint as ck  # noqa: E402
from placement.consumers import runtime as rt  # noqa: E402
from placement.core.model import InvalidInputError  # noqa: E402
from tests.stacks.watch import host_tensor_watch  # noqa: E402
from tests.stacks.tiny import DIM, GROUP_PRESERVING, NON_GROUP_PRESERVING, titan_model, titan_moe  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")]
LAYERS = (1, 3)


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 7, DIM, generator=gen), torch.randn(3, 7, DIM, generator=gen)


def placed_copy(logical, maps):
    physical = copy.deepcopy(logical)
    physical.load_state_dict(ck.apply_permutation(physical.state_dict(), maps, stack="torchtitan", keep_router=True))
    return physical


def test_the_hooks_build_no_tensor_from_python_data_per_call():
    logical = titan_model(3)
    maps = {l: NON_GROUP_PRESERVING for l in LAYERS}
    physical = placed_copy(logical, maps)
    installed = rt.install_torchtitan(physical, maps)
    x, y = batch(1)
    with host_tensor_watch() as calls:
        for _ in range(2):  # several micro-batches
            loss = ((physical(x) - y) ** 2).mean()
            loss.backward()
    assert calls == []
    torch.testing.assert_close(physical(x), logical(x), atol=1e-6, rtol=0)
    rt.remove(installed)


def test_update_rewrites_the_same_tensors_and_follows_moved_weights():
    logical = titan_model(4)
    first = {l: NON_GROUP_PRESERVING for l in LAYERS}
    physical = placed_copy(logical, first)
    installed = rt.install_torchtitan(physical, first)
    assert installed.layers == LAYERS
    before = {l: [t.data_ptr() for t in installed.tensors(l)] for l in LAYERS}
    x, _ = batch(2)
    torch.testing.assert_close(physical(x), logical(x), atol=1e-6, rtol=0)
    # move the weights to a second order (what a migration does), then switch the map
    second = {1: GROUP_PRESERVING, 3: NON_GROUP_PRESERVING[::-1]}
    physical.load_state_dict(ck.apply_permutation(logical.state_dict(), second, stack="torchtitan", keep_router=True))
    assert (physical(x) - logical(x)).abs().max().item() > 1e-3  # weights moved, map not yet
    assert installed.update(second) == [1, 3]
    torch.testing.assert_close(physical(x), logical(x), atol=1e-6, rtol=0)
    assert {l: [t.data_ptr() for t in installed.tensors(l)] for l in LAYERS} == before
    assert installed.phy2log(1).tolist() == GROUP_PRESERVING
    assert {l: m.tolist() for l, m in installed.maps().items()} == second
    assert installed.log2phy(3).tolist() == [second[3].index(e) for e in range(8)]
    # a bad row leaves every layer's map as it was
    with pytest.raises(InvalidInputError, match="layer 3: not a permutation"):
        installed.update({1: NON_GROUP_PRESERVING, 3: [0] * 8})
    assert installed.phy2log(1).tolist() == GROUP_PRESERVING
    with pytest.raises(InvalidInputError, match=r"layers \[5\]: no TorchTitan MoE layer here"):
        installed.update({5: GROUP_PRESERVING}, strict=True)
    rt.remove(installed)
    assert (physical(x) - logical(x)).abs().max().item() > 1e-3


def test_the_recorder_registered_after_the_map_records_logical_ids(tmp_path):
    from placement.sources.importers.recorder import RouterRecorder, torchtitan_routers

    logical = titan_model(5)
    maps = {l: NON_GROUP_PRESERVING for l in LAYERS}
    physical = placed_copy(logical, maps)
    installed = rt.install_torchtitan(physical, maps)
    recorded = []
    for i, model in enumerate((logical, physical)):
        rec = RouterRecorder(tmp_path / str(i), rank=0, routers=torchtitan_routers(model))
        x, _ = batch(6)
        model(x)
        recorded.append([r["top_indices"] for r in rec.records])
        rec.close()
    assert recorded[0] == recorded[1] and recorded[0]
    rt.remove(installed)


def test_a_titan_mtp_module_is_layer_num_layers_plus_j():
    class MTPBlock(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

    class Model(torch.nn.Module):  # TorchTitan main's MTPDecoder names: layers.{i}, mtp_layers.{j}
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": MTPBlock(titan_moe(1)), "1": MTPBlock(titan_moe(2))})
            self.mtp_layers = torch.nn.ModuleList([MTPBlock(titan_moe(3))])

    maps = {0: GROUP_PRESERVING, 1: NON_GROUP_PRESERVING, 2: NON_GROUP_PRESERVING[::-1]}
    installed = rt.install_torchtitan(Model(), maps)
    assert installed.layers == (0, 1, 2) and installed.phy2log(2).tolist() == NON_GROUP_PRESERVING[::-1]
    installed.remove()
    with pytest.raises(InvalidInputError, match=r"layer 2: a TorchTitan MoE layer \(mtp_layers.0.moe\) without an expert map"):
        rt.install_torchtitan(Model(), {0: GROUP_PRESERVING, 1: GROUP_PRESERVING})


def test_unsupported_inputs_are_refused_in_one_line():
    moe = titan_moe(1)
    with pytest.raises(InvalidInputError, match="map has 4 experts, the installed one 8"):
        rt.install_torchtitan(moe, {0: NON_GROUP_PRESERVING}).update({0: [0, 1, 2, 3]})
    meta = copy.deepcopy(titan_moe(1)).to("meta")
    with pytest.raises(InvalidInputError, match="meta device"):
        rt.install_torchtitan(meta, {0: NON_GROUP_PRESERVING})


def test_ep2_tp2_over_four_processes_placed_model_gives_the_unplaced_loss_and_gradients(tmp_path):
    """``tests/stacks/titan_ep_job.py``: TorchTitan's own MoE parallelized with EP=2, TP=2 (DTensor
    inputs to the pre-hook: ids sharded over batch and TP, counts as partial sums) on 4 gloo
    processes; the placed model (weights permuted by ``apply_permutation(keep_router=True)``, plus
    the hooks) gives the unplaced loss, input, router and (permuted) expert gradients."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.stacks.titan_ep_job", str(tmp_path)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the 4-process TorchTitan job did not finish in 300 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted(r["dp_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["loss_diff"] < 1e-6 and r["input_grad_max_diff"] < 1e-6
        assert r["router_grad_max_diff"] < 1e-6 and r["expert_grad_max_diff"] < 1e-6
        assert r["counts_equal"]
        assert r["unhooked_loss_diff"] > 1e-3  # without the map the placed model differs
