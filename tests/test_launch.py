"""The Slurm launcher, run in a real ``sh`` under a fake ``srun`` environment, for every rank."""

from __future__ import annotations

import os
import shlex
import subprocess
import warnings

import numpy as np
import pytest

from placement.consumers import export as ex
from placement import launch
from placement.cli import main
from placement.formats import placement_document, write_placement
from placement.core.model import Placement
from solvers.default import default_placement
from tests.conftest import INSTANCES

TINY = INSTANCES / "tiny.json"


def write_launch(tmp_path, inst, r2g) -> tuple:
    """Export ``r2g`` as ``slurm`` through the library; return (hostfile path, launcher path)."""
    p = Placement(r2g, default_placement(inst).phy2log)
    ppath = tmp_path / "p.json"
    write_placement(ppath, placement_document(inst, p, solver="test"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ex.LaunchWarning)
        files = ex.export_file("slurm", ppath, tmp_path / "job.hosts", TINY)
    assert set(files) == {tmp_path / "job.hosts", tmp_path / "job.gpus", tmp_path / "job.launch.sh"}
    return tmp_path / "job.hosts", tmp_path / "job.launch.sh"


def fake_bin(tmp_path, host: str | None = None) -> str:
    """A PATH folder with a fake ``hostname`` (printing ``host``) and a fake ``torchrun`` that prints
    its arguments and the CUDA_VISIBLE_DEVICES it was given, one per line."""
    d = tmp_path / f"bin-{host}"
    d.mkdir(exist_ok=True)
    if host is not None:
        (d / "hostname").write_text(f"#!/bin/sh\necho {host}\n")
    (d / "torchrun").write_text('#!/bin/sh\necho "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"\nfor a in "$@"; do echo "$a"; done\n')
    for f in d.iterdir():
        f.chmod(0o755)
    return f"{d}{os.pathsep}{os.environ['PATH']}"


def run_task(launcher, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(launcher), *args], env=env, capture_output=True, text=True, timeout=60)


def slurm_env(hosts: list[str], rank: int, path: str, with_nodename: bool = True) -> dict[str, str]:
    """What srun --distribution=arbitrary gives task ``rank``: its host, its local id (order of the
    host's tasks by global rank) and node id (order of first appearance in the hostfile)."""
    nodes = list(dict.fromkeys(hosts))
    env = {
        "PATH": path,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(hosts[:rank].count(hosts[rank])),
        "SLURM_NODEID": str(nodes.index(hosts[rank])),
        "SLURM_NTASKS": str(len(hosts)),
    }
    if with_nodename:
        env["SLURMD_NODENAME"] = hosts[rank]
    return env


def scattered_rank2gpu(inst, seed: int) -> np.ndarray:
    """A layout with non-contiguous ranks per host and hosts that run fewer ranks than GPUs."""
    rng = np.random.default_rng(seed)
    return rng.permutation(inst.cluster.available_gpus)[: inst.parallel.world_size]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_rank_gets_its_variables_and_gpu_under_srun(tmp_path, tiny, seed):
    r2g = scattered_rank2gpu(tiny, seed)
    hostfile, launcher = write_launch(tmp_path, tiny, r2g)
    hosts = ex.parse_slurm_hostfile(hostfile.read_text())
    cl = tiny.cluster
    host_id = {cl.host_name(h): h for h in range(cl.num_domains * cl.trays_per_domain)}
    names = list(launch.LAUNCH_VARIABLES) + ["PLACEMENT_MEGATRON_ARGS"]
    printer = " && ".join(f'echo "{n}=${n}"' for n in names)
    for rank in range(tiny.parallel.world_size):
        # every other rank without SLURMD_NODENAME: the launcher falls back to hostname
        env = slurm_env(hosts, rank, fake_bin(tmp_path, hosts[rank]), with_nodename=rank % 2 == 0)
        out = run_task(launcher, env, "srun", "sh", "-c", printer)
        assert out.returncode == 0, out.stderr
        got = dict(line.split("=", 1) for line in out.stdout.splitlines())
        want = launch.rank_environment(tiny, r2g, rank)
        assert {k: got[k] for k in launch.LAUNCH_VARIABLES} == want
        # the contract, checked from the placement itself:
        assert got["RANK"] == str(rank) and got["WORLD_SIZE"] == str(len(r2g))
        assert got["LOCAL_RANK"] == env["SLURM_LOCALID"]  # Slurm's own local id agrees
        assert got["LOCAL_WORLD_SIZE"] == str(hosts.count(hosts[rank]))
        assert got["MASTER_ADDR"] == cl.host_name(int(cl.gpu2host[r2g[0]])) and got["MASTER_PORT"] == "29500"
        visible = [int(x) for x in got["CUDA_VISIBLE_DEVICES"].split(",")]
        gpu = host_id[hosts[rank]] * cl.gpus_per_tray + visible[int(got["LOCAL_RANK"])]
        assert gpu == r2g[rank]  # local rank j takes visible device j: the placement's GPU
        assert "--expert-tensor-parallel-size 1" in got["PLACEMENT_MEGATRON_ARGS"]


def test_master_port_is_kept_and_wrong_hosts_are_refused(tmp_path, tiny):
    r2g = scattered_rank2gpu(tiny, 2)
    hostfile, launcher = write_launch(tmp_path, tiny, r2g)
    hosts = ex.parse_slurm_hostfile(hostfile.read_text())
    env = {**slurm_env(hosts, 3, fake_bin(tmp_path)), "MASTER_PORT": "31337"}
    out = run_task(launcher, env, "srun", "sh", "-c", 'echo "$MASTER_PORT"')
    assert out.returncode == 0 and out.stdout.strip() == "31337"
    other = next(h for h in hosts if h != hosts[3])
    out = run_task(launcher, {**env, "SLURMD_NODENAME": other}, "srun", "true")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "the placement puts it on" in out.stderr
    out = run_task(launcher, {**env, "SLURM_NTASKS": "3"}, "srun", "true")
    assert out.returncode == 2 and "SLURM_NTASKS" in out.stderr
    out = run_task(launcher, {**env, "SLURMD_NODENAME": "rack03-tray01"}, "srun", "true")  # a tray that is down
    assert out.returncode == 2 and "runs no rank" in out.stderr


def torchrun_ranks(nodes: list[tuple[str, int, str]]) -> dict[str, list[int]]:
    """Global ranks torchrun gives each node: the cumulative sum of the local world sizes of the
    nodes with lower node rank (torch/distributed/elastic/agent/server/api.py, _assign_worker_ranks)."""
    out, base = {}, 0
    for host, nproc, _ in nodes:
        out[host] = list(range(base, base + nproc))
        base += nproc
    return out


def test_torchrun_mode_where_the_layout_allows_it(tmp_path, tiny):
    r2g = default_placement(tiny).rank2gpu.copy()
    assert launch.torchrun_problem(tiny, r2g) is None
    hostfile, launcher = write_launch(tmp_path, tiny, r2g)
    cl = tiny.cluster
    host_id = {cl.host_name(h): h for h in range(cl.num_domains * cl.trays_per_domain)}
    hosts = sorted(set(ex.parse_slurm_hostfile(hostfile.read_text())))
    per_node: dict[int, tuple[str, int, str]] = {}
    for host in hosts:
        env = {"PATH": fake_bin(tmp_path), "SLURMD_NODENAME": host, "SLURM_PROCID": "0"}
        out = run_task(launcher, env, "torchrun", "train.py", "--x")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        visible = lines[0].split("=", 1)[1]
        args = dict(a.split("=", 1) for a in lines[1:] if a.startswith("--") and "=" in a)
        assert lines[-2:] == ["train.py", "--x"] and args["--rdzv-backend"] == "static"
        assert args["--nnodes"] == str(len(hosts)) and args["--master-addr"] == cl.host_name(int(cl.gpu2host[r2g[0]]))
        per_node[int(args["--node-rank"])] = (host, int(args["--nproc-per-node"]), visible)
    assert sorted(per_node) == list(range(len(hosts)))
    for host, ranks in torchrun_ranks([per_node[n] for n in sorted(per_node)]).items():
        visible = [int(x) for x in per_node[[n for n in per_node if per_node[n][0] == host][0]][2].split(",")]
        for local, rank in enumerate(ranks):
            assert host_id[host] * cl.gpus_per_tray + visible[local] == r2g[rank]


def test_torchrun_refused_with_the_reason_when_hosts_hold_non_contiguous_ranks(tmp_path, tiny, capsys):
    r2g = default_placement(tiny).rank2gpu.copy()
    r2g[[1, 2]] = r2g[[2, 1]]  # host 0 now runs ranks 0 and 2, host 1 ranks 1 and 3
    problem = launch.torchrun_problem(tiny, r2g)
    assert problem is not None and "ranks 0, 2" in problem and "\n" not in problem
    hostfile, launcher = write_launch(tmp_path, tiny, r2g)
    host = ex.parse_slurm_hostfile(hostfile.read_text())[0]
    out = run_task(launcher, {"PATH": fake_bin(tmp_path), "SLURMD_NODENAME": host}, "torchrun", "train.py")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "torchrun cannot launch" in out.stderr
    # the export says so too: a LaunchWarning from the library, one warning line from the CLI
    ppath = tmp_path / "p.json"
    with pytest.warns(ex.LaunchWarning, match="torchrun cannot launch"):
        ex.export_file("slurm", ppath, tmp_path / "again.hosts", TINY)
    assert main(["export", str(ppath), "--format", "slurm", "-o", str(tmp_path / "cli.hosts"), "--instance", str(TINY)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("placement: warning: slurm: torchrun cannot launch")
    assert os.access(tmp_path / "cli.launch.sh", os.X_OK)


def test_megatron_and_torchtitan_arguments(tiny):
    args, note = launch.megatron_args(tiny)
    assert note is None
    flags = dict(zip(args[::2], args[1::2]))
    p = tiny.parallel
    assert flags == {
        "--tensor-model-parallel-size": str(p.tp),
        "--context-parallel-size": str(p.cp),
        "--pipeline-model-parallel-size": str(p.pp),
        "--expert-model-parallel-size": str(p.ep),
        "--expert-tensor-parallel-size": "1",
    }
    titan, why = launch.torchtitan_args(tiny)
    assert why is None and f"--parallelism.expert_parallel_degree={p.ep}" in titan
    from dataclasses import replace

    other = replace(tiny, parallel=replace(tiny.parallel, order="tp-cp-ep-pp-dp"))
    args, note = launch.megatron_args(other)
    assert note is None and args[-1] == "--use-tp-pp-dp-mapping"
    assert launch.torchtitan_args(other)[0] is None
    odd = replace(tiny, parallel=replace(tiny.parallel, order="tp-dp-cp-ep-pp"))
    assert launch.megatron_args(odd)[1] is not None and "initialize_model_parallel" in launch.megatron_args(odd)[1]


def test_launcher_is_deterministic_and_quotes_safely(tmp_path, tiny):
    r2g = scattered_rank2gpu(tiny, 3)
    a = launch.launcher_script(tiny, r2g, "job.hosts")
    assert a == launch.launcher_script(tiny, r2g, "job.hosts")
    for line in a.splitlines():
        if line.startswith("_pl_") and "=" in line and "(" not in line:
            shlex.split(line)  # every table line is valid shell words
    assert launch.launcher_path(tmp_path / "job.hosts") == tmp_path / "job.launch.sh"
    assert launch.launcher_path(tmp_path / "hosts") == tmp_path / "hosts.launch.sh"


# ---------------------------------------------------------------------------------------------
# The expert-tensor-parallel size: a layout field, refused by the reader and the verifier
# ---------------------------------------------------------------------------------------------
def copy_tiny_with(tmp_path, **parallel) -> str:
    import json
    import shutil

    doc = json.loads(TINY.read_text())
    doc["parallel"].update(parallel)
    shutil.copy(INSTANCES / doc["routing"]["file"], tmp_path / doc["routing"]["file"])
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_etp_field_read_and_unsupported_values_refused(tmp_path, tiny, capsys):
    from placement.formats import read_instance

    assert tiny.parallel.etp == 1  # absent means 1
    assert read_instance(copy_tiny_with(tmp_path, etp=1)).parallel.etp == 1
    bad = copy_tiny_with(tmp_path, etp=2)
    assert main(["evaluate", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.etp" in err and "--expert-tensor-parallel-size 1" in err


def test_verifier_flags_an_unsupported_etp(tiny):
    from dataclasses import replace

    from placement.predict.report import report
    from placement.app.verify import verify_document

    p = default_placement(tiny)
    doc = placement_document(tiny, p, solver="test", metrics=report(tiny, p))
    assert verify_document(tiny, p, doc).valid
    etp2 = replace(tiny, parallel=replace(tiny.parallel, etp=2))
    rep = verify_document(etp2, p, doc)
    assert [v for v in rep.violations if v.startswith("parallel.etp")] and rep.metrics is None
    assert "etp" in rep.checks


def test_solve_refuses_an_unsupported_etp_built_in_memory(tiny):
    from dataclasses import replace

    import placement as api
    from placement.core.model import InvalidInputError

    with pytest.raises(InvalidInputError, match="parallel.etp"):
        api.solve(replace(tiny, parallel=replace(tiny.parallel, etp=2)), solver="default", time_limit_s=5)
