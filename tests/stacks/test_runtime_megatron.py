"""The live expert map on Megatron-Core 0.16.1's own code over 4 CPU processes (gloo).

``tests/stacks/megatron_ep_job.py`` (one child process, forked into 4 ranks, hard timeout):

- TP1 PP1 EP4 DP4 with the ``alltoall`` dispatcher: the placed model (the global expert set
  permuted in memory by ``apply_permutation(..., keep_router=True)`` with a group-breaking map, cut
  into EP ranks, plus the hooks) gives every rank the unplaced model's loss and gradients (expert
  gradients gathered over EP and permuted); the aux-loss-free counters stay logical; the project's
  recorder, registered after the map, sees logical ids; the hooks build no tensor from Python data.
- TP1 PP2 VPP2 EP2 DP2: the map installed on each rank's list of model chunks finds its layers by
  Megatron's global layer numbers (PP rank 0 holds layers 0 and 2, rank 1 layers 1 and 3).
- MTP (``mtp_num_layers=1`` with its own MoE, model layer 2) over EP4: the MTP layer's experts and
  gradients follow its own map, with 0.16.1's inner layer numbering (``num_layers + j + 1``) and
  with core_v0.19.0's (``layer_number = 1``, multi_token_prediction.py / transformer_layer.py).
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

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6  # float32 on CPU: the placed and unplaced runs do the same arithmetic per token


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("megatron_ep")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "tests.stacks.megatron_ep_job", str(out)], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=300,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the 4-process Megatron-Core job did not finish in 300 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _no_error(ranks: list[dict], part: str) -> None:
    errors = [r[f"{part}_error"] for r in ranks if f"{part}_error" in r]
    assert not errors, errors[0]


def test_alltoall_ep4_placed_model_gives_the_unplaced_losses_and_gradients(ranks):
    _no_error(ranks, "part1")
    assert sorted(r["ep_rank"] for r in ranks) == [0, 1, 2, 3]
    assert len({round(r["loss"], 6) for r in ranks}) == 4  # each rank ran its own batch
    for r in ranks:
        assert r["installed_layers"] == [0, 1]
        assert r["loss_diff"] < TOL and r["dense_grad_max_diff"] < TOL and r["expert_grad_max_diff"] < TOL
        assert r["expert_grad_keys"] == 32 and r["expert_grads_nonzero"] >= 16
        assert r["counts_equal"]  # aux-loss-free counters stay logical
    assert max(r["unhooked_loss_diff"] for r in ranks) > 1e-5  # without the map the placed model differs


def test_the_hooks_build_no_tensor_from_python_data_and_the_recorder_sees_logical_ids(ranks):
    _no_error(ranks, "part1")
    for r in ranks:
        assert r["host_tensor_calls"] == []
        assert r["recorded_logical"]


def test_vpp_chunk_lists_are_mapped_by_global_layer_number(ranks):
    _no_error(ranks, "part2")
    for r in ranks:
        want = [0, 2] if r["pp_rank"] == 0 else [1, 3]
        assert r["vpp_installed_layers"] == want
        assert r["vpp_route_matches"] == {str(layer): True for layer in want}


@pytest.mark.parametrize("numbering", ["0.16.1", "core_v0.19.0"])
def test_the_mtp_moe_layer_is_mapped_by_its_true_position(ranks, numbering):
    _no_error(ranks, "part3")
    for r in ranks:
        got = r["mtp"][numbering]
        assert got["installed_layers"] == [0, 1, 2]
        assert got["dense_grad_max_diff"] < TOL and got["expert_grad_max_diff"] < TOL
        assert got["mtp_dense_grads"] > 0 and got["mtp_expert_grads_nonzero"] > 0
