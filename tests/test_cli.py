"""The CLI's contract: stable JSON keys, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from placement.cli import main
from tests.conftest import INSTANCES, ROOT

STABLE_KEYS = [
    "cross_domain_bytes_per_step",
    "intra_domain_bytes_per_step",
    "max_gpu_cross_domain_bytes_per_step",
    "expert_load_max_over_mean",
    "alltoall_time_s_per_step",
    "cross_domain_bytes_per_layer",
    "cross_domain_bytes_per_stage",
    "alltoall_time_s_per_stage",
    "cross_domain_bytes_per_ep_group",
    "predicted_step_time_s",
    "predicted_tokens_per_s_per_gpu",
    "predicted_tflops_per_gpu",
]


def test_evaluate_json_keys(capsys):
    assert main(["evaluate", str(INSTANCES / "tiny.json"), "--placement", "default", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in STABLE_KEYS:
        assert key in doc and f"heldout_{key}" in doc
    assert doc["cross_domain_bytes_per_step"] > 0


def test_solve_default_writes_and_evaluates(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["solve", str(INSTANCES / "tiny.json"), "--solver", "default", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(INSTANCES / "tiny.json"), "--placement", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    stored = json.loads(out.read_text())
    assert stored["metrics"]["cross_domain_bytes_per_step"] == doc["cross_domain_bytes_per_step"]
    assert stored["instance"]["name"] == "tiny" and len(stored["instance"]["sha256"]) == 64


def test_console_script_runs_as_a_process():
    proc = subprocess.run(
        ["placement", "evaluate", str(INSTANCES / "tiny.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cross-domain all-to-all bytes" in proc.stdout


def test_python_m_placement_cli_runs_main():
    """``python -m placement.cli`` (the module's ``__main__`` guard) runs the CLI: its output and
    its exit codes, not an import that does nothing and exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "placement.cli"]
    proc = subprocess.run([*run, "evaluate", str(INSTANCES / "tiny.json")], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "cross-domain all-to-all bytes" in proc.stdout, proc.stderr
    proc = subprocess.run([*run, "evaluate", "no/such/file.json"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "placement: error:" in proc.stderr, proc.stderr


def test_missing_file_exits_2(capsys):
    assert main(["evaluate", "no/such/file.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err


def test_bad_flag_exits_2(capsys):
    assert main(["solve", str(INSTANCES / "tiny.json"), "--solver", "nope"]) == 2
    assert "--solver" in capsys.readouterr().err
