"""Live expert migration (placement.consumers.migrate) in multi-process CPU training on the stacks' own code.

Two gloo processes, EP = 2, 8 experts per MoE layer, two MoE layers (tests/stacks/migrate_jobs.py:
Megatron-Core 0.16.1 ``GPTModel`` + ``SequentialMLP`` + ``FP32Optimizer(Adam)``; TorchTitan 0.3.0
``MoE`` + ``GroupedExperts`` + ``AllToAllTokenDispatcher`` + ``torch.optim.Adam``).  Asserted:

- a run that migrates after step 2 gives the losses and the final parameters and Adam moments
  (by logical expert) of a run that never migrates, up to ``ATOL`` (float reordering in the combine);
- the replicas and bytes it moves are what :func:`placement.core.movecount.count_moves` (the solver's
  move report) counts for the same two maps, at this run's 12 bytes per parameter (FP32 weights,
  two FP32 moments: no separate master copy on CPU);
- a migration the ranks disagree on (different new maps) is refused on every rank, and one that
  fails on one rank after the transfer, before the switch, leaves every rank on the old map with
  unchanged state; training then continues exactly as the run that never migrates;
- a checkpoint saved after the migration (model, optimizer, the map entry) resumes identically.

- under Megatron-Core's ``DistributedOptimizer`` (4 processes, EP = 2 x expert-DP = 2, FP32 and
  BF16 model parameters; tests/stacks/migrate_dist_job.py), each expert's main-parameter and Adam
  shards reach the new slot's owners: migrating equals never migrating, exactly; the same job runs
  ``Float16OptimizerWithFloat16Params`` (BF16 weights, whole FP32 master copies).

A migration that skips the optimizer state fails these tests: run them with
``MIGRATE_SKIP_OPTIMIZER=1`` (docs/migration.md shows the failures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
ATOL = 2e-5  # losses are O(1..100); a skipped optimizer state moves them by O(1e-2)


def _run(stack: str, tmp_path: Path) -> list[dict]:
    from tests.stacks.tiny import free_port

    out = tmp_path / f"{stack}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.stacks.migrate_jobs", stack, str(r), str(WORLD), str(port),
                               str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=170)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{stack}: the migration job did not finish in 170 s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    worst = max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)
    assert worst <= ATOL, f"{what}: max |difference| {worst:.3g} > {ATOL}"


def _count(stack_layers: list[int], new_maps: dict) -> dict:
    """The solver's move report for identity -> new_maps on a 2-rank, 2-GPU, 2-domain instance."""
    from placement.core.model import Placement
    from placement.core.movecount import count_moves
    from solvers.default import default_rank2gpu
    from tests.conftest import random_instance

    inst = random_instance(np.random.default_rng(0), num_experts=8, top_k=2, ep=WORLD, dp=WORLD, pp=1,
                           num_domains=2, trays_per_domain=1, gpus_per_tray=1, moe_layers=len(stack_layers))
    r2g = default_rank2gpu(inst)
    old = Placement(r2g, np.tile(np.arange(8), (len(stack_layers), 1)))
    new = Placement(r2g, np.asarray([new_maps[str(k)] for k in stack_layers]))
    return count_moves(inst, old, new, bytes_per_replica=1.0).to_dict()


PARAMS_PER_EXPERT = {"megatron": 2 * 24 * 16 + 16 * 24, "torchtitan": 3 * 24 * 16}  # fc1 (GLU) + fc2; w1, w2, w3


@pytest.mark.parametrize("stack", ["megatron", "torchtitan"])
def test_migration_mid_training_equals_never_migrating(stack, tmp_path):
    if stack == "megatron":
        pytest.importorskip("megatron.core")
    else:
        pytest.importorskip("torchtitan")
        pytest.importorskip("triton")
    ranks = _run(stack, tmp_path)
    r0 = ranks[0]
    # the same losses and final state (by logical expert) as never migrating
    assert np.allclose(r0["moved_losses"], r0["base_losses"], rtol=0, atol=ATOL)
    _close(r0["moved_state"], r0["base_state"], "migrated vs never migrated")
    assert r0["moved_live_maps"] == r0["new_maps"] and r0["live_map_type"] == "InstalledMap"
    # what moved is what the solver's move report counts
    report = _count(r0["layers"], r0["new_maps"])
    for r in ranks:
        assert r["moved_report"]["moved_replicas_per_layer"] == {
            str(k): n for k, n in zip(r0["layers"], report["moved_replicas_per_layer"])}
    bytes_per_replica = PARAMS_PER_EXPERT[stack] * 12
    assert sum(r["moved_report"]["sent_bytes"] for r in ranks) == report["moved_replicas"] * bytes_per_replica
    assert sum(r["moved_report"]["received_bytes"] for r in ranks) == report["moved_replicas"] * bytes_per_replica
    assert sum(r["moved_report"]["bytes_by_kind"]["optimizer"] for r in ranks) == (
        report["moved_replicas"] * PARAMS_PER_EXPERT[stack] * 8)
    assert sum(r["moved_report"]["local_moves"] for r in ranks) > 0  # slots swapped on one rank too
    # interrupted before the switch: old map, state unchanged, training as if nothing happened
    for r in ranks:  # a refusal (the ranks' new maps differ), then a failure after the transfer
        assert "differ" in r["disagree_error"]
        assert "interrupted_error" in r and r["interrupted_unchanged_after_failure"]
    assert "injected" in ranks[1]["interrupted_error"]
    assert np.allclose(r0["interrupted_losses"], r0["base_losses"], rtol=0, atol=0)
    _close(r0["interrupted_state"], r0["base_state"], "interrupted vs never migrated")
    # resume from a checkpoint saved after the migration
    assert all(r["sidecar_equal"] for r in ranks)
    assert r0["resumed_losses"] == r0["continued_losses"]
    _close(r0["resumed_state"], r0["continued_state"], "resumed vs continued")
    if stack == "megatron":
        _check_controller(ranks)


def _check_controller(ranks: list[dict]) -> None:
    """The controller in the Megatron job (a cycle every 4 steps recording 2, payback bound 1e9): its
    first decision applies the solver's answer, and the migration moves what the answer's move
    report counts."""
    entries = [r["controller"]["entry"] for r in ranks]
    assert all(e is not None and e["decision"] == "applied" for e in entries), entries[0]
    solve, migration = entries[0]["solve"], entries[0]["migration"]
    assert solve["moved_replicas"] > 0 and solve["predicted_move_time_s"] > 0
    assert list(migration["moved_replicas_per_layer"].values()) == solve["moved_replicas_per_layer"]
    params = ranks[0]["controller"]["expert_params"]
    assert params == PARAMS_PER_EXPERT["megatron"]
    # the move report prices 14 bytes per parameter (BF16 weights + FP32 master + 2 moments); this
    # CPU run holds FP32 weights and 2 moments: 12
    assert solve["moved_bytes"] == solve["moved_replicas"] * params * 14
    sent = [r["controller"]["entry"]["migration"]["sent_bytes"] for r in ranks]
    assert sum(sent) == solve["moved_replicas"] * params * 12
    assert all(e["migration"]["measured_migration_s"] > 0 for e in entries)
    maps = ranks[0]["controller"]["live_maps"]
    assert maps == ranks[1]["controller"]["live_maps"] and maps != {k: list(range(8)) for k in maps}
    (line,) = ranks[0]["controller"]["log_lines"]
    assert json.loads(line) == entries[0] | {"migration": json.loads(line)["migration"]}



DIST_WORLD = 4  # EP = 2 x expert data parallel = 2
# bytes per parameter of a moved expert: weights (sent by each of the 2 expert-DP replicas), the
# FP32 main shard when apart from the weights, the two FP32 Adam moments (each shard sent once)
# (Float16OptimizerWithFloat16Params: whole master copies and moments on every replica, each moves its own)
DIST_BYTES = {"fp32": {"weights": 4 * 2, "optimizer": 8}, "bf16": {"weights": 2 * 2, "master": 4, "optimizer": 8},
              "bf16-float16opt": {"weights": 2 * 2, "master": 4 * 2, "optimizer": 8 * 2}}


@pytest.fixture(scope="module")
def dist_job(tmp_path_factory) -> list[dict]:
    pytest.importorskip("megatron.core")
    from tests.stacks.tiny import free_port

    out = tmp_path_factory.mktemp("migrate_dist") / "dist.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.stacks.migrate_dist_job", str(r), str(DIST_WORLD),
                               str(port), str(out), ",".join(DIST_BYTES)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for r in range(DIST_WORLD)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=170)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the distributed-optimizer migration job did not finish in 170 s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(DIST_WORLD)]


@pytest.mark.parametrize("dtype", list(DIST_BYTES))
def test_distributed_optimizer_shards_move_to_their_new_owners(dist_job, dtype):
    """Megatron-Core's ``DistributedOptimizer`` (tests/stacks/migrate_dist_job.py: 4 processes,
    EP = 2, expert-DP = 2, buckets whose DP halves cut through expert parameters; FP32 model
    parameters, and BF16 ones under ``Float16Module`` with FP32 main shards apart): a run that
    migrates after step 2 gives exactly the losses, weights, FP32 main parameters and Adam moments
    (whole, gathered from the shards, by logical expert) of one that never migrates; every moved
    expert's shards are sent once; a failure on one rank after the transfer leaves every rank's
    state and map unchanged, in both EP groups.  The same with Megatron's unsharded
    ``Float16OptimizerWithFloat16Params`` (``param.main_param``, ``bf16-float16opt``).  With ``MIGRATE_SKIP_OPTIMIZER=1`` the job moves the weights only and
    this test fails (docs/migration.md)."""
    ranks = [r[dtype] for r in dist_job]
    r0 = ranks[0]
    assert r0["expert_dp"] == 2
    if dtype != "bf16-float16opt":  # the buckets' DP halves cut through expert parameters
        assert any(len(layout) == 2 for layout in r0["layouts"]), r0["layouts"]
    assert not any(np.isnan(v).any() for v in r0["base_state"].values())  # every shard gathered
    kinds = {k.rsplit("/", 1)[-1] for k in r0["base_state"] if not k.startswith("dense/")}
    assert kinds == {"w", "main", "exp_avg", "exp_avg_sq"}
    assert np.allclose(r0["moved_losses"], r0["base_losses"], rtol=0, atol=ATOL)
    _close(r0["moved_state"], r0["base_state"], f"migrated vs never migrated ({dtype} distributed optimizer)")
    report = _count(r0["layers"], r0["new_maps"])
    params = PARAMS_PER_EXPERT["megatron"]
    for r in ranks:
        assert r["report"]["moved_replicas_per_layer"] == {
            str(k): n for k, n in zip(r0["layers"], report["moved_replicas_per_layer"])}
    sent = {kind: sum(r["report"]["bytes_by_kind"].get(kind, 0) for r in ranks)
            for kind in {k for r in ranks for k in r["report"]["bytes_by_kind"]}}
    assert sent == {kind: report["moved_replicas"] * params * b for kind, b in DIST_BYTES[dtype].items()}
    # interrupted after the transfer on one rank: refused everywhere, nothing changed
    assert all("interrupted_error" in r and r["interrupted_unchanged"] for r in ranks)
    assert "injected" in ranks[-1]["interrupted_error"]
    assert r0["interrupted_losses"] == r0["base_losses"]
    _close(r0["interrupted_state"], r0["base_state"], f"interrupted vs never migrated ({dtype} distributed optimizer)")
