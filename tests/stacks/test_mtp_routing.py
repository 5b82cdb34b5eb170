"""MTP routing end to end on Megatron-Core 0.16.1's own GPTModel with ``mtp_num_layers=1`` (CPU).

The model's MTP head has its own MoE (``mtp.layers.0.transformer_layer.mlp``).  The project's
recorder writes the head's router calls as Megatron-LM's tracer does (``"block": "mtp",
"mtp_idx": 0``), with the runtime map installed on a placed copy it still records logical ids,
and ``placement import --from megatron`` turns them into MoE layer ``num_layers + 0`` of an
instance with ``model.mtp_num_layers = 1``, which solves and verifies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from placement.cli import main  # noqa: E402
from placement.formats import read_instance  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # the stack warns about missing TE/Apex/CUDA
NUM_LAYERS, E, K = 2, 8, 2


@pytest.fixture(scope="module")
def mtp_gpt():
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    from tests.stacks.tiny import cpu_patches, init_megatron_world

    init_megatron_world()
    with cpu_patches():
        config = TransformerConfig(
            num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=E,
            moe_router_topk=K, moe_ffn_hidden_size=24, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none", use_cpu_initialization=True, params_dtype=torch.float32,
            bf16=False, fp16=False, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
        )
        spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            models.append(GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                position_embedding_type="learned_absolute",
                mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
            ))
    logical, physical = models
    physical.load_state_dict(logical.state_dict())
    return logical, physical


def test_mtp_router_calls_are_recorded_logically_and_imported_as_layer_num_layers(mtp_gpt, tmp_path, capsys):
    import torch

    from placement import checkpoint as ck
    from placement import runtime as rt
    from placement.sources.importers.recorder import RouterRecorder, megatron_mtp_routers, megatron_routers
    from tests.stacks.tiny import causal_inputs, cpu_patches

    logical, physical = mtp_gpt
    assert sorted(megatron_mtp_routers(logical)) == [0]
    maps = {0: [1, 0, 3, 2, 5, 4, 7, 6], 1: [7, 6, 5, 4, 3, 2, 1, 0], NUM_LAYERS: [5, 0, 7, 2, 1, 6, 3, 4]}
    state = {k: v.clone() for k, v in physical.state_dict().items() if "_extra_state" not in k}
    # the MTP layer's experts under the decoder key form apply_permutation reads (layer NUM_LAYERS)
    renamed = {k.replace("mtp.layers.0.transformer_layer.", f"decoder.layers.{NUM_LAYERS}."): v for k, v in state.items()}
    moved = ck.apply_permutation(renamed, maps, stack="megatron", keep_router=True)
    physical.load_state_dict(
        {k.replace(f"decoder.layers.{NUM_LAYERS}.", "mtp.layers.0.transformer_layer."): v for k, v in moved.items()},
        strict=False,
    )
    installed = rt.install_megatron(physical, maps)
    assert installed.layers == (0, 1, NUM_LAYERS)
    steps, batch, seq = 3, 2, 6
    gen = torch.Generator().manual_seed(0)
    traces = {name: tmp_path / name for name in ("logical", "physical")}
    recs = {name: RouterRecorder(traces[name], rank=0, routers=megatron_routers(model),
                                 mtp_routers=megatron_mtp_routers(model))
            for name, model in (("logical", logical), ("physical", physical))}
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (batch, seq), generator=gen)
        labels = torch.randint(0, 64, (batch, seq), generator=gen)
        pos, mask = causal_inputs(batch, seq)
        with cpu_patches(), torch.no_grad():
            losses.append([model(tokens, pos, mask, labels=labels).float().mean().item() for model in (logical, physical)])
        for r in recs.values():
            r.advance_step()
    for r in recs.values():
        r.close()
    installed.remove()
    assert all(abs(a - b) < 1e-6 for a, b in losses)  # the placed model with its map is the logical one
    files = {name: sorted(str(p) for p in folder.iterdir()) for name, folder in traces.items()}
    assert Path(files["logical"][0]).read_text() == Path(files["physical"][0]).read_text()  # logical ids
    records = [json.loads(line) for line in Path(files["logical"][0]).read_text().splitlines()]
    mtp = [r for r in records if r["block"] == "mtp"]
    assert len(mtp) == steps and {(r["mtp_idx"], r["layer"]) for r in mtp} == {(0, 0)}

    model = {"name": "tiny-mtp", "num_layers": NUM_LAYERS, "mtp_num_layers": 1, "moe_layers": [0, 1, NUM_LAYERS],
             "num_experts": E, "top_k": K, "num_groups": 1, "groups_per_token": 1, "hidden_size": 16,
             "dispatch_bytes_per_token": 20, "combine_bytes_per_token": 32}
    parallel = {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "order": "tp-cp-ep-dp-pp", "stage_layers": [[0, 1]],
                "seq_len": seq, "micro_batch": batch, "global_batch": batch}
    cluster = {"num_domains": 1, "trays_per_domain": 2, "gpus_per_tray": 1, "nvlink_gbps": 900.0, "scaleout_gbps": 100.0}
    args = []
    for key, doc in (("model", model), ("parallel", parallel), ("cluster", cluster)):
        (tmp_path / f"{key}.json").write_text(json.dumps(doc))
        args += [f"--{key}", str(tmp_path / f"{key}.json")]
    out = tmp_path / "inst.json"
    assert main(["import", "--from", "megatron", *files["physical"], *args, "-o", str(out)]) == 0, capsys.readouterr().err
    inst = read_instance(out)
    assert inst.model.moe_layers == (0, 1, NUM_LAYERS) and inst.routing.topk.shape[0] == 3
    want = np.sort(np.asarray(mtp[0]["top_indices"]), axis=-1)
    np.testing.assert_array_equal(np.sort(inst.routing.topk[2, 0, : len(want)], axis=-1), want)
    capsys.readouterr()
    assert main(["solve", str(out), "--solver", "default", "--time-limit", "20", "-o", str(tmp_path / "p.json")]) == 0
    assert main(["verify", str(out), str(tmp_path / "p.json")]) == 0


def test_megatron_refusals_are_one_line_and_update_follows_a_new_map(mtp_gpt):
    import torch

    from placement import runtime as rt
    from placement.core.model import InvalidInputError
    from tests.stacks.tiny import cpu_patches

    logical, _ = mtp_gpt
    maps = {0: list(range(E)), 1: list(range(E)), NUM_LAYERS: list(range(E))}
    cases = [
        (lambda: rt.install_megatron([logical, logical], maps), r"layer 0: two Megatron MoE modules claim this layer \(decoder\.layers\.0\.mlp\)"),
        (lambda: rt.install_megatron(logical, {0: maps[0], 1: maps[1]}),
         r"layer 2: a Megatron MoE layer \(mtp\.layers\.0\.transformer_layer\.mlp\) without an expert map"),
        (lambda: rt.install_megatron(logical, {**maps, 1: [0, 1, 2, 3]}), r"layer 1: map has 4 experts, the router 8"),
        (lambda: rt.install_megatron(logical, {**maps, 7: maps[0]}), r"layers \[7\]: expert maps for layers the Megatron"),
    ]
    for call, match in cases:
        with pytest.raises(InvalidInputError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
        assert "route" not in vars(logical.decoder.layers[0].mlp)  # a refused install leaves nothing behind
    live = rt.install_megatron(logical, maps)
    with pytest.raises(InvalidInputError, match="already has an expert map installed"):
        rt.install_megatron(logical, maps)
    mlp = logical.mtp.layers[0].transformer_layer.mlp
    hidden = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(4))
    with cpu_patches():
        want_probs, want_map = type(mlp).route(mlp, hidden)
    new = [5, 0, 7, 2, 1, 6, 3, 4]
    tensors = live.tensors(NUM_LAYERS)
    assert live.update({NUM_LAYERS: new, 9: new}) == [NUM_LAYERS]  # layer 9: another stage's, ignored
    assert live.tensors(NUM_LAYERS)[0] is tensors[0] and live.phy2log(NUM_LAYERS).tolist() == new
    with cpu_patches():
        probs, routing_map = mlp.route(hidden)
    assert torch.equal(probs, want_probs[:, new]) and torch.equal(routing_map, want_map[:, new])
    live.remove()
    assert "route" not in vars(mlp)
