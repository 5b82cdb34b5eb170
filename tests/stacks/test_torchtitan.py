"""TorchTitan 0.3.0's own MoE module and checkpoint code, on CPU: save -> permute -> load, and the runtime map.

Read against ``torchtitan/models/common/moe.py`` (``MoE``, ``TokenChoiceTopKRouter``,
``GroupedExperts``: ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD``, ``expert_bias_E``, ``tokens_per_expert_E``)
and ``torchtitan/components/optimizer/utils.py`` (``get_flat_optim_state_dict``: optimizer state
as ``state.{fqn}.{name}``), saved with ``torch.distributed.checkpoint`` as TorchTitan's
checkpointer does (model FQNs at the top level, the optimizer under ``optimizer``).
"""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan imports it unconditionally

import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, load_flat_optim_state_dict  # noqa: E402

from placement import checkpoint as ck  # noqa: E402
from placement import runtime as rt  # noqa: E402
from placement.core.model import InfeasibleError  # noqa: E402
from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")]
from tests.stacks.tiny import DIM, GROUP_PRESERVING, NON_GROUP_PRESERVING, NUM_EXPERTS, titan_model  # noqa: E402

LAYERS = (1, 3)


def doc(perm, *, group_limited=True) -> dict:
    return {
        "kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "torchtitan", "num_experts": NUM_EXPERTS,
        "num_groups": 2, "group_limited": group_limited, "layers": {str(l): list(perm) for l in LAYERS},
    }


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 7, DIM, generator=gen), torch.randn(3, 7, DIM, generator=gen)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def trained(seed: int):
    """A model and its Adam after one step (so moments exist and differ per expert)."""
    model = titan_model(seed)
    opt = torch.optim.Adam(list(model.named_parameters()), lr=1e-2)
    x, y = batch(seed + 100)
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def save(model, opt, path) -> None:
    dcp.save({**model.state_dict(), "optimizer": get_flat_optim_state_dict(opt)}, checkpoint_id=str(path))


def load(path):
    model = titan_model(999)  # other weights: everything must come from the checkpoint
    opt = torch.optim.Adam(list(model.named_parameters()), lr=1e-2)
    x, y = batch(5)
    loss_of(model, x, y).backward()
    opt.step()  # materialise the optimizer state that load_flat_optim_state_dict fills
    opt.zero_grad()
    state = {**model.state_dict(), "optimizer": get_flat_optim_state_dict(opt)}
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    load_flat_optim_state_dict(opt, state["optimizer"])
    return model, opt


def test_dcp_save_permute_load_same_loss_and_next_step(tmp_path):
    model, opt = trained(0)
    save(model, opt, tmp_path / "ckpt")
    changed = ck.permute_dcp(tmp_path / "ckpt", tmp_path / "perm", doc(GROUP_PRESERVING), stack="torchtitan")
    assert "optimizer.state.layers.1.moe.routed_experts.inner_experts.w1_EFD.exp_avg" in changed
    assert "layers.3.moe.expert_bias_E" in changed and "layers.3.moe.router.gate.weight" in changed
    loaded, opt2 = load(tmp_path / "perm")
    inner = loaded.layers["1"].moe.routed_experts.inner_experts
    assert torch.equal(inner.w1_EFD.detach()[0], model.layers["1"].moe.routed_experts.inner_experts.w1_EFD.detach()[GROUP_PRESERVING[0]])
    x, y = batch(7)
    assert abs(loss_of(loaded, x, y).item() - loss_of(model, x, y).item()) < 1e-6
    torch.testing.assert_close(loaded(x), model(x), atol=1e-6, rtol=0)
    for m, o in ((model, opt), (loaded, opt2)):  # the next optimizer step
        loss_of(m, x, y).backward()
        o.step()
        o.zero_grad()
    want = ck.apply_permutation(model.state_dict(), {l: GROUP_PRESERVING for l in LAYERS}, stack="torchtitan", num_groups=2)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=1e-6, rtol=0, msg=k)
    x2, y2 = batch(8)
    assert abs(loss_of(loaded, x2, y2).item() - loss_of(model, x2, y2).item()) < 1e-6


def test_unpermuted_moments_would_change_the_next_step(tmp_path):
    """The silent case: weights permuted, Adam moments left in place -> a different next step."""
    model, opt = trained(0)
    save(model, opt, tmp_path / "ckpt")
    ck.permute_dcp(tmp_path / "ckpt", tmp_path / "perm", doc(GROUP_PRESERVING), stack="torchtitan")
    loaded, opt2 = load(tmp_path / "perm")
    sd = get_flat_optim_state_dict(opt2)
    key = "state.layers.1.moe.routed_experts.inner_experts.w1_EFD.exp_avg"
    want = get_flat_optim_state_dict(opt)[key][GROUP_PRESERVING]
    torch.testing.assert_close(sd[key], want, atol=0, rtol=0)
    assert not torch.equal(want, get_flat_optim_state_dict(opt)[key])


def test_group_breaking_permutation_refused_for_group_limited_routing(tmp_path):
    model, opt = trained(0)
    save(model, opt, tmp_path / "ckpt")
    with pytest.raises(InfeasibleError, match="across groups"):
        ck.permute_dcp(tmp_path / "ckpt", tmp_path / "perm", doc(NON_GROUP_PRESERVING), stack="torchtitan")
    assert not (tmp_path / "perm").exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_runtime_map_non_group_preserving_same_outputs_and_gradients():
    logical = titan_model(3)
    logical.train()
    physical = copy.deepcopy(logical)
    layers = {l: NON_GROUP_PRESERVING for l in LAYERS}
    moved = ck.apply_permutation(physical.state_dict(), layers, stack="torchtitan", keep_router=True)
    physical.load_state_dict(moved)
    handles = rt.install_torchtitan(physical, json.loads(json.dumps(doc(NON_GROUP_PRESERVING))))
    x, y = batch(11)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    la, lb = loss_of(logical, xa, y), loss_of(physical, xb, y)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) < 1e-6
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-6, rtol=0)
    for l in LAYERS:
        a, b = logical.layers[str(l)].moe, physical.layers[str(l)].moe
        torch.testing.assert_close(b.router.gate.weight.grad, a.router.gate.weight.grad, atol=1e-6, rtol=0)
        assert torch.equal(b.tokens_per_expert_E, a.tokens_per_expert_E)  # balancing counts stay logical
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            ga = getattr(a.routed_experts.inner_experts, name).grad
            gb = getattr(b.routed_experts.inner_experts, name).grad
            torch.testing.assert_close(gb, ga[NON_GROUP_PRESERVING], atol=1e-6, rtol=0)
    rt.remove(handles)
    assert (physical(x) - logical(x)).abs().max().item() > 1e-3  # without the map the model differs


def test_the_keep_router_export_file_is_what_the_checkpoint_tool_and_the_hooks_apply(tmp_path):
    """End to end with the exact file ``placement export --format torchtitan --keep-router`` writes for a
    group-breaking placement: the checkpoint permuted with it (``keep_router``) and the hooks
    installed from it give the logical model's loss, next optimizer step included; without the hooks
    the model differs, and the checkpoint-mode export (``--apply checkpoint``) of the same placement is refused."""
    from tests.stacks.tiny import keep_router_export

    maps = [NON_GROUP_PRESERVING, NON_GROUP_PRESERVING[::-1]]
    (tmp_path / "export").mkdir()
    path = keep_router_export(tmp_path / "export", "torchtitan", LAYERS, maps)
    model, opt = trained(0)
    save(model, opt, tmp_path / "ckpt")
    ck.permute_dcp(tmp_path / "ckpt", tmp_path / "perm", str(path), keep_router=True)
    loaded, opt2 = load(tmp_path / "perm")
    handles = rt.install_torchtitan(loaded, str(path))
    x, y = batch(7)
    assert abs(loss_of(loaded, x, y).item() - loss_of(model, x, y).item()) < 1e-6
    for m, o in ((model, opt), (loaded, opt2)):  # the next optimizer step
        loss_of(m, x, y).backward()
        o.step()
        o.zero_grad()
    x2, y2 = batch(8)
    assert abs(loss_of(loaded, x2, y2).item() - loss_of(model, x2, y2).item()) < 1e-6
    rt.remove(handles)
    assert abs(loss_of(loaded, x2, y2).item() - loss_of(model, x2, y2).item()) > 1e-6
    from placement.cli import main as cli_main

    code = cli_main(["export", "--format", "torchtitan", "--apply", "checkpoint", "--instance", str(tmp_path / "export" / "instance.json"),
                     "-o", str(tmp_path / "plain.json"), str(tmp_path / "export" / "placement.json")])
    assert code == 3 and not (tmp_path / "plain.json").exists()
