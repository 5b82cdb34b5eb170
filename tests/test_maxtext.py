"""The MaxText export round-trips through a JAX mesh built from it, on CPU devices.

JAX needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before it is imported, so the JAX
part runs in a fresh interpreter (another test may have imported JAX with one device already).
Skipped only when JAX is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from placement.consumers import export as ex
from placement.consumers.maxtext import MAXTEXT_MESH_AXES, maxtext_export
from placement.core.model import InfeasibleError, Placement
from tests.conftest import random_instance

# Build the mesh exactly as the export says (jax.sharding.Mesh over the row-major device order),
# then check every rank's mesh coordinates and the expert slots jax puts on its device.
JAX_CHECK = r"""
import json, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

def check(doc, truth):
  cpus = jax.devices()
  assert len(cpus) == len(doc["devices"]), (len(cpus), len(doc["devices"]))
  # One JAX process per host with its visible GPUs, devices numbered process-major: emulate each
  # process's local devices with consecutive CPU devices.
  base, local_devices = 0, {}
  for proc in doc["processes"]:
      k = len(proc["cuda_visible_devices"].split(","))
      local_devices[proc["process_index"]] = cpus[base:base + k]
      base += k
  order = [local_devices[p][l] for p, l in doc["devices"]]
  mesh = Mesh(np.array(order, dtype=object).reshape(doc["mesh_shape"]), tuple(doc["mesh_axes"]))
  axes = list(mesh.axis_names)
  proc_of_host = {p["host"]: p for p in doc["processes"]}
  device_of_rank = {}
  for rank, (host, local_gpu) in enumerate(truth["rank_host_gpu"]):
      proc = proc_of_host[host]
      j = [int(x) for x in proc["cuda_visible_devices"].split(",")].index(local_gpu)
      dev = local_devices[proc["process_index"]][j]
      device_of_rank[rank] = dev
      (coord,) = np.argwhere(mesh.devices == dev)
      got = {a: int(c) for a, c in zip(axes, coord)}
      stage, group, ep_rank = truth["rank_coords"][rank]
      assert (got["stage"], got["data"], got["expert"]) == (stage, group, ep_rank), (rank, got, truth["rank_coords"][rank])
      assert all(v == 0 for a, v in got.items() if a not in ("stage", "data", "expert"))
  # MaxText shards the expert axis of wi_0 / wi_1 / wo over the 'expert' mesh axis ('exp' -> 'expert'):
  # the device of EP rank e must hold physical slots e*E/ep ... (e+1)*E/ep - 1.
  E, ep = doc["experts"]["num_experts"], doc["experts"]["ep"]
  slots = jax.device_put(np.arange(E), NamedSharding(mesh, PartitionSpec("expert")))
  rank_of_device = {d: r for r, d in device_of_rank.items()}
  for shard in slots.addressable_shards:
      stage, group, ep_rank = truth["rank_coords"][rank_of_device[shard.device]]
      assert np.asarray(shard.data).tolist() == list(range(ep_rank * E // ep, (ep_rank + 1) * E // ep))
  return len(device_of_rank)

args = sys.argv[1:]
# each pair: the export, and the truth computed from the placement (not from the export)
print("ok", *[check(json.load(open(a)), json.load(open(b))) for a, b in zip(args[::2], args[1::2])])
"""


def maxtext_instance(seed: int = 3, **kw):
    # world 8 = 2 stages x one EP group of 4; 12 GPUs on 6 hosts of 2
    args = {"ep": 4, "dp": 4, "pp": 2, "num_domains": 3, "trays_per_domain": 2, "gpus_per_tray": 2, **kw}
    return random_instance(np.random.default_rng(seed), **args)


def truth_of(inst, p) -> dict:
    cl, par = inst.cluster, inst.parallel
    coords = [None] * par.world_size
    for s in range(par.pp):
        for g, ranks in enumerate(par.stage_ep_groups[s]):
            for e, r in enumerate(ranks):
                coords[int(r)] = [s, g, e]
    return {
        "rank_host_gpu": [[cl.host_name(int(cl.gpu2host[g])), int(g) % cl.gpus_per_tray] for g in p.rank2gpu],
        "rank_coords": coords,
    }


def test_maxtext_mesh_round_trips_through_jax(tmp_path):
    pytest.importorskip("jax")
    args = []
    for seed in range(4):
        inst = maxtext_instance(seed=seed, dp=4 * (1 + seed % 2), ep=4 * (1 + seed % 2) // (1 + seed // 2),
                                pp=2 // (1 + seed % 2))
        rng = np.random.default_rng(seed)
        r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]  # scattered over hosts
        p = Placement(r2g, np.stack([rng.permutation(8) for _ in range(inst.model.num_moe_layers)]))
        doc = json.loads(ex.export_text("maxtext", p, inst))
        assert doc["mesh_axes"] == list(MAXTEXT_MESH_AXES) and int(np.prod(doc["mesh_shape"])) == 8
        (tmp_path / f"mt{seed}.json").write_text(json.dumps(doc))
        (tmp_path / f"truth{seed}.json").write_text(json.dumps(truth_of(inst, p)))
        args += [str(tmp_path / f"mt{seed}.json"), str(tmp_path / f"truth{seed}.json")]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", JAX_CHECK, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "8", "8", "8", "8"]


def test_maxtext_expert_section_and_device_order():
    inst = maxtext_instance()
    rng = np.random.default_rng(5)
    p = Placement(np.arange(8), np.stack([rng.permutation(8) for _ in range(inst.model.num_moe_layers)]))
    doc = maxtext_export(inst, p)
    ex_ = doc["experts"]
    assert {t["path"].rsplit("/", 1)[-1]: (t["expert_axis"], t["layer_axis"]) for t in ex_["tensors"]} == {
        "wi_0": (0, 1), "wi_1": (0, 1), "wo": (0, 1), "kernel": (2, 1), "bias": (0, 1)
    }
    assert [ex_["layers"][str(i)] for i in range(inst.model.num_moe_layers)] == p.phy2log.tolist()
    # ranks 0..7 on GPUs 0..7: hosts hold consecutive ranks, so the order is process-major
    assert doc["device_order_is_process_major"] and doc["devices"][:3] == [[0, 0], [0, 1], [1, 0]]
    assert doc["ici_parallelism"]["ici_expert_parallelism"] == 4 and doc["ici_parallelism"]["ici_fsdp_parallelism"] == 1
    rev = Placement(np.arange(8)[::-1].copy(), p.phy2log)  # hosts still hold consecutive positions
    assert maxtext_export(inst, rev)["device_order_is_process_major"]
    assert maxtext_export(inst, rev)["processes"][0]["cuda_visible_devices"] == "1,0"
    mixed = Placement(np.array([0, 2, 1, 3, 4, 5, 6, 7]), p.phy2log)  # host 0 holds positions 0 and 2
    assert not maxtext_export(inst, mixed)["device_order_is_process_major"]
    # applying a layer's permutation to an (E, L, ...) tensor as the direction says keeps expert identity
    w = rng.normal(size=(8, inst.model.num_moe_layers, 3))
    perm = np.array(ex_["layers"]["1"])
    new = w.copy()
    new[:, 1] = w[perm, 1]
    for slot in range(8):
        np.testing.assert_array_equal(new[slot, 1], w[perm[slot], 1])


def test_maxtext_refusals_exit_3(tmp_path):
    inst = maxtext_instance(tp=2, dp=2)
    p = Placement(np.arange(8), np.tile(np.arange(8), (inst.model.num_moe_layers, 1)))
    with pytest.raises(InfeasibleError, match="tp=2"):
        maxtext_export(inst, p)
    grouped = maxtext_instance(num_groups=4, groups_per_token=2)
    breaking = Placement(np.arange(8), np.tile([1, 2, 0, 3, 4, 5, 6, 7], (grouped.model.num_moe_layers, 1)))
    with pytest.raises(InfeasibleError, match="keep groups whole") as refused:
        maxtext_export(grouped, breaking)
    # the advice is the setting that exists (--group-preserving is deprecated), and it works
    assert "solve with --apply checkpoint" in str(refused.value) and "--group-preserving" not in str(refused.value)
    import placement

    solved = placement.solve(grouped, apply="checkpoint", time_limit_s=10)
    assert maxtext_export(grouped, solved.placement)["experts"]
    from dataclasses import replace

    interleaved = replace(inst, model=replace(inst.model, num_layers=4, moe_layers=(0, 1, 3)))
    interleaved = replace(interleaved, parallel=replace(maxtext_instance().parallel, stage_layers=((0, 1), (2, 3))))
    with pytest.raises(InfeasibleError, match="last 3 layers"):
        maxtext_export(interleaved, p)
