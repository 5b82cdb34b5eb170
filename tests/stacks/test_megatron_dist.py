"""Megatron-Core 0.16.1's distributed optimizer, EP = 2 over 2 gloo processes, with an MTP MoE layer.

The job (tests/stacks/megatron_dist_job.py) trains, saves with ``dist_checkpointing`` in the
default ``dp_reshardable`` layout (bucket state under ``chained_N.optimizer.distributed.
dp_group_idx_G...``), records the bucket layout, permutes the checkpoint split over both ranks
(experts move between the EP ranks' buckets; the MTP layer is model layer ``num_layers``), loads
it into fresh models and takes two steps: every parameter equals the unpermuted checkpoint's
continuation with the map applied.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_dist") / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.stacks.megatron_dist_job", str(out), "dp_reshardable"], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the Megatron-Core distributed-optimizer job did not finish in 600 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_dp_reshardable_ep2_save_permute_load_and_train_on_identically(job):
    assert job["chained"] == 2  # a dense and an expert DistributedOptimizer
    assert job["loss_diff"] < 1e-6 and job["ref_loss_diff"] < 1e-6
    assert job["loss_after_steps_diff"] < 1e-6
    assert job["param_max_diff"] < 1e-5, job["params_off"]
    changed = set(job["changed"])
    dtype = "dtype_(torch.float32, torch.float32)"
    # the expert optimizer's buckets on both EP ranks (dp_group_idx 0 and 1) and the dense one (router rows)
    for opt, dp in ((1, 0), (1, 1), (0, 0)):
        for state in ("param", "exp_avg", "exp_avg_sq"):
            assert f"chained_{opt}.optimizer.distributed.dp_group_idx_{dp}.gbuf_idx_0.{dtype}.bucket_idx_0.{state}" in changed


def test_the_mtp_moe_layer_is_permuted_as_layer_num_layers(job):
    assert job["mtp_experts_moved"]
    changed = set(job["changed"])
    for key in ("mtp.layers.0.transformer_layer.mlp.router.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight",
                "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2._extra_state/shard_7_8"):
        assert key in changed
