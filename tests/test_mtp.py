"""Multi-token-prediction MoE layers as layers of the instance (layer index ``num_layers + j``).

The convention: the MoE layer of MTP layer ``j`` is ``model.moe_layers`` entry ``num_layers + j``,
on the last pipeline stage; routing, placements, verify, the step-time model and the exports
carry it like any other MoE layer (SGLang's map has decoder rows only).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from placement.cli import main as cli_main
from placement.formats import read_instance, write_instance
from placement.sources.instances import SPECS, build
from placement.core.model import InvalidInputError


@pytest.fixture(scope="module")
def mtp_instance(tmp_path_factory):
    """The ``tiny`` spec with its MTP layer's MoE placed (4 decoder layers, MoE 1..3, MTP MoE 4)."""
    spec = dataclasses.replace(SPECS["tiny"], name="tiny_mtp", mtp_moe_layers=1)
    tmp = tmp_path_factory.mktemp("mtp")
    write_instance(build(spec), tmp / "tiny_mtp.json")
    return tmp / "tiny_mtp.json"


def test_the_mtp_layer_is_an_moe_layer_of_the_last_stage(mtp_instance):
    inst = read_instance(mtp_instance)
    m = inst.model
    assert m.num_layers == 4 and m.mtp_num_layers == 1 and m.moe_layers == (1, 2, 3, 4)
    assert m.mtp_moe_layers == (4,) and m.is_mtp(4) and not m.is_mtp(3)
    assert inst.moe_layer2stage.tolist() == [0, 1, 1, 1]
    assert inst.routing.topk.shape[0] == 4  # routing statistics include it
    doc = json.loads(mtp_instance.read_text())
    assert doc["model"]["mtp_num_layers"] == 1


def test_an_instance_without_mtp_is_written_as_before(tmp_path):
    """Existing instances stay byte-identical: no ``mtp_num_layers`` key unless it is set."""
    write_instance(build(SPECS["tiny"]), tmp_path / "tiny.json")
    doc = json.loads((tmp_path / "tiny.json").read_text())
    assert "mtp_num_layers" not in doc["model"] and doc["model"]["moe_layers"] == [1, 2, 3]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["model"].pop("mtp_num_layers"), r"model\.moe_layers: .*needs model\.mtp_num_layers"),
        (lambda d: d["model"].update(moe_layers=[1, 2, 3, 5]), r"model\.moe_layers: layer 5 is out of range"),
        (lambda d: d["performance"]["architecture"].update(mtp_num_layers=2),
         r"performance\.architecture\.mtp_num_layers: expected 1"),
    ],
)
def test_bad_mtp_fields_name_the_file_and_field(mtp_instance, tmp_path, mutate, match):
    doc = json.loads(mtp_instance.read_text())
    mutate(doc)
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    (tmp_path / "bad.npz").write_bytes(mtp_instance.with_suffix(".npz").read_bytes())
    with pytest.raises(InvalidInputError, match=f"bad.json.*{match}"):
        read_instance(tmp_path / "bad.json")


def test_solve_verify_and_export_carry_the_mtp_layer(mtp_instance, tmp_path):
    out = tmp_path / "p.json"
    assert cli_main(["solve", str(mtp_instance), "--solver", "default", "--time-limit", "20", "-o", str(out)]) == 0
    placement = json.loads(out.read_text())
    assert len(placement["phy2log"]) == 4
    assert cli_main(["verify", str(mtp_instance), str(out)]) == 0
    assert cli_main(["show", str(out), "--instance", str(mtp_instance), "-o", str(tmp_path / "map.svg")]) == 0
    for fmt in ("megatron", "torchtitan"):
        perm = tmp_path / f"{fmt}.json"
        assert cli_main(["export", "--format", fmt, "--keep-router", "--instance", str(mtp_instance), "-o", str(perm),
                         str(out)]) == 0
        doc = json.loads(perm.read_text())
        assert sorted(doc["layers"]) == ["1", "2", "3", "4"] and doc["mtp_num_layers"] == 1
        assert doc["layers"]["4"] == placement["phy2log"][3]
    from placement.consumers.export import parse_sglang_expert_location, sglang_expert_location
    from placement.formats import read_placement

    inst = read_instance(mtp_instance)
    pl, _ = read_placement(out)
    rows = sglang_expert_location(inst, pl)["physical_to_logical_map"]
    assert len(rows) == 4  # decoder layers only: SGLang runs MTP as a separate draft model
    assert np.array_equal(parse_sglang_expert_location({"physical_to_logical_map": rows}, inst), pl.phy2log[:3])


def test_the_step_time_model_routes_the_mtp_layer_through_its_own_map(mtp_instance):
    """The last stage runs decoder layers 2, 3 (MoE positions 1, 2), the MTP layer with its own
    all-to-all (MoE position 3, not the last decoder layer's as a stand-in) and the head (-2)."""
    from placement.predict.performance import StepTimeModel

    assert StepTimeModel(read_instance(mtp_instance))._moe_idx[-1].tolist() == [1, 2, 3, -2]


def test_serving_traces_cannot_fill_mtp_layers(tmp_path, capsys):
    """SGLang and vLLM record decoder layers only: an instance asking for an MTP layer is refused."""
    model = {"name": "m", "num_layers": 2, "mtp_num_layers": 1, "moe_layers": [0, 1, 2], "num_experts": 8, "top_k": 2,
             "num_groups": 1, "groups_per_token": 1, "hidden_size": 16, "dispatch_bytes_per_token": 20,
             "combine_bytes_per_token": 32}
    parallel = {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "order": "tp-cp-ep-dp-pp", "stage_layers": [[0, 1]],
                "seq_len": 8, "micro_batch": 1, "global_batch": 1}
    cluster = {"num_domains": 1, "trays_per_domain": 1, "gpus_per_tray": 1, "nvlink_gbps": 900.0, "scaleout_gbps": 100.0}
    args = []
    for key, doc in (("model", model), ("parallel", parallel), ("cluster", cluster)):
        (tmp_path / f"{key}.json").write_text(json.dumps(doc))
        args += [f"--{key}", str(tmp_path / f"{key}.json")]
    (tmp_path / "trace.npz").write_bytes(b"")
    for source in ("sglang", "vllm"):
        code = cli_main(["import", "--from", source, str(tmp_path / "trace.npz"), *args, "-o", str(tmp_path / "i.json")])
        assert code == 2 and "traces have no rows for MTP layers ([2])" in capsys.readouterr().err
        assert not (tmp_path / "i.json").exists()
