"""Megatron-Core 0.16.1's own GPTModel, dist_checkpointing and optimizer state code, on CPU.

The model is built from ``get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)``
(SequentialMLP experts, ``TopKRouter`` with sigmoid scores, the aux-loss-free ``expert_bias``
buffer and group-limited top-2 over 1 of 2 groups).  The work runs in a child process
(``tests/stacks/megatron_job.py``) with a hard timeout: it needs a process group and patches for
CUDA-only calls, and ``dist_checkpointing.save`` forks a writer process.
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
pytest.importorskip("psutil")  # without it dist_checkpointing.save hangs (its forked writer dies)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron") / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.stacks.megatron_job", str(out)], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the Megatron-Core job did not finish in 600 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_torch_dist_save_permute_load_same_loss_and_next_step(job):
    assert job["loss_diff"] < 1e-6 and job["loss_after_step_diff"] < 1e-6
    assert job["next_step_max_diff"] < 1e-6
    assert job["expert0_moved"]
    changed = set(job["changed"])
    assert "decoder.layers.mlp.router.expert_bias" in changed  # the router buffer
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in changed  # moments
    assert "optimizer.state.exp_avg_sq.decoder.layers.mlp.router.weight" in changed
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.7_2.8" in changed  # per-expert objects


def test_runtime_map_non_group_preserving_same_outputs_and_gradients(job):
    assert job["hook_loss_diff"] < 1e-6
    assert job["hook_grad_max_diff"] < 1e-6
    assert job["hook_bias_counts_equal"]  # aux-loss-free counts stay logical
    assert job["unhooked_loss_diff"] > 1e-6  # without the map the permuted model differs


def test_the_keep_router_export_file_is_what_the_checkpoint_tool_and_the_hooks_apply(job):
    """The exact file ``placement export --format megatron --keep-router`` writes for a group-breaking
    placement: a torch_dist checkpoint permuted with it and the hooks installed from it give the
    logical model's loss; without the hooks the model differs."""
    assert job["export_group_preserving"] is False
    assert job["export_file_hook_loss_diff"] < 1e-6
    assert job["export_file_unhooked_loss_diff"] > 1e-6
