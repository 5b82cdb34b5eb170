"""placement cluster: Slurm, Kubernetes and nvidia-smi texts in their documented formats, real host
names through the instance into hostfiles and launch scripts, solving for an allocation.

The texts follow the formats of Slurm's scontrol(1) / topology.conf(5) (``topology/block``:
``BlockName=... BlockIndex=... Nodes=... BlockSize=...``, Slurm 23.11+; the Debian Slurm the live
tests run, 22.05, lacks that plugin), NVIDIA GPU feature discovery's node labels and the
``Fabric`` section of ``nvidia-smi -q``.  tests/test_slurm.py runs a real slurmctld.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement
from placement.cli import main
from placement.sources.discovery import cluster_document, expand_hostlist
from placement.sources.discovery.kubernetes import parse_kubernetes
from placement.sources.discovery.nvidia_smi import parse_nvidia_smi
from placement.sources.discovery.slurm import node_state_usable, parse_slurm
from placement.formats import read_instance, write_instance
from placement.consumers.hostfile import slurm_hostfile
from placement.core.model import InvalidInputError
from placement.formats.job import cluster_spec_from_document, read_cluster
from tests.conftest import INSTANCES

# ---------------------------------------------------------------------------------------------
# Host lists


def test_hostlist_expands_like_slurm():
    assert expand_hostlist("gb[001-003,025]") == ["gb001", "gb002", "gb003", "gb025"]
    assert expand_hostlist("a,b[8-11]") == ["a", "b8", "b9", "b10", "b11"]
    assert expand_hostlist("r[1-2]-n[01-02]") == ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]
    assert expand_hostlist("node-7.cluster") == ["node-7.cluster"]


@pytest.mark.parametrize("bad", ["gb[001-0", "gb[a-b]", "gb]1", "g b", "gb[3-1]", "a,,b", "gb[0-99999999]"])
def test_hostlist_refuses_malformed(bad):
    with pytest.raises(InvalidInputError):
        expand_hostlist(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["gb", "n", "rack1-t"]), st.integers(0, 300), st.integers(0, 40)), min_size=1, max_size=4))
def test_hostlist_ranges_match_a_brute_force(parts):
    text = ",".join(f"{p}[{a:03d}-{a + n:03d}]" for p, a, n in parts)
    expected = [f"{p}{v:03d}" for p, a, n in parts for v in range(a, a + n + 1)]
    assert expand_hostlist(text) == expected


# ---------------------------------------------------------------------------------------------
# Slurm, from texts in the documented formats

BLOCK_TOPOLOGY = """\
BlockName=b1 BlockIndex=0 Nodes=gb[001-018] BlockSize=18
BlockName=b2 BlockIndex=1 Nodes=gb[019-036] BlockSize=18
BlockName=b3 BlockIndex=2 Nodes=gb[037-053] BlockSize=18
"""

# scontrol show topology of Slurm 25.x with BlockSizes=18,36: the base blocks, then the aggregated
# blocks (src/plugins/topology/block/topology_block.c @284c3b9, _print_topo_record)
BLOCK_TOPOLOGY_AGGREGATED = BLOCK_TOPOLOGY + """\
BlockName=b4 BlockIndex=3 BlockSize=18
AggregatedBlock=b1,b2 BlockIndex=4 Nodes=gb[001-036] BlockSize=36
"""

BLOCK_CONF = """\
# topology.conf for topology/block: one block per NVL72 rack
BlockName=b1 Nodes=gb[001-018]
BlockName=b2 Nodes=gb[019-036]
BlockName=b3 Nodes=gb[037-053]
BlockSizes=18,36
"""


def _node(name: str, state: str, gres: str = "gpu:4") -> str:
    return (
        f"NodeName={name} Arch=aarch64 CoresPerSocket=72 \n"
        f"   CPUAlloc=0 CPUEfctv=144 CPUTot=144 CPULoad=0.00\n"
        f"   AvailableFeatures=gb300\n"
        f"   Gres={gres}\n"
        f"   NodeAddr={name} NodeHostName={name} Version=24.05.4\n"
        f"   OS=Linux 6.8.0-1013-nvidia #14-Ubuntu SMP \n"
        f"   State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
        f"   Partitions=gpu \n"
        + (f"   Reason=maintenance [root@2026-12-01T10:00:00]\n" if state != "IDLE" else "")
        + "\n"
    )


NODE_STATES = {"gb003": "DOWN+NOT_RESPONDING", "gb020": "IDLE+DRAIN", "gb021": "ALLOCATED+DRAIN", "gb040": "MIXED+FAIL",
               "gb041": "IDLE*"}


def _nodes(n: int = 53, states: dict[str, str] | None = None, gres: dict[str, str] | None = None) -> str:
    states = NODE_STATES if states is None else states
    gres = gres or {}
    return "".join(_node(f"gb{i:03d}", states.get(f"gb{i:03d}", "IDLE"), gres.get(f"gb{i:03d}", "gpu:gb300:4(S:0-1)"))
                   for i in range(1, n + 1))


def _doc(texts: list[tuple[str, str]], **kw) -> dict:
    return cluster_document(parse_slurm(texts, **kw), name="t")


@pytest.mark.parametrize("topology", [BLOCK_TOPOLOGY, BLOCK_CONF, BLOCK_TOPOLOGY_AGGREGATED],
                         ids=["scontrol", "topology.conf", "scontrol-aggregated"])
def test_slurm_block_topology_and_node_states(topology):
    doc = _doc([("topo", topology), ("nodes", _nodes())])
    assert (doc["num_domains"], doc["trays_per_domain"], doc["gpus_per_tray"]) == (3, 18, 4)
    assert doc["domain_names"] == ["b1", "b2", "b3"]
    assert doc["hosts"][0][0] == "gb001" and doc["hosts"][2][-1] == "gb053" and len(doc["hosts"][2]) == 17
    # gb003: domain 0 tray 2; gb020/gb021: domain 1 trays 1, 2; gb040/gb041: domain 2 trays 3, 4
    assert doc["unavailable_trays"] == [[0, 2], [1, 1], [1, 2], [2, 3], [2, 4]]
    spec = cluster_spec_from_document(doc, __import__("pathlib").Path("t.json"))
    cl = spec.cluster
    assert cl.host_name(2) == "gb003" and cl.host_name(18) == "gb019"
    assert not cl.available[(2 * 18 + 17) * 4 :].any()  # the 18th slot of b3 has no host
    assert int(cl.available.sum()) == (53 - 5) * 4


def test_slurm_not_responding_policy():
    doc = _doc([("topo", BLOCK_TOPOLOGY), ("nodes", _nodes())], allow_not_responding=True)
    # gb003 stays down (DOWN), gb041 ("IDLE*") comes back
    assert [2, 4] not in doc["unavailable_trays"] and [0, 2] in doc["unavailable_trays"]


def test_slurm_tree_topology_leaf_switches_are_domains():
    tree = ("SwitchName=rack00 Level=0 LinkSpeed=1 Nodes=gb[001-018]\n"
            "SwitchName=rack01 Level=0 LinkSpeed=1 Nodes=gb[019-036]\n"
            "SwitchName=spine Level=1 LinkSpeed=1 Nodes=gb[001-036] Switches=rack[00-01]\n")
    doc = _doc([("topo", tree), ("nodes", _nodes(36))])
    assert doc["domain_names"] == ["rack00", "rack01"] and doc["trays_per_domain"] == 18
    assert doc["unavailable_trays"] == [[0, 2], [1, 1], [1, 2]]




def test_node_states():
    assert node_state_usable("IDLE") == (True, "")
    assert node_state_usable("ALLOCATED+COMPLETING") == (True, "")
    assert node_state_usable("MIXED+DRAIN")[0] is False
    assert node_state_usable("DOWN*") == (False, "NOT_RESPONDING+DOWN")
    assert node_state_usable("IDLE+NOT_RESPONDING", allow_not_responding=True) == (True, "")
    with pytest.raises(ValueError):
        node_state_usable("IDLE+SLEEPY")


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "topology,nodes,needle",
    [
        (BLOCK_TOPOLOGY, _nodes().replace("State=MIXED+FAIL", "State=MIXED+SLEEPY"), "gb040"),  # unknown state
        (BLOCK_TOPOLOGY, _nodes()[: _nodes().index("State=IDLE", _nodes().index("NodeName=gb053"))], "gb053"),  # truncated
        (BLOCK_TOPOLOGY.replace("gb[037-053]", "gb[037-052]"), _nodes(), "gb053"),  # a host in no block
        (BLOCK_TOPOLOGY.replace("gb[037-053] BlockSize=18\n", "gb[037-0"), _nodes(), "topo.txt:3"),  # truncated topology
        (BLOCK_TOPOLOGY, _nodes(52), "gb053"),  # a block's node missing from scontrol show node
        (BLOCK_TOPOLOGY + "BlockName=b4 BlockIndex=3 Nodes=gb[050-053] BlockSize=18\n", _nodes(), "gb050"),  # in two blocks
        ("", _nodes(), "topo.txt"),  # empty topology
        (BLOCK_TOPOLOGY.replace(" BlockSize=18\n", "\n", 1), _nodes(), "topo.txt:1"),  # cut before BlockSize
        (BLOCK_TOPOLOGY, _nodes().replace("Gres=gpu:gb300:4(S:0-1)", "Gres=gpu:gb300:x", 1), "gb001"),
    ],
    ids=["unknown-state", "truncated-nodes", "host-in-no-block", "truncated-topology", "node-missing", "two-blocks",
         "empty", "cut-before-blocksize", "bad-gres"],
)
def test_bad_slurm_output_exits_2_naming_the_host_or_line(tmp_path, capsys, topology, nodes, needle):
    out = tmp_path / "c.json"
    code = main(["cluster", "--from", "slurm", _write(tmp_path, "topo.txt", topology), _write(tmp_path, "nodes.txt", nodes),
                 "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and err.count("\n") == 1, err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Kubernetes (GPU feature discovery labels), nvidia-smi -q (Fabric section)

UUID_A = "5fbd5d29-8d2a-4b8f-9f0e-3c1f2a8e7d10"
UUID_B = "0a1b2c3d-0000-4000-8000-00000000000b"


def _k8s_node(name: str, clique: str | None, gpus: int = 4, *, unschedulable: bool = False, taints=(), ready="True",
              allocatable: int | None = None) -> dict:
    labels = {"kubernetes.io/hostname": name, "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.product": "NVIDIA-GB300"}
    if clique is not None:
        labels["nvidia.com/gpu.clique"] = clique
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": unschedulable, "taints": list(taints)} if unschedulable or taints else {},
        "status": {"capacity": {"cpu": "144", "nvidia.com/gpu": str(gpus)},
                   "allocatable": {"cpu": "144", "nvidia.com/gpu": str(gpus if allocatable is None else allocatable)},
                   "conditions": [{"type": "Ready", "status": ready}]},
    }


def _k8s(nodes: list[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes})


def test_kubernetes_cliques_and_unusable_nodes():
    nodes = [_k8s_node(f"node-{i:02d}", f"{UUID_A if i < 18 else UUID_B}.{1 if i < 18 else 7}") for i in range(36)]
    nodes[3] = _k8s_node("node-03", f"{UUID_A}.1", unschedulable=True)
    nodes[20] = _k8s_node("node-20", f"{UUID_B}.7", taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}])
    nodes[21] = _k8s_node("node-21", f"{UUID_B}.7", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    nodes[22] = _k8s_node("node-22", f"{UUID_B}.7", ready="False")
    nodes[23] = _k8s_node("node-23", f"{UUID_B}.7", allocatable=3)
    nodes.append({"metadata": {"name": "cpu-0", "labels": {}}, "status": {"capacity": {"cpu": "64"}}})  # skipped
    doc = cluster_document(parse_kubernetes([("k.json", _k8s(nodes))]), name="k")
    # cliques sorted by (cluster UUID, clique id): UUID_B's first
    assert doc["domain_names"] == [f"{UUID_B}.7", f"{UUID_A}.1"]
    assert doc["hosts"][1][3] == "node-03" and doc["hosts"][0][0] == "node-18"
    assert doc["unavailable_trays"] == [[0, 2], [0, 4], [1, 3]]  # node-21's taint is tolerated
    # node-23 (domain 0, tray 5) has 3 of 4 GPUs allocatable: only its last GPU, (0 * 18 + 5) * 4 + 3
    assert doc["unavailable_gpus"] == [23]


@pytest.mark.parametrize(
    "text,needle",
    [
        (_k8s([_k8s_node("node-00", None)]), "node-00"),
        (_k8s([_k8s_node("node-00", "nouuid")]), "node-00"),
        (_k8s([_k8s_node("node-00", f"{UUID_A}.1")])[:-20], "k.json"),
    ],
    ids=["no-clique", "bad-clique", "truncated"],
)
def test_bad_kubernetes_exits_2(tmp_path, capsys, text, needle):
    code = main(["cluster", "--from", "kubernetes", _write(tmp_path, "k.json", text), "-o", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err


def _smi(uuid: str, clique: int, states=("Completed",) * 4) -> str:
    head = ("==============NVSMI LOG==============\n\nTimestamp                                 : Wed Dec  2 10:00:00 2026\n"
            "Driver Version                            : 580.65.06\nCUDA Version                              : 13.0\n\n"
            f"Attached GPUs                             : {len(states)}\n")
    gpus = "".join(
        f"GPU 00000008:0{k}:00.0\n    Product Name                          : NVIDIA GB300\n"
        "    Inforom Version\n        Image Version                     : G548.0201.00.01\n"
        f"    Fabric\n        State                             : {state}\n"
        f"        Status                            : {'Success' if state == 'Completed' else 'N/A'}\n"
        f"        CliqueId                          : {clique}\n"
        f"        ClusterUUID                       : {uuid}\n"
        "        Health\n            Bandwidth                     : Full\n"
        "    Processes                             : None\n\n"
        for k, state in enumerate(states)
    )
    return head + gpus


def test_nvidia_smi_fabric_cliques(tmp_path, capsys):
    files = []
    for i in range(6):
        states = ("Completed", "In Progress", "Completed", "Completed") if i == 4 else ("Completed",) * 4
        files.append(_write(tmp_path, f"gb{i + 1:03d}.txt", _smi(UUID_A, 2 if i < 3 else 1, states)))
    assert main(["cluster", "--from", "nvidia-smi", *files, "-o", str(tmp_path / "c.json")]) == 0
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["domain_names"] == [f"{UUID_A}.1", f"{UUID_A}.2"]
    assert doc["hosts"] == [["gb004", "gb005", "gb006"], ["gb001", "gb002", "gb003"]]
    # gb005's second GPU: fabric still in progress; only that GPU is down (Discovered.unusable_at):
    # domain 0, tray 1, GPU 1 -> (0 * 3 + 1) * 4 + 1
    assert doc["unavailable_gpus"] == [5] and doc["unavailable_trays"] == []
    # the same as one pdsh output with "host: " prefixes
    pdsh = "".join(f"gb{i + 1:03d}: " + line + "\n" for i in range(6) for line in (tmp_path / f"gb{i + 1:03d}.txt").read_text().splitlines())
    assert main(["cluster", "--from", "nvidia-smi", _write(tmp_path, "all.txt", pdsh), "-o", str(tmp_path / "d.json")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "d.json").read_text())["hosts"] == doc["hosts"]


def test_nvidia_smi_without_fabric_exits_2_naming_the_host(tmp_path, capsys):
    text = _smi("N/A", 0).replace("CliqueId                          : 0", "CliqueId                          : N/A")
    code = main(["cluster", "--from", "nvidia-smi", "h100-7=" + _write(tmp_path, "x.txt", text), "-o", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert code == 2 and "h100-7" in err and "x.txt:" in err, err


def test_parse_nvidia_smi_host_in_two_cliques():
    text = _smi(UUID_A, 1).replace("CliqueId                          : 1", "CliqueId                          : 2", 1)
    with pytest.raises(InvalidInputError, match="gb009"):
        parse_nvidia_smi([("gb009", "gb009.txt", text)])


# ---------------------------------------------------------------------------------------------
# Faults as the drivers print them (issue 31): fabric not registered, unhealthy GPUs, no device
# plugin, no clique label, a node with fewer GPUs; --skip-unready

UUID_ZERO = "00000000-0000-0000-0000-000000000000"
OK = ("Completed", "Success", None, None, "Healthy")  # State, Status, CliqueId, ClusterUUID, Health Summary
# NVIDIA/gpu-operator#2511: registration still running, no clique yet
IN_PROGRESS = ("In Progress", "N/A", "N/A", "N/A", "N/A")
# Azure/azhpc-images#506 (the Fabric block its description quotes): registration failed
INSUFFICIENT = ("Completed", "Insufficient Resources", "0", UUID_ZERO, "N/A")
# kubernetes-sigs/dra-driver-nvidia-gpu#626 (nvidia-smi -q | grep -C3 CliqueId): registered, unhealthy
UNHEALTHY = ("Completed", "Success", None, None, "Unhealthy")


def _smi_r580(uuid: str, clique: int, gpus) -> str:
    """nvidia-smi -q of one GB300 host as driver R580 prints it: per GPU a Fabric section with
    State, Status, CliqueId, ClusterUUID and a Health subsection (Summary, Bandwidth, Route Recovery
    in progress, Route Unhealthy, Access Timeout Recovery, Incorrect Configuration).  ``gpus``: per
    GPU (State, Status, CliqueId, ClusterUUID, Summary), None = the host's ``clique`` / ``uuid``."""
    head = ("==============NVSMI LOG==============\n\nTimestamp                                 : Wed Dec  2 10:00:00 2026\n"
            "Driver Version                            : 580.65.06\nCUDA Version                              : 13.0\n\n"
            f"Attached GPUs                             : {len(gpus)}\n")
    out = [head]
    for k, (state, status, cid, cuuid, summary) in enumerate(gpus):
        bad = summary == "Unhealthy"
        out.append(
            f"GPU 00000008:0{k}:00.0\n    Product Name                          : NVIDIA GB300\n"
            "    Platform Info\n        Chassis Serial Number             : 1821125191000\n"
            f"        Slot Number                       : {k}\n"
            "    Fabric\n"
            f"        State                             : {state}\n"
            f"        Status                            : {status}\n"
            f"        CliqueId                          : {clique if cid is None else cid}\n"
            f"        ClusterUUID                       : {uuid if cuuid is None else cuuid}\n"
            "        Health\n"
            f"            Summary                       : {summary}\n"
            f"            Bandwidth                     : {'N/A' if summary == 'N/A' else 'Full'}\n"
            f"            Route Recovery in progress    : {'N/A' if summary == 'N/A' else 'False'}\n"
            f"            Route Unhealthy               : {'N/A' if summary == 'N/A' else bad}\n"
            f"            Access Timeout Recovery       : {'N/A' if summary == 'N/A' else 'False'}\n"
            f"            Incorrect Configuration       : {'N/A' if summary == 'N/A' else 'None'}\n"
            "    Processes                             : None\n\n"
        )
    return "".join(out)


def _smi_cluster(tmp_path, hosts: dict[str, tuple]) -> list[str]:
    """One file per host (gb001..), 2 hosts per clique of UUID_A; ``hosts``: name -> its GPUs."""
    return [_write(tmp_path, f"{h}.txt", _smi_r580(UUID_A, 1 + i // 2, gpus)) for i, (h, gpus) in enumerate(hosts.items())]


def _cluster(tmp_path, capsys, source: str, inputs: list[str], *flags: str) -> tuple[int, dict | None, list[str]]:
    out = tmp_path / "c.json"
    if out.exists():
        out.unlink()
    code = main(["cluster", "--from", source, *inputs, "-o", str(out), *flags])
    err = capsys.readouterr().err.splitlines()
    return code, (json.loads(out.read_text()) if out.exists() else None), err


@pytest.mark.parametrize("fault,kind", [(IN_PROGRESS, "registration not finished"), (INSUFFICIENT, "registration failed")],
                         ids=["in-progress", "insufficient-resources"])
def test_nvidia_smi_host_without_a_registered_gpu_is_an_error_or_left_out(tmp_path, capsys, fault, kind):
    hosts = {"gb001": (OK,) * 4, "gb002": (fault,) * 4, "gb003": (OK,) * 4, "gb004": (OK,) * 4, "gb005": (fault,) * 4}
    files = _smi_cluster(tmp_path, hosts)
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files)
    assert code == 2 and doc is None and len(err) == 1, err
    assert "host gb002" in err[0] and "gb002.txt:" in err[0] and "--skip-unready" in err[0] and "(and 1 more)" in err[0]
    assert f"Fabric State {fault[0]}, Status {fault[1]}" in err[0] and f"({kind})" in err[0] and UUID_ZERO + ".0" not in err[0]
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files, "--skip-unready")
    assert code == 0 and doc is not None
    warnings = [line for line in err if line.startswith("placement: warning: left out:")]
    assert len(warnings) == 2 == len(err) and "host gb002" in warnings[0] and "host gb005" in warnings[1], err
    # never read as a clique: no domain named after the all-zero UUID
    # (gb005 was clique 3's only host: that clique is gone with it)
    assert doc["domain_names"] == [f"{UUID_A}.1", f"{UUID_A}.2"] and UUID_ZERO not in json.dumps(doc)
    assert doc["hosts"] == [["gb001"], ["gb003", "gb004"]]
    assert doc["unavailable_trays"] == [] and "2 hosts left out" in doc["description"]


def test_api_reports_each_host_left_out_as_one_warning(tmp_path):
    from placement.sources.discovery import UnreadyHostWarning

    files = _smi_cluster(tmp_path, {"gb001": (OK,) * 4, "gb002": (IN_PROGRESS,) * 4, "gb003": (INSUFFICIENT,) * 4})
    with pytest.raises(InvalidInputError, match="host gb002.*--skip-unready"):
        placement.cluster_from_nvidia_smi(files)
    with pytest.warns(UnreadyHostWarning) as caught:
        doc = placement.cluster_from_nvidia_smi(files, skip_unready=True)
    assert [str(w.message).split("host ")[1].split(":")[0] for w in caught] == ["gb002", "gb003"]
    assert doc["hosts"] == [["gb001"]]


def test_nvidia_smi_every_host_unready_leaves_nothing(tmp_path, capsys):
    files = _smi_cluster(tmp_path, {"gb001": (IN_PROGRESS,) * 4, "gb002": (INSUFFICIENT,) * 4})
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files, "--skip-unready")
    assert code == 2 and doc is None and "no NVLink domain found (2 hosts left out" in err[-1], err


@pytest.mark.parametrize("fault", [IN_PROGRESS, INSUFFICIENT, UNHEALTHY], ids=["in-progress", "insufficient", "unhealthy"])
def test_nvidia_smi_one_unusable_gpu_is_left_out_with_one_warning(tmp_path, capsys, fault):
    """One GPU of gb002 not usable; its other GPUs say its domain: the file is written, that GPU
    down, one warning line naming it.  (Before: In Progress exited 2; Insufficient Resources read as
    a second clique; Unhealthy usable.)"""
    hosts = {"gb001": (OK,) * 4, "gb002": (OK, fault, OK, OK), "gb003": (OK,) * 4, "gb004": (OK,) * 4}
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", _smi_cluster(tmp_path, hosts))
    assert code == 0 and len(err) == 1 and err[0].startswith("placement: warning: unusable: "), err
    assert "host gb002: GPU 1 of 4 unusable" in err[0] and UUID_ZERO + ".0" not in err[0], err
    assert doc["hosts"] == [["gb001", "gb002"], ["gb003", "gb004"]] and doc["domain_names"] == [f"{UUID_A}.1", f"{UUID_A}.2"]
    assert doc["unavailable_trays"] == [] and doc["unavailable_gpus"] == [5]  # domain 0, tray 1, GPU 1
    assert "0 hosts down, 1 more GPUs down on 1 hosts, 15 GPUs usable" in doc["description"]


def test_nvidia_smi_unhealthy_on_every_gpu_is_a_down_host_in_its_domain(tmp_path, capsys):
    hosts = {"gb001": (OK,) * 4, "gb002": (UNHEALTHY,) * 4}
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", _smi_cluster(tmp_path, hosts))
    assert code == 0 and doc["hosts"] == [["gb001", "gb002"]] and doc["unavailable_trays"] == [[0, 1]]
    assert doc["unavailable_gpus"] == [] and len(err) == 1 and "host gb002: no usable GPU, tray down" in err[0], err
    texts = [(h, h, (tmp_path / f"{h}.txt").read_text()) for h in hosts]
    found = parse_nvidia_smi(texts)
    assert found.unusable == {"gb002": (0, 1, 2, 3)}
    assert found.faulty == {"gb002": "; ".join(f"GPU {k}: Fabric Health Summary Unhealthy" for k in range(4))}


def test_nvidia_smi_health_fields_r570_without_summary():
    """Drivers before R580 print the Health block without Summary: Route Unhealthy True is unhealthy."""
    text = _smi_r580(UUID_A, 1, (OK,) * 4)
    lines = [line for line in text.splitlines(keepends=True) if "Summary" not in line]
    i = [n for n, line in enumerate(lines) if "Route Unhealthy" in line][2]
    lines[i] = lines[i].replace("False", "True")
    found = parse_nvidia_smi([("gb001", "gb001.txt", "".join(lines))])
    assert found.faulty == {"gb001": "GPU 2: Fabric Health Route Unhealthy True"} and found.unusable == {"gb001": (2,)}
    # Limited Capacity (degraded bandwidth alone) stays usable
    healthy = parse_nvidia_smi([("gb001", "gb001.txt", text.replace("Healthy\n", "Limited Capacity\n", 1))])
    assert healthy.faulty == {}


@pytest.mark.parametrize("lines,why", [
    (["    GPU Recovery Action                   : Node Reboot"], "GPU Recovery Action Node Reboot"),
    (["    GPU Recovery Action                   : Drain and Reset"], "GPU Recovery Action Drain and Reset"),
    # R565 and older: the GPU Reset Status block (R570 prints "Requested functionality has been deprecated")
    (["    GPU Reset Status", "        Reset Required                    : Yes",
      "        Drain and Reset Recommended       : No"], "GPU Reset Status Reset Required Yes"),
    (["    GPU Reset Status", "        Reset Required                    : No",
      "        Drain and Reset Recommended       : Yes"], "GPU Reset Status Drain and Reset Recommended Yes"),
    (["    GPU Reset Status", "        Reset Required                    : Requested functionality has been deprecated",
      "    GPU Recovery Action                   : None"], None),
    (["    GPU Recovery Action                   : N/A"], None),
], ids=["reboot", "drain-and-reset", "reset-required", "drain-recommended", "r570-none", "na"])
def test_nvidia_smi_gpu_recovery_action(lines, why):
    """A registered, fabric-healthy GPU the driver asks to recover first (nvidia-smi -q's per-GPU
    ``GPU Recovery Action``, or the older ``GPU Reset Status``) is unusable; ``None`` is not."""
    text = _smi_r580(UUID_A, 1, (OK,) * 4).splitlines(keepends=True)
    at = [n for n, line in enumerate(text) if "Product Name" in line][1]  # GPU 1
    text[at + 1 : at + 1] = [line + "\n" for line in lines]
    found = parse_nvidia_smi([("gb001", "gb001.txt", "".join(text))])
    if why is None:
        assert found.unusable == {} and found.faulty == {}
    else:
        assert found.unusable == {"gb001": (1,)} and found.faulty == {"gb001": f"GPU 1: {why}"}


def test_nvidia_smi_state_na_is_no_fabric_and_bad_fields_exit_2(tmp_path, capsys):
    no_fabric = ("N/A", "N/A", "N/A", "N/A", "N/A")  # H100: no NVLink fabric at all
    files = _smi_cluster(tmp_path, {"gb001": (OK,) * 4, "h100-1": (no_fabric,) * 4})
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files)
    assert code == 2 and "host h100-1" in err[0] and "(no NVLink fabric)" in err[0], err
    bad = _smi_r580(UUID_A, 1, (OK,) * 4).replace(UUID_A, "5fbd5d29-8d2a", 1)
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", [_write(tmp_path, "gb009.txt", bad)], "--skip-unready")
    assert code == 2 and len(err) == 1 and "gb009" in err[0] and "ClusterUUID" in err[0], err


_GPU_STATES = {"ok": OK, "in-progress": IN_PROGRESS, "insufficient": INSUFFICIENT, "unhealthy": UNHEALTHY}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(sorted(_GPU_STATES)), min_size=4, max_size=4), min_size=1, max_size=6))
def test_nvidia_smi_matches_a_per_gpu_reference(states):
    """Per host: left out when no GPU is registered (ok or unhealthy), else in its clique; its tray
    down when no GPU is ok, else exactly its GPUs that are not ok down.  Checked against that rule
    written out per GPU."""
    texts = [(f"gb{i + 1:03d}", f"gb{i + 1:03d}.txt", _smi_r580(UUID_A, 1 + i % 2, [_GPU_STATES[g] for g in host]))
             for i, host in enumerate(states)]
    found = parse_nvidia_smi(texts, skip_unready=True)
    left = {f"gb{i + 1:03d}" for i, host in enumerate(states) if not set(host) & {"ok", "unhealthy"}}
    assert set(found.left_out) == left
    placed = [(f"gb{i + 1:03d}", 1 + i % 2, host) for i, host in enumerate(states) if f"gb{i + 1:03d}" not in left]
    assert {h for _, hosts in found.domains for h in hosts} == {h for h, _, _ in placed}
    for h, cid, host in placed:
        assert h in dict(found.domains)[f"{UUID_A}.{cid}"]
        assert found.unusable.get(h, ()) == tuple(k for k, g in enumerate(host) if g != "ok")
    if placed:
        doc = cluster_document(found, name="f")
        down = {doc["hosts"][d][t] for d, t in doc["unavailable_trays"]}
        assert down == {h for h, _, host in placed if "ok" not in host}
        trays = doc["trays_per_domain"]
        gpus = {(doc["hosts"][g // 4 // trays][g // 4 % trays], g % 4) for g in doc["unavailable_gpus"]}
        assert gpus == {(h, k) for h, _, host in placed if "ok" in host for k, g in enumerate(host) if g != "ok"}
        assert len(found.warnings()) == sum(1 for _, _, host in placed if host != ["ok"] * 4)


def _k8s_bare(name: str, labels: dict, capacity: dict, allocatable: dict) -> dict:
    """A v1 Node as kubectl get nodes -o json prints it, with the given labels and status."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {}, "status": {"capacity": {"cpu": "144", **capacity}, "allocatable": {"cpu": "144", **allocatable},
                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def test_kubernetes_gfd_labels_without_the_device_plugin_have_no_usable_gpus():
    """GFD has labelled node-01 (gpu.count 4, the clique) but no device plugin published
    nvidia.com/gpu in its capacity or allocatable: no GPU of it can be requested."""
    gfd = {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-GB300", "nvidia.com/gpu.present": "true",
           "nvidia.com/gpu.clique": f"{UUID_A}.1"}
    nodes = [_k8s_node("node-00", f"{UUID_A}.1"), _k8s_bare("node-01", gfd, {}, {}), _k8s_node("node-02", f"{UUID_A}.1")]
    found = parse_kubernetes([("k.json", _k8s(nodes))])
    assert "device plugin not running" in found.faulty["node-01"]
    doc = cluster_document(found, name="k")
    assert doc["hosts"] == [["node-00", "node-01", "node-02"]] and doc["unavailable_trays"] == [[0, 1]]
    assert "8 GPUs usable" in doc["description"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=1, max_size=8))
def test_kubernetes_allocatable_matches_a_per_gpu_reference(allocatable):
    """Per node of 4 GPUs with ``a`` allocatable (None: no nvidia.com/gpu there): a tray down when
    a is None or 0, else exactly its GPUs a..3 down; usable GPUs are the sum of the a."""
    nodes = [_k8s_node(f"gb{i + 1:03d}", f"{UUID_A}.1") for i in range(len(allocatable))]
    for node, a in zip(nodes, allocatable):
        if a is None:
            del node["status"]["allocatable"]["nvidia.com/gpu"]
        else:
            node["status"]["allocatable"]["nvidia.com/gpu"] = str(a)
    found = parse_kubernetes([("k.json", _k8s(nodes))])
    doc = cluster_document(found, name="k")
    assert doc["unavailable_trays"] == [[0, t] for t, a in enumerate(allocatable) if not a]
    assert doc["unavailable_gpus"] == [t * 4 + g for t, a in enumerate(allocatable) if a for g in range(a, 4)]
    assert f", {sum(a or 0 for a in allocatable)} GPUs usable" in doc["description"]
    assert len(found.warnings()) == sum(1 for a in allocatable if a != 4)


def test_kubernetes_gpu_node_without_a_clique_label_is_an_error_or_left_out(tmp_path, capsys):
    nodes = [_k8s_node(f"node-{i:02d}", None if i in (1, 3) else f"{UUID_A}.1") for i in range(4)]
    path = _write(tmp_path, "k.json", _k8s(nodes))
    code, doc, err = _cluster(tmp_path, capsys, "kubernetes", [path])
    assert code == 2 and doc is None and len(err) == 1, err
    assert "node node-01" in err[0] and "nvidia.com/gpu.clique" in err[0] and "--skip-unready" in err[0], err
    code, doc, err = _cluster(tmp_path, capsys, "kubernetes", [path], "--skip-unready")
    assert code == 0 and doc["hosts"] == [["node-00", "node-02"]] and doc["unavailable_trays"] == []
    assert len(err) == 2 and "node node-01" in err[0] and "node node-03" in err[1] and all("warning" in e for e in err), err


def test_slurm_maintenance_as_scontrol_prints_it():
    """slurm_protocol_defs.c (node_state_flags): NODE_STATE_MAINT prints MAINTENANCE; a node in a
    maintenance reservation shows State=IDLE+MAINTENANCE+RESERVED."""
    assert node_state_usable("IDLE+MAINTENANCE+RESERVED") == (False, "MAINTENANCE")
    doc = _doc([("topo", BLOCK_TOPOLOGY), ("nodes", _nodes(states={"gb002": "IDLE+MAINTENANCE+RESERVED"}))])
    assert doc["unavailable_trays"] == [[0, 1]]


def test_slurm_node_in_no_block_is_left_out_with_the_flag(tmp_path, capsys):
    topo = _write(tmp_path, "topo.txt", BLOCK_TOPOLOGY.replace("gb[037-053]", "gb[037-051]"))
    nodes = _write(tmp_path, "nodes.txt", _nodes(states={}))
    code, doc, err = _cluster(tmp_path, capsys, "slurm", [topo, nodes])
    assert code == 2 and "node gb052" in err[0] and "(and 1 more)" in err[0] and "--skip-unready" in err[0], err
    code, doc, err = _cluster(tmp_path, capsys, "slurm", [topo, nodes], "--skip-unready")
    assert code == 0 and [e.split("node ")[1].split()[0] for e in err] == ["gb052", "gb053"], err
    assert len(doc["hosts"][2]) == 15 and "2 hosts left out" in doc["description"]


# One rule for a host with 2 of its 4 GPUs usable, whatever the source: only its 2 unusable GPUs
# are down, the host keeps the other 2 (Discovered.unusable_at says why: the launchers run a host
# with fewer ranks, and the schedulers still hand out its free GPUs).  Kubernetes and Slurm give a
# count: the highest local indices are taken; nvidia-smi names the GPUs.  Each case: the same 4
# hosts, host 2 with 2 of 4 GPUs usable.


def _two_of_four(tmp_path, source: str) -> list[str]:
    if source == "slurm":  # the Gres count slurmd registered (Gres=gpu:gb300:2)
        topo = "BlockName=b1 BlockIndex=0 Nodes=gb[001-004] BlockSize=4\n"
        return [_write(tmp_path, "topo.txt", topo),
                _write(tmp_path, "nodes.txt", _nodes(4, states={}, gres={"gb002": "gpu:gb300:2(S:0)"}))]
    if source == "kubernetes":  # the device plugin withdrew two unhealthy GPUs: allocatable 2 of capacity 4
        return [_write(tmp_path, "k.json", _k8s([_k8s_node(f"gb{i:03d}", f"{UUID_A}.1", allocatable=2 if i == 2 else None)
                                                 for i in range(1, 5)]))]
    gpus = {f"gb{i:03d}": (OK, UNHEALTHY, OK, IN_PROGRESS) if i == 2 else (OK,) * 4 for i in range(1, 5)}
    return [_write(tmp_path, f"{h}.txt", _smi_r580(UUID_A, 1, g)) for h, g in gpus.items()]


@pytest.mark.parametrize("source,down", [("slurm", [6, 7]), ("kubernetes", [6, 7]), ("nvidia-smi", [5, 7])])
def test_two_of_four_gpus_down_only_those_on_every_source(tmp_path, capsys, source, down):
    code, doc, err = _cluster(tmp_path, capsys, source, _two_of_four(tmp_path, source))
    assert code == 0, err
    assert [h for hosts in doc["hosts"] for h in hosts] == ["gb001", "gb002", "gb003", "gb004"]
    # gb002 is tray 1 of domain 0: its GPUs are 4..7
    assert doc["gpus_per_tray"] == 4 and doc["unavailable_trays"] == [] and doc["unavailable_gpus"] == down
    assert "0 hosts down, 2 more GPUs down on 1 hosts, 14 GPUs usable" in doc["description"]
    local = ", ".join(str(g - 4) for g in down)
    assert len(err) == 1 and err[0].startswith("placement: warning: unusable: ") and f"host gb002: GPU {local} of 4 unusable" in err[0], err
    # the plan's reader takes the file: 14 GPUs, gb002 with 2
    cl = read_cluster(tmp_path / "c.json").cluster
    assert cl.available_gpus.tolist() == sorted(set(range(16)) - set(down))


def test_zero_allocatable_or_gres_downs_the_tray_with_a_warning(tmp_path, capsys):
    """A host with none of its GPUs usable is down as a tray (not 4 unavailable GPUs): allocatable 0
    on Kubernetes, Gres=gpu:0 on Slurm."""
    k8s = _k8s([_k8s_node(f"gb{i:03d}", f"{UUID_A}.1", allocatable=0 if i == 3 else None) for i in range(1, 5)])
    code, doc, err = _cluster(tmp_path, capsys, "kubernetes", [_write(tmp_path, "k.json", k8s)])
    assert code == 0 and doc["unavailable_trays"] == [[0, 2]] and doc["unavailable_gpus"] == []
    assert len(err) == 1 and "host gb003: no usable GPU, tray down: 0 of 4 GPUs allocatable" in err[0], err
    topo = _write(tmp_path, "topo.txt", "BlockName=b1 BlockIndex=0 Nodes=gb[001-004] BlockSize=4\n")
    nodes = _write(tmp_path, "nodes.txt", _nodes(4, states={}, gres={"gb003": "(null)"}))
    code, doc, err = _cluster(tmp_path, capsys, "slurm", [topo, nodes])
    assert code == 0 and doc["unavailable_trays"] == [[0, 2]] and doc["unavailable_gpus"] == []
    assert len(err) == 1 and "host gb003: no usable GPU, tray down" in err[0], err


def test_api_reports_unusable_gpus_as_one_warning_per_host(tmp_path):
    from placement.sources.discovery import DiscoveryWarning, UnreadyHostWarning, UnusableGpuWarning

    files = _smi_cluster(tmp_path, {"gb001": (OK, IN_PROGRESS, OK, UNHEALTHY), "gb002": (OK,) * 4,
                                    "gb003": (INSUFFICIENT, OK, OK, OK), "gb004": (IN_PROGRESS,) * 4})
    with pytest.warns(DiscoveryWarning) as caught:
        doc = placement.cluster_from_nvidia_smi(files, skip_unready=True)
    kinds = [(w.category, str(w.message).split("host ")[1].split(":")[0]) for w in caught]
    assert kinds == [(UnreadyHostWarning, "gb004"), (UnusableGpuWarning, "gb001"), (UnusableGpuWarning, "gb003")]
    assert "GPU 1, 3 of 4 unusable: GPU 1: Fabric State In Progress" in str(caught[1].message)
    assert "Health Summary Unhealthy" in str(caught[1].message)
    assert doc["unavailable_gpus"] == [1, 3, 8] and doc["hosts"] == [["gb001", "gb002"], ["gb003"]]


def test_a_host_with_gpus_down_runs_fewer_ranks_on_its_usable_gpus(tiny, tmp_path, capsys):
    """The rule's premise, end to end: nvidia-smi of tiny's 5 domains x 2 trays x 2 GPUs with gb003's
    GPU 1 and gb005's GPU 0 unhealthy and gb008 with no usable GPU leaves exactly 16 usable GPUs for
    16 ranks; the solve uses them all, and the Slurm launch files run one rank on gb003 (GPU 0) and
    one on gb005 (GPU 1)."""
    bad = {"gb003": (OK, UNHEALTHY), "gb005": (UNHEALTHY, OK), "gb008": (UNHEALTHY, UNHEALTHY)}
    files = [_write(tmp_path, f"gb{h:03d}.txt", _smi_r580(UUID_A, 1 + (h - 1) // 2, bad.get(f"gb{h:03d}", (OK, OK))))
             for h in range(1, 11)]
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files)
    assert code == 0 and doc["unavailable_trays"] == [[3, 1]] and doc["unavailable_gpus"] == [5, 8], err
    assert len(err) == 3 and "16 GPUs usable" in doc["description"]
    cl = read_cluster(tmp_path / "c.json").cluster
    inst = dataclasses.replace(tiny, cluster=cl)
    write_instance(inst, tmp_path / "i.json")
    out = tmp_path / "p.json"
    assert main(["solve", str(tmp_path / "i.json"), "--solver", "default", "-o", str(out)]) == 0
    assert main(["export", str(out), "--format", "slurm", "--instance", str(tmp_path / "i.json"),
                 "-o", str(tmp_path / "job.hosts")]) == 0
    capsys.readouterr()
    hosts = (tmp_path / "job.hosts").read_text().split()
    assert len(hosts) == 16 and hosts.count("gb003") == 1 and hosts.count("gb005") == 1 and "gb008" not in hosts
    gpus = dict(line.split() for line in (tmp_path / "job.gpus").read_text().splitlines() if line.strip())
    assert gpus["gb003"] == "0" and gpus["gb005"] == "1"


# ---------------------------------------------------------------------------------------------
# Real host names flow through the instance; solving for an allocation


def _named_tiny(tiny, tmp_path):
    """tiny.json with real host names (its 5 domains x 2 trays) written and read back."""
    cl = tiny.cluster
    names = tuple(f"gb{h + 1:03d}" for h in range(cl.num_domains * cl.trays_per_domain))
    inst = dataclasses.replace(tiny, cluster=dataclasses.replace(cl, host_names=names, domain_names=tuple(f"blk{d}" for d in range(cl.num_domains))))
    write_instance(inst, tmp_path / "named.json")
    return read_instance(tmp_path / "named.json")


def test_host_names_round_trip_and_reach_the_hostfile_and_launcher(tiny, tmp_path, capsys):
    named = _named_tiny(tiny, tmp_path)
    doc = json.loads((tmp_path / "named.json").read_text())
    assert doc["cluster"]["hosts"][0] == ["gb001", "gb002"] and doc["cluster"]["domain_names"][4] == "blk4"
    out = tmp_path / "p.json"
    assert main(["solve", str(tmp_path / "named.json"), "--solver", "default", "-o", str(out)]) == 0
    p = placement.load_placement(named, out)
    lines = slurm_hostfile(named, p.rank2gpu).split()
    assert lines == [f"gb{int(named.cluster.gpu2host[g]) + 1:03d}" for g in p.rank2gpu]
    assert main(["export", str(out), "--format", "slurm", "--instance", str(tmp_path / "named.json"),
                 "-o", str(tmp_path / "job.hosts")]) == 0
    script = (tmp_path / "job.launch.sh").read_text()
    assert "gb001" in script and "rack00" not in script
    assert (tmp_path / "job.hosts").read_text().split() == lines
    capsys.readouterr()


def test_allocation_restricts_the_solve_and_the_hostfile(tiny, tmp_path, capsys):
    _named_tiny(tiny, tmp_path)
    # tiny: 5 domains x 2 trays x 2 GPUs, tray [3, 1] (gb008) down; the job needs 16 GPUs = 8 trays
    out = tmp_path / "p.json"
    code = main(["solve", str(tmp_path / "named.json"), "--solver", "default", "--allocation", "gb[001-007,009]", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["solve"]["details"]["allocation"] == {"hosts": "gb[001-007,009]", "gpus": 16}
    assert main(["export", str(out), "--format", "slurm", "--instance", str(tmp_path / "named.json"),
                 "-o", str(tmp_path / "job.hosts")]) == 0
    used = set((tmp_path / "job.hosts").read_text().split())
    assert used == {f"gb{i:03d}" for i in (1, 2, 3, 4, 5, 6, 7, 9)}
    assert main(["verify", str(tmp_path / "named.json"), str(out)]) == 0
    capsys.readouterr()


def test_allocation_from_slurm_job_nodelist(tiny, tmp_path, capsys, monkeypatch):
    _named_tiny(tiny, tmp_path)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gb[002-007,009-010]")
    assert main(["solve", str(tmp_path / "named.json"), "--solver", "default", "--allocation", "slurm",
                 "-o", str(tmp_path / "p.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["solve"]["details"]["allocation"]["hosts"] == "gb[002-007,009-010]"
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    assert main(["solve", str(tmp_path / "named.json"), "--solver", "default", "--allocation", "slurm"]) == 2
    assert "SLURM_JOB_NODELIST" in capsys.readouterr().err


def test_allocation_unknown_host_exits_2_too_few_gpus_exits_3(tiny, tmp_path, capsys):
    _named_tiny(tiny, tmp_path)
    args = ["solve", str(tmp_path / "named.json"), "--solver", "default", "-o", str(tmp_path / "p.json")]
    assert main(args + ["--allocation", "gb[001-007],gb999"]) == 2
    assert "'gb999'" in capsys.readouterr().err
    assert main(args + ["--allocation", "gb[001-008]"]) == 3  # gb008 is down: 14 GPUs for 16 ranks
    assert "16 GPUs" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_allocate_keeps_the_instance_hash_and_uses_only_allocated_gpus(tiny, tmp_path):
    named = _named_tiny(tiny, tmp_path)
    sub = placement.allocate(named, ["gb001", "gb002", "gb010"])
    assert sub.sha256 == named.sha256
    hosts = {named.cluster.host_name(int(h)) for h in np.unique(named.cluster.gpu2host[sub.cluster.available])}
    assert hosts == {"gb001", "gb002", "gb010"}


def test_rack_map_names_the_domains_and_hosts(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _named_tiny(tiny, tmp_path)
    out = tmp_path / "map.svg"
    assert main(["show", "default", "--instance", str(tmp_path / "named.json"), "-o", str(out)]) == 0
    svg = out.read_text()
    assert "blk0" in svg and "gb001..gb002" in svg and "gb009..gb010" in svg
    capsys.readouterr()


def test_bad_hosts_in_a_cluster_file(tmp_path, capsys):
    doc = json.loads((INSTANCES / "dsv3_1024_cluster.json").read_text())
    doc["hosts"] = [[f"gb{d * 18 + t:03d}" for t in range(18)] for d in range(15)]
    doc["hosts"][3][4] = "gb001"
    (tmp_path / "c.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match=r"hosts\[3\]\[4\].*gb001"):
        read_cluster(tmp_path / "c.json")
    doc["hosts"][3][4] = "gb 1"
    (tmp_path / "c.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match=r"hosts\[3\]\[4\]"):
        read_cluster(tmp_path / "c.json")


def test_plan_for_an_allocation_writes_only_allocated_hosts(tmp_path, capsys):
    from tests.test_plan import _cluster_doc, _job_doc, _write

    # tiny's cluster (5 domains x 2 trays x 2 GPUs, tray [3, 1] down) with real names; allocate 16 GPUs
    cdoc = _cluster_doc(hosts=[[f"n{d}a", f"n{d}b"] for d in range(5)], domain_names=[f"blk{d}" for d in range(5)])
    job, cluster = _write(tmp_path, "job.json", _job_doc()), _write(tmp_path, "cluster.json", cdoc)
    out = tmp_path / "p.json"
    alloc = "n[0-2]a,n[0-2]b,n3a,n4a"
    rc = main(["plan", str(job), "--cluster", str(cluster), "--candidates", "tp=1 pp=1,2 vpp=1 ep=4,8 dp=4,8 mb=1",
               "--time-limit", "60", "--workers", "1", "--allocation", alloc, "-o", str(out),
               "--export", f"slurm={tmp_path / 'job.hosts'}"])
    assert rc == 0, capsys.readouterr().err
    used = set((tmp_path / "job.hosts").read_text().split())
    assert used <= set(expand_hostlist(alloc)) and used
    inst = json.loads((tmp_path / "p.instance.json").read_text())
    assert inst["cluster"]["hosts"] == cdoc["hosts"] and inst["cluster"]["domain_names"] == cdoc["domain_names"]
    assert main(["plan", str(job), "--cluster", str(cluster), "--allocation", "n9a", "--time-limit", "5"]) == 2
    assert "'n9a'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Fuzz: any damage to a valid text is read or refused with InvalidInputError, nothing else

_SLURM_TEXTS = (BLOCK_TOPOLOGY, _nodes(20, gres={}))


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, 1), cut=st.floats(0, 1), at=st.floats(0, 1),
       junk=st.text(alphabet="=[]-,+*: \n\tgb0193ABCDEFGHIJKLMNOPQRSTUVWXYZ()", max_size=8))
def test_fuzz_slurm_texts(which, cut, at, junk):
    texts = [BLOCK_TOPOLOGY.replace("gb[037-053]", "gb[037-040]").replace("gb[019-036]", "gb[019-020]").replace(
        "gb[001-018]", "gb[001-018]"), _nodes(40, states={"gb003": "DOWN"})]
    t = texts[which]
    t = t[: int(len(t) * (0.5 + cut / 2))]
    i = int(len(t) * at)
    texts[which] = t[:i] + junk + t[i:]
    try:
        cluster_document(parse_slurm([("topo", texts[0]), ("nodes", texts[1])]), name="f")
    except InvalidInputError:
        pass


_K8S_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 9) | st.text(max_size=6) | st.just(f"{UUID_A}.1"),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(["key", "effect", "type", "status", "name"]), kids, max_size=3),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(path=st.sampled_from([("metadata",), ("metadata", "labels"), ("metadata", "name"), ("spec",), ("spec", "taints"),
                             ("status",), ("status", "conditions"), ("status", "capacity"), ("status", "allocatable"),
                             ("metadata", "labels", "nvidia.com/gpu.clique"), ("metadata", "labels", "nvidia.com/gpu.count")]),
       value=_K8S_VALUES)
def test_fuzz_kubernetes_nodes(path, value):
    nodes = [_k8s_node(f"node-{i}", f"{UUID_A}.1") for i in range(3)]
    node = nodes[1]
    node.setdefault("spec", {})
    cur = node
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    try:
        cluster_document(parse_kubernetes([("k.json", _k8s(nodes))]), name="f")
    except InvalidInputError:
        pass


@settings(max_examples=100, deadline=None)
@given(cut=st.floats(0, 1), at=st.floats(0, 1), junk=st.text(alphabet=" :\nGPU0Fabric.StateCompleted-N/A1", max_size=10))
def test_fuzz_nvidia_smi(cut, at, junk):
    t = _smi(UUID_A, 1)
    t = t[: int(len(t) * (0.3 + 0.7 * cut))]
    i = int(len(t) * at)
    try:
        cluster_document(parse_nvidia_smi([("gb001", "gb001.txt", t[:i] + junk + t[i:])]), name="f")
    except InvalidInputError:
        pass


# ---------------------------------------------------------------------------------------------
# Fixtures in the drivers' printed layout (tests/data/discovery/README.md gives the source of each
# shape): nvidia-smi -q of driver R580 (colon at column 55, Partition Assigned, GPU Recovery
# Action) and kubectl get nodes -o json with GPU feature discovery's labels.

FIXTURES = __import__("pathlib").Path(__file__).parent / "data" / "discovery"
FIXTURE_UUID = "6a130f54-faaa-4b8f-847f-be44ab70f917"


def test_fixture_nvidia_smi_r580(tmp_path, capsys):
    files = [str(FIXTURES / f"gb00{i}.nvidia-smi-q.txt") for i in range(1, 5)]
    found = parse_nvidia_smi([(f"gb00{i}", f, FIXTURES.joinpath(f).read_text()) for i, f in enumerate(files, 1)], skip_unready=True)
    assert found.unusable == {"gb002": (2, 3), "gb004": (1,)}
    assert found.faulty["gb002"].startswith("GPU 2: Fabric State In Progress, Status N/A, CliqueId N/A, ClusterUUID N/A")
    assert found.faulty["gb002"].endswith("GPU 3: GPU Recovery Action Reset")
    # gb003: every GPU Insufficient Resources with clique 0 and a zero UUID: no domain of its own
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files)
    assert code == 2 and doc is None and len(err) == 1, err
    assert "host gb003" in err[0] and "registration failed" in err[0] and "--skip-unready" in err[0], err
    code, doc, err = _cluster(tmp_path, capsys, "nvidia-smi", files, "--skip-unready")
    assert code == 0 and doc["domain_names"] == [f"{FIXTURE_UUID}.32766"], err
    assert doc["hosts"] == [["gb001", "gb002", "gb004"]] and "00000000-0000" not in json.dumps(doc)
    # tray 1 (gb002) GPUs 2, 3 -> 6, 7; tray 2 (gb004) GPU 1 -> 9
    assert doc["unavailable_gpus"] == [6, 7, 9] and doc["unavailable_trays"] == []
    assert [line.split(": ")[2] for line in err] == ["left out", "unusable", "unusable"], err
    assert "host gb003" in err[0] and "host gb002: GPU 2, 3 of 4 unusable" in err[1] and "host gb004: GPU 1 of 4" in err[2]
    # the same bytes again: deterministic
    first = (tmp_path / "c.json").read_bytes()
    assert _cluster(tmp_path, capsys, "nvidia-smi", files[::-1], "--skip-unready")[0] == 0
    assert (tmp_path / "c.json").read_bytes() == first


def test_fixture_kubectl_get_nodes(tmp_path, capsys):
    path = str(FIXTURES / "kubectl-get-nodes.json")
    code, doc, err = _cluster(tmp_path, capsys, "kubernetes", [path])
    assert code == 2 and len(err) == 1 and "node gb004" in err[0] and "--skip-unready" in err[0], err
    code, doc, err = _cluster(tmp_path, capsys, "kubernetes", [path], "--skip-unready")
    assert code == 0 and doc["hosts"] == [["gb001", "gb002", "gb003", "gb005"]], err
    # gb002: 2 of 4 allocatable -> its GPUs 2, 3 (tray 1: 6, 7); gb003: no device plugin -> tray down
    assert doc["unavailable_gpus"] == [6, 7] and doc["unavailable_trays"] == [[0, 2]]
    assert "1 hosts down, 2 more GPUs down on 1 hosts, 10 GPUs usable, 1 hosts left out" in doc["description"]
    assert len(err) == 3 and "node gb004" in err[0], err
    assert "host gb002: GPU 2, 3 of 4 unusable: 2 of 4 GPUs allocatable" in err[1], err
    assert "host gb003: no usable GPU, tray down" in err[2] and "device plugin not running" in err[2], err
