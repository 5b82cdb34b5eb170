"""Instance and placement files: round trips, schemas, and bad input named by field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from placement.cli import main
from placement.formats import json_schemas, read_instance, write_instance
from placement.core.model import InvalidInputError
from tests.conftest import INSTANCES, ROOT


def copy_tiny(tmp_path: Path) -> Path:
    for suffix in (".json", ".npz"):
        shutil.copy(INSTANCES / f"tiny{suffix}", tmp_path / f"tiny{suffix}")
    return tmp_path / "tiny.json"


def edit(path: Path, fn) -> Path:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_round_trip(tiny, tmp_path):
    write_instance(tiny, tmp_path / "t.json")
    again = read_instance(tmp_path / "t.json")
    assert again.model == tiny.model and again.parallel == tiny.parallel
    assert np.array_equal(again.routing.topk, tiny.routing.topk)
    assert np.array_equal(again.routing.heldout_topk, tiny.routing.heldout_topk)
    assert np.array_equal(again.cluster.available, tiny.cluster.available)
    # Writing is byte-for-byte reproducible.
    write_instance(again, tmp_path / "u.json")
    assert (tmp_path / "t.npz").read_bytes() == (tmp_path / "u.npz").read_bytes()


def test_published_schemas_are_current():
    for name, schema in json_schemas().items():
        path = ROOT / "placement" / "schemas" / name
        assert json.loads(path.read_text()) == schema, f"regenerate {path} (python -m placement.formats)"


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d["model"].update(num_expert=d["model"].pop("num_experts")), "model.num_expert"),
        (lambda d: d["parallel"].update(expert_slots_per_rank=1), "parallel.expert_slots_per_rank"),
        (lambda d: d["cluster"].update(nvlink_gbps=-1), "cluster.nvlink_gbps"),
        (lambda d: d["model"].update(top_k="8"), "model.top_k"),
        (lambda d: d["parallel"].update(ep=3), "parallel.ep"),
        (lambda d: d["parallel"].update(order="tp-cp-dp-pp"), "parallel.order"),
        (lambda d: d["parallel"]["stage_layers"][0].append(3), "parallel.stage_layers"),
        (lambda d: d["cluster"].update(unavailable_gpus=[1, 1]), "cluster.unavailable_gpus"),
        (lambda d: d["cluster"].update(unavailable_gpus=[10**6]), "cluster.unavailable_gpus"),
        (lambda d: d["routing"].update(file="../../etc/passwd"), "routing.file"),
        (lambda d: d["routing"].update(file="missing.npz"), "routing.file"),
        (lambda d: d.pop("cost_mode"), "cost_mode"),
    ],
)
def test_bad_instance_exits_2_naming_field(tmp_path, capsys, mutate, field):
    path = edit(copy_tiny(tmp_path), mutate)
    code, out, err = run_cli(["evaluate", str(path)], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and field in err, err


def test_misspelled_key_suggests_near_miss(tmp_path, capsys):
    path = edit(copy_tiny(tmp_path), lambda d: d["model"].update(hiden_size=d["model"].pop("hidden_size")))
    code, _, err = run_cli(["evaluate", str(path)], capsys)
    assert code == 2 and "model.hiden_size" in err and "did you mean 'hidden_size'" in err


def test_wrongly_shaped_routing_exits_2(tmp_path, capsys):
    path = copy_tiny(tmp_path)
    with np.load(tmp_path / "tiny.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["topk"] = arrays["topk"][:, :, :, :3]
    np.savez(tmp_path / "tiny.npz", **arrays)
    code, _, err = run_cli(["evaluate", str(path)], capsys)
    assert code == 2 and "routing.topk" in err and "shape" in err


def test_pickled_npz_refused(tmp_path):
    path = copy_tiny(tmp_path)
    np.savez(tmp_path / "tiny.npz", topk=np.array([object()]), heldout_topk=np.array([1]))
    with pytest.raises(InvalidInputError, match="routing.file.*pickled"):
        read_instance(path)


def test_truncated_npz_refused(tmp_path):
    path = copy_tiny(tmp_path)
    data = (tmp_path / "tiny.npz").read_bytes()
    (tmp_path / "tiny.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidInputError, match="routing.file"):
        read_instance(path)


def test_malformed_json(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1,')
    code, _, err = run_cli(["evaluate", str(path)], capsys)
    assert code == 2 and "malformed JSON" in err


def test_nan_refused(tmp_path):
    path = copy_tiny(tmp_path)
    path.write_text(path.read_text().replace('"nvlink_gbps": 900.0', '"nvlink_gbps": NaN'))
    with pytest.raises(InvalidInputError, match="NaN"):
        read_instance(path)
