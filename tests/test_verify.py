"""``placement verify``: a valid file passes; each corruption the checker knows is caught and named."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from placement.cli import main
from placement.predict.report import report
from placement.formats import placement_document, read_instance, write_instance, write_placement
from placement.core.model import Placement
from placement.app.verify import metric_misstatements, verify_document
from solvers.default import default_placement
from tests.conftest import INSTANCES, random_instance


@pytest.fixture(scope="module")
def valid(tiny):
    """The tiny instance, a valid group-preserving placement with its true metrics, its document."""
    rng = np.random.default_rng(0)
    base = default_placement(tiny)
    size = tiny.model.num_experts // tiny.model.num_groups
    rows = [np.concatenate([g * size + rng.permutation(size) for g in rng.permutation(tiny.model.num_groups)])
            for _ in range(tiny.model.num_moe_layers)]
    p = Placement(base.rank2gpu, np.stack(rows))
    doc = placement_document(tiny, p, solver="test", metrics=report(tiny, p), group_preserving=True)
    return tiny, p, doc


def run(inst, doc) -> list[str]:
    """Violations of ``doc`` (parsed like the reader does)."""
    p = Placement(np.array(doc["rank2gpu"]), np.array(doc["phy2log"]).reshape(len(doc["phy2log"]), -1))
    return verify_document(inst, p, doc).violations


def test_valid_placement_passes(valid):
    inst, p, doc = valid
    rep = verify_document(inst, p, doc)
    assert rep.valid and rep.violations == []
    assert rep.checks == ["instance", "structure", "etp", "tp", "groups", "metrics"]
    assert rep.metrics["cross_domain_bytes_per_step"] == doc["metrics"]["cross_domain_bytes_per_step"]


def corrupt(doc, fn):
    d = copy.deepcopy(doc)
    fn(d)
    return d


def _set(path, value):
    def fn(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value

    return fn


UNAVAILABLE_GPU = 15  # tiny: GPUs 14 and 15 (one tray) are down


@pytest.mark.parametrize(
    "name, fn, expect",
    [
        ("instance name", _set(["instance", "name"], "other"), "instance.name"),
        ("instance sha256", _set(["instance", "sha256"], "0" * 64), "instance.sha256"),
        ("unavailable GPU", _set(["rank2gpu", 3], UNAVAILABLE_GPU), "rank2gpu[3]: GPU 15 is unavailable"),
        ("GPU out of range", _set(["rank2gpu", 0], 10_000), "rank2gpu[0]: GPU 10000 does not exist"),
        ("two ranks on one GPU", lambda d: d["rank2gpu"].__setitem__(1, d["rank2gpu"][0]), "runs 2 ranks"),
        ("a rank missing", lambda d: d["rank2gpu"].pop(), "expected 16 ranks"),
        ("expert placed twice", lambda d: d["phy2log"][1].__setitem__(0, d["phy2log"][1][1]), "phy2log[1]: not a permutation"),
        ("a layer missing", lambda d: d["phy2log"].pop(), "expected 3 MoE layers"),
        ("slots exceeded", lambda d: [row.append(0) for row in d["phy2log"]], "slots per layer"),
        ("groups broken", lambda d: d["phy2log"].__setitem__(2, [d["phy2log"][2][-1], *d["phy2log"][2][1:-1], d["phy2log"][2][0]]),
         "group_preserving: phy2log[2]: slots 0..3 mix expert groups"),
        ("DeepEP rule", _set(["consumer"], "deepep"), "DeepEP/HybridEP rule"),
        ("unknown consumer", _set(["consumer"], "nccl"), "consumer: expected one of"),
        ("metric misstated", lambda d: d["metrics"].__setitem__("cross_domain_bytes_per_step", d["metrics"]["cross_domain_bytes_per_step"] * (1 + 1e-6)),
         "metrics.cross_domain_bytes_per_step"),
        ("metric list misstated", lambda d: d["metrics"]["cross_domain_bytes_per_layer"].__setitem__(1, 0.0),
         "metrics.cross_domain_bytes_per_layer: the file states [1] = 0.0"),
        ("metric list length", lambda d: d["metrics"]["heldout_cross_domain_bytes_per_stage"].pop(),
         "metrics.heldout_cross_domain_bytes_per_stage: the file states 1 values"),
        ("cost mode misstated", _set(["metrics", "cost_mode"], "per_pair"), "metrics.cost_mode"),
        ("unknown metric", _set(["metrics", "magic"], 1.0), "metrics.magic: not a metric"),
    ],
)
def test_each_corruption_is_caught_and_named(valid, name, fn, expect):
    inst, _, doc = valid
    assert run(inst, doc) == []
    violations = run(inst, corrupt(doc, fn))
    assert violations, name
    assert any(expect in v for v in violations), (name, violations)


def test_metric_tolerance_is_relative_1e_9():
    computed = {"a": 1e15, "b": [0.0, 2.0], "cost_mode": "per_domain"}
    assert metric_misstatements({"a": 1e15 * (1 + 5e-10), "b": [0.0, 2.0]}, computed) == []
    assert metric_misstatements({"a": 1e15 * (1 + 2e-9)}, computed)[0].startswith("metrics.a:")
    assert metric_misstatements({"b": [1e-300, 2.0]}, computed)  # zero stays zero
    assert "'1e15' (not a number)" in metric_misstatements({"a": "1e15"}, computed)[0]


def test_every_violation_is_listed_at_once(valid):
    inst, _, doc = valid
    bad = corrupt(doc, _set(["instance", "name"], "x"))
    bad = corrupt(bad, _set(["consumer"], "deepep"))
    bad = corrupt(bad, _set(["metrics", "remote_domains_per_token"], 0.0))
    violations = run(inst, bad)
    assert len(violations) >= 3
    assert {v.split(":")[0] for v in violations} >= {"instance.name", "consumer deepep", "metrics.remote_domains_per_token"}


# ---------------------------------------------------------------------------------------------
# TP and CP groups
# ---------------------------------------------------------------------------------------------
def tp_instance(tp: int, cp: int = 1):
    # 2 domains x 2 trays x 4 GPUs; world 16 = tp * cp * dp * pp
    return random_instance(np.random.default_rng(9), tp=tp, cp=cp, dp=8 // (tp * cp), ep=8 // (tp * cp), pp=2,
                           num_domains=2, trays_per_domain=2, gpus_per_tray=4)


def test_tp_groups_inside_a_tray(tmp_path):
    inst = tp_instance(2)
    p2l = np.tile(np.arange(8), (3, 1))
    ok = Placement(np.arange(16), p2l)  # TP pairs (0,1), (2,3), ... on one tray each
    assert run(inst, placement_document(inst, ok, solver="t")) == []
    r2g = np.arange(16)
    r2g[[3, 4]] = r2g[[4, 3]]  # ranks 2,3 -> GPUs 2,4: two trays of domain 0
    v = run(inst, placement_document(inst, Placement(r2g, p2l), solver="t"))
    assert any("TP group of ranks [2, 3]" in x and "spans trays" in x for x in v), v
    r2g = np.arange(16)
    r2g[[1, 8]] = r2g[[8, 1]]  # rank 1 -> GPU 8: another domain
    v = run(inst, placement_document(inst, Placement(r2g, p2l), solver="t"))
    assert any("TP group of ranks [0, 1]" in x and "spans NVLink domains [0, 1]" in x for x in v), v


def test_tp_times_cp_group_inside_a_domain():
    inst = tp_instance(2, cp=2)
    p2l = np.tile(np.arange(8), (3, 1))
    assert run(inst, placement_document(inst, Placement(np.arange(16), p2l), solver="t")) == []
    r2g = np.arange(16)
    r2g[[2, 3, 8, 9]] = r2g[[8, 9, 2, 3]]  # the cp=1 TP pair of group (dp=0) moves to domain 1, whole
    v = run(inst, placement_document(inst, Placement(r2g, p2l), solver="t"))
    assert not any("TP group" in x for x in v)
    assert any("TP x CP group" in x and "spans NVLink domains [0, 1]" in x for x in v), v


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def test_cli_verify_exit_codes(tmp_path, capsys, valid):
    inst, _, doc = valid
    good = tmp_path / "good.json"
    write_placement(good, doc)
    assert main(["verify", str(INSTANCES / "tiny.json"), str(good)]) == 0
    assert capsys.readouterr().out.startswith("valid:")

    bad = corrupt(doc, lambda d: d["rank2gpu"].__setitem__(1, d["rank2gpu"][0]))
    bad = corrupt(bad, _set(["metrics", "expert_load_max_over_mean"], 99.0))
    bad_path = tmp_path / "bad.json"
    write_placement(bad_path, bad)
    assert main(["verify", str(INSTANCES / "tiny.json"), str(bad_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"placement: verify: 1 violation in {bad_path}", "rank2gpu: GPU 0 runs 2 ranks"]
    # (the misstated metric is not reported: metrics are recomputed only for a valid structure)

    bad = corrupt(bad, _set(["instance", "name"], "other"))
    write_placement(bad_path, bad)
    assert main(["verify", str(INSTANCES / "tiny.json"), str(bad_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"placement: verify: 2 violations in {bad_path}" and len(lines) == 3


def test_cli_verify_against_another_instance(tmp_path, capsys, valid):
    _, _, doc = valid
    path = tmp_path / "p.json"
    write_placement(path, doc)
    other = random_instance(np.random.default_rng(1), num_experts=16, num_groups=4, groups_per_token=2, ep=8, dp=8,
                            num_domains=5, trays_per_domain=2, gpus_per_tray=2, moe_layers=3)
    ipath = tmp_path / "other.json"
    write_instance(other, ipath)
    assert main(["verify", str(ipath), str(path)]) == 2
    err = capsys.readouterr().err
    assert "instance.name" in err and "instance.sha256" in err


def test_cli_verify_unreadable_file(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "placement"}))
    assert main(["verify", str(INSTANCES / "tiny.json"), str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert read_instance(INSTANCES / "tiny.json").name == "tiny"
