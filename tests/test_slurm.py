"""placement cluster --from slurm against a real slurmctld.

The fixture starts Debian's slurmctld (package slurm-wlm; .ci/run installs it) with a generated
slurm.conf and topology.conf (``topology/tree``, one leaf switch per NVL72 rack: the Debian
version, 22.05, has no ``topology/block``; tests/test_discovery.py parses block texts in Slurm's
documented format).  Its 270 nodes (15 racks of 18 trays, ``Gres=gpu:4``) all point at
localhost, where no slurmd runs: the controller answers ``scontrol show topology`` and ``scontrol
show node``, every node is ``UNKNOWN+NOT_RESPONDING`` (set at once with ``scontrol update
state=NoResp``, as the controller's first ping would), and the trays that
instances/dsv3_1024_cluster.json lists as down are set DOWN, DRAIN or FAIL with ``scontrol
update``.  Authentication is ``auth/none`` (no munge daemon needed).
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import placement
from placement.cli import main
from placement.sources.discovery import expand_hostlist
from placement.consumers.hostfile import slurm_hostfile
from placement.formats.job import read_cluster
from tests.conftest import INSTANCES

SLURMCTLD = shutil.which("slurmctld") or ("/usr/sbin/slurmctld" if os.path.exists("/usr/sbin/slurmctld") else None)
SCONTROL = shutil.which("scontrol")
RACKS, TRAYS, GPUS = 15, 18, 4
HAND = json.loads((INSTANCES / "dsv3_1024_cluster.json").read_text())
DOWN_STATES = ("DOWN", "DRAIN", "FAIL")


def _host(d: int, t: int) -> str:
    return f"gb{d * TRAYS + t + 1:03d}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Slurm:
    conf: Path
    env: dict[str, str]

    def scontrol(self, *args: str) -> str:
        assert SCONTROL is not None
        run = subprocess.run([SCONTROL, *args], env=self.env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"scontrol {' '.join(args)}: {run.stderr}"
        return run.stdout


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if SLURMCTLD is None or SCONTROL is None:
        pytest.skip("slurmctld/scontrol not installed (Debian: apt-get install slurm-wlm; .ci/run installs it)")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    ctld_port, slurmd_port = _free_port(), _free_port()
    conf = d / "slurm.conf"
    conf.write_text(
        "ClusterName=placementtest\n"
        "SlurmctldHost=localhost\n"
        f"SlurmctldPort={ctld_port}\n"
        f"SlurmdPort={slurmd_port}\n"
        f"SlurmUser={getpass.getuser()}\n"
        "AuthType=auth/none\n"
        "CredType=cred/none\n"
        f"StateSaveLocation={d / 'state'}\n"
        f"SlurmdSpoolDir={d / 'spool'}\n"
        f"SlurmctldPidFile={d / 'slurmctld.pid'}\n"
        f"SlurmctldLogFile={d / 'slurmctld.log'}\n"
        "MailProg=/bin/true\n"
        "TopologyPlugin=topology/tree\n"
        "SelectType=select/cons_tres\n"
        "GresTypes=gpu\n"
        "ReturnToService=0\n"
        f"NodeName=gb[001-{RACKS * TRAYS:03d}] NodeHostname=localhost Gres=gpu:{GPUS} CPUs=4 State=UNKNOWN\n"
        "PartitionName=gpu Nodes=ALL Default=YES State=UP\n"
    )
    (d / "topology.conf").write_text(
        "".join(f"SwitchName=rack{r:02d} Nodes={_host(r, 0)[:2]}[{r * TRAYS + 1:03d}-{(r + 1) * TRAYS:03d}]\n" for r in range(RACKS))
        + f"SwitchName=spine Switches=rack[00-{RACKS - 1:02d}]\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    log = open(d / "slurmctld.out", "wb")
    proc = subprocess.Popen([SLURMCTLD, "-D", "-c", "-i", "-f", str(conf)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            run = subprocess.run([SCONTROL, "show", "topology"], env=env, capture_output=True, text=True, timeout=30)
            if run.returncode == 0 and "rack14" in run.stdout:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (d / "slurmctld.out").read_bytes()[-2000:].decode(errors="replace")
                pytest.fail(f"slurmctld did not answer (exit {proc.poll()}): {tail}")
            time.sleep(0.3)
        s = Slurm(conf, env)
        # Without slurmd the controller flags every node NOT_RESPONDING at its first ping (about
        # 15 s after start); setting the flag now makes the states the same whenever a test runs.
        s.scontrol("update", f"nodename=gb[001-{RACKS * TRAYS:03d}]", "state=NoResp")
        for i, (dom, tray) in enumerate(HAND["unavailable_trays"]):
            s.scontrol("update", f"nodename={_host(dom, tray)}", f"state={DOWN_STATES[i % 3]}", "reason=placement test")
        yield s
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _read(slurm, tmp_path, monkeypatch, *extra: str) -> dict:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    out = tmp_path / "slurm_cluster.json"
    assert main(["cluster", "--from", "slurm", "-o", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_states_set_by_scontrol_update_are_what_slurm_reports(slurm):
    text = slurm.scontrol("show", "node", _host(*HAND["unavailable_trays"][1]))
    assert "DRAIN" in text and "Gres=gpu:4" in text


def test_the_15_racks_read_from_slurm_are_the_hand_written_cluster(slurm, tmp_path, monkeypatch, capsys):
    doc = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding", "--name", "dsv3_1024_cluster")
    assert "14 hosts down, 1024 GPUs usable" in capsys.readouterr().out
    for key in ("num_domains", "trays_per_domain", "gpus_per_tray", "unavailable_gpus", "unavailable_trays",
                "nvlink_gbps", "scaleout_gbps", "gpu_hbm_gb"):
        assert doc[key] == HAND[key], key
    assert doc["domain_names"] == [f"rack{r:02d}" for r in range(RACKS)]
    assert doc["hosts"] == [[_host(r, t) for t in range(TRAYS)] for r in range(RACKS)]
    spec = read_cluster(tmp_path / "slurm_cluster.json")
    hand = read_cluster(INSTANCES / "dsv3_1024_cluster.json")
    assert np.array_equal(spec.cluster.available, hand.cluster.available)


def test_without_slurmd_every_node_is_not_responding(slurm, tmp_path, monkeypatch, capsys):
    doc = _read(slurm, tmp_path, monkeypatch)
    assert "270 hosts down, 0 GPUs usable" in capsys.readouterr().out
    assert len(doc["unavailable_trays"]) == RACKS * TRAYS


def test_saved_scontrol_outputs_give_the_same_file(slurm, tmp_path, monkeypatch, capsys):
    live = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding")
    (tmp_path / "topology.txt").write_text(slurm.scontrol("show", "topology"))
    (tmp_path / "nodes.txt").write_text(slurm.scontrol("show", "node"))
    out = tmp_path / "saved.json"
    assert main(["cluster", "--from", "slurm", str(tmp_path / "topology.txt"), str(tmp_path / "nodes.txt"),
                 "--allow-not-responding", "-o", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert {k: v for k, v in saved.items() if k != "description"} == {k: v for k, v in live.items() if k != "description"}
    # one-line records (scontrol -o) parse the same
    (tmp_path / "nodes1.txt").write_text(slurm.scontrol("-o", "show", "node"))
    assert main(["cluster", "--from", "slurm", str(tmp_path / "topology.txt"), str(tmp_path / "nodes1.txt"),
                 "--allow-not-responding", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["unavailable_trays"] == HAND["unavailable_trays"]
    capsys.readouterr()


def test_truncated_scontrol_output_exits_2_naming_the_node(slurm, tmp_path, capsys):
    nodes = slurm.scontrol("show", "node")
    cut = nodes[: nodes.index("State=", nodes.index("NodeName=gb200 "))]
    (tmp_path / "topology.txt").write_text(slurm.scontrol("show", "topology"))
    (tmp_path / "nodes.txt").write_text(cut)
    assert main(["cluster", "--from", "slurm", str(tmp_path / "topology.txt"), str(tmp_path / "nodes.txt"),
                 "-o", str(tmp_path / "c.json")]) == 2
    assert "gb200" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["gb[001-018,025]", "gb[001-003],gb[100-101]", "gb001,gb[010-012]"])
def test_host_lists_expand_as_slurm_expands_them(slurm, text):
    assert expand_hostlist(text) == slurm.scontrol("show", "hostnames", text).split()
    compressed = slurm.scontrol("show", "hostlist", ",".join(expand_hostlist(text))).strip()
    assert expand_hostlist(compressed) == expand_hostlist(text)


def test_slurm_cluster_solves_to_the_hand_written_placement_but_for_host_names(slurm, tmp_path, monkeypatch, capsys):
    """dsv3_1024 (15 racks, 14 trays down) on the cluster read from slurmctld: the same placement as
    on the instance's own hand-written cluster section; its hostfile names the Slurm hosts.

    The ``default`` solver (the default layout on the available GPUs): any tray read wrongly moves
    ranks.  The searching solvers are deterministic only while the machine's load lets their work
    budget finish inside the wall-clock limit (tests/test_determinism_under_load.py); on the shared
    build machine (load 10 on 2 cores) two kahypar solves of the same instance differed.
    """
    doc = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding")
    capsys.readouterr()
    from placement.formats.job import cluster_spec_from_document

    hand = placement.load_instance(INSTANCES / "dsv3_1024.json")
    from_slurm = dataclasses.replace(hand, cluster=cluster_spec_from_document(doc, tmp_path / "c.json").cluster)
    a = placement.solve(hand, solver="default", time_limit_s=30, seed=0)
    b = placement.solve(from_slurm, solver="default", time_limit_s=30, seed=0)
    assert np.array_equal(a.placement.rank2gpu, b.placement.rank2gpu)
    assert np.array_equal(a.placement.phy2log, b.placement.phy2log)
    assert a.metrics["heldout_cross_domain_bytes_per_step"] == b.metrics["heldout_cross_domain_bytes_per_step"]
    hosts_hand = slurm_hostfile(hand, a.placement.rank2gpu).split()
    hosts_slurm = slurm_hostfile(from_slurm, b.placement.rank2gpu).split()
    assert hosts_hand[0].startswith("rack") and hosts_slurm[0].startswith("gb")
    assert hosts_slurm == [_host(int(h) // TRAYS, int(h) % TRAYS) for h in hand.cluster.gpu2host[a.placement.rank2gpu]]


def test_solve_for_an_allocation_of_the_slurm_cluster(slurm, tmp_path, monkeypatch, capsys):
    """A cluster file from slurmctld, an instance on it, a solve for a Slurm host list: the
    hostfile names only allocated hosts; an unknown host exits 2, too few GPUs exit 3."""
    doc = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding")
    inst = json.loads((INSTANCES / "tiny.json").read_text())
    # tiny's job (16 ranks) on 2 of the Slurm racks' trays: hosts gb001-gb018 and gb019-gb036 of 2 GPUs... use 4
    inst["cluster"] = {k: doc[k] for k in ("num_domains", "trays_per_domain", "gpus_per_tray", "nvlink_gbps",
                                          "scaleout_gbps", "unavailable_gpus", "unavailable_trays", "hosts", "domain_names")}
    shutil.copy(INSTANCES / "tiny.npz", tmp_path / "tiny.npz")
    (tmp_path / "tiny.json").write_text(json.dumps(inst))
    nodelist = slurm.scontrol("show", "hostlist", "gb001,gb002,gb040,gb041").strip()  # Slurm's own compression
    out = tmp_path / "p.json"
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    assert main(["solve", str(tmp_path / "tiny.json"), "--solver", "default", "--allocation", "slurm", "-o", str(out)]) == 0
    assert main(["export", str(out), "--format", "slurm", "--instance", str(tmp_path / "tiny.json"),
                 "-o", str(tmp_path / "job.hosts")]) == 0
    assert set((tmp_path / "job.hosts").read_text().split()) == {"gb001", "gb002", "gb040", "gb041"}
    assert main(["solve", str(tmp_path / "tiny.json"), "--solver", "default", "--allocation", "gb[001-002,040],gb999"]) == 2
    assert "gb999" in capsys.readouterr().err
    down = _host(*HAND["unavailable_trays"][0])  # allocated but down in Slurm: 12 GPUs for 16 ranks
    assert main(["solve", str(tmp_path / "tiny.json"), "--solver", "default", "--allocation", f"gb[001-002],gb040,{down}"]) == 3


def test_a_maintenance_reservation_prints_maintenance_and_downs_the_tray(slurm, tmp_path, monkeypatch, capsys):
    """What this Slurm prints for a node in a maintenance reservation: scontrol ``MAINTENANCE`` (a
    state flag), sinfo's short state ``maint``; the tray is down."""
    host = _host(RACKS - 1, TRAYS - 1)  # usable in the hand-written cluster
    assert [RACKS - 1, TRAYS - 1] not in HAND["unavailable_trays"]
    slurm.scontrol("create", "reservation", "ReservationName=placement_maint", "StartTime=now", "Duration=60",
                   f"Nodes={host}", f"Users={getpass.getuser()}", "Flags=maint,ignore_jobs")
    try:
        # the controller sets the flag on its next pass over the reservations (about 8 s here)
        deadline = time.monotonic() + 150
        while True:
            state = next(w for w in slurm.scontrol("show", "node", host).split() if w.startswith("State="))
            if "MAINT" in state or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert "+MAINTENANCE" in state and "MAINT+" not in state.replace("MAINTENANCE", ""), state
        sinfo = shutil.which("sinfo")
        if sinfo is not None:
            run = subprocess.run([sinfo, "-h", "-n", host, "-o", "%t"], env=slurm.env, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0 and run.stdout.strip().rstrip("*~#!%$@^-") == "maint", run.stdout + run.stderr
        doc = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding")
        assert [RACKS - 1, TRAYS - 1] in doc["unavailable_trays"] and "15 hosts down" in capsys.readouterr().out
    finally:
        slurm.scontrol("delete", "reservation", "placement_maint")


def test_a_node_with_fewer_gpus_keeps_them(slurm, tmp_path, monkeypatch, capsys):
    """Gres=gpu:2 on one node of the live controller (scontrol update): only its 2 missing GPUs are
    down, the highest local indices, with one warning line; the rest of the file is unchanged."""
    d, t = RACKS - 1, TRAYS - 2
    host = _host(d, t)
    assert [d, t] not in HAND["unavailable_trays"]
    slurm.scontrol("update", f"nodename={host}", "gres=gpu:2")
    try:
        assert "Gres=gpu:2" in slurm.scontrol("show", "node", host)
        doc = _read(slurm, tmp_path, monkeypatch, "--allow-not-responding")
        cap = capsys.readouterr()
        base = (d * TRAYS + t) * GPUS
        assert doc["unavailable_gpus"] == [base + 2, base + 3] and doc["unavailable_trays"] == HAND["unavailable_trays"]
        assert "2 more GPUs down on 1 hosts, 1022 GPUs usable" in cap.out
        assert cap.err.count("placement: warning: unusable:") == 1 and f"host {host}: GPU 2, 3 of 4 unusable" in cap.err
    finally:
        slurm.scontrol("update", f"nodename={host}", f"gres=gpu:{GPUS}")
