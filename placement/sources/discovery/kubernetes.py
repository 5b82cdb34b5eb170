"""A cluster from Kubernetes: ``kubectl get nodes -o json``, labelled by NVIDIA's GPU feature
discovery (GFD).

Per node (``items[]``, a ``v1`` ``Node`` object): ``metadata.name``; the label
``nvidia.com/gpu.clique`` = ``<ClusterUUID>.<CliqueId>`` (the NVLink fabric's cluster UUID and
decimal clique id: one clique is one NVLink domain; ``internal/lm/imex.go``,
NVIDIA/k8s-device-plugin @1b826ac).  GFD writes that label only for GPUs go-nvlib calls fabric
attached (``IsFabricAttached``: fabric state Completed, status Success, cluster UUID not all zeros),
so a node whose registration is still running or failed has none.  GPUs: the label
``nvidia.com/gpu.count``, else ``status.capacity`` ``nvidia.com/gpu``.  The GPUs the job can have are
``status.allocatable`` ``nvidia.com/gpu``, which the device plugin publishes: none there (or no
``nvidia.com/gpu`` at all) means the device plugin is not running, fewer than the node's GPUs that
it withdrew unhealthy ones.

A node is down (its whole tray) when ``spec.unschedulable`` is true, its ``Ready`` condition is not
``True``, it has a ``NoSchedule``/``NoExecute`` taint from Kubernetes' node lifecycle
(``node.kubernetes.io/...``, ``node.cloudprovider.kubernetes.io/shutdown``) or one named in
``down_taints``, or no ``nvidia.com/gpu`` allocatable.  With ``k`` of its ``n`` GPUs allocatable only
the other ``n - k`` are down, taken as its highest local indices (the rule of
:meth:`placement.sources.discovery.common.Discovered.unusable_at`).  Other taints (e.g.
``nvidia.com/gpu:NoSchedule`` reserving GPU nodes for GPU pods) are the job's to tolerate.  Nodes
without GPUs and without GFD labels are skipped; a GPU node without a clique label (or with an
all-zero cluster UUID in it) has no known domain: an error naming it, or with ``skip_unready`` left
out with a warning.  Cliques in order of (cluster UUID, clique id), hosts by name within one.
"""

from __future__ import annotations

import json
from typing import Any

from placement.sources.discovery.common import Discovered, natural_key, settle_unready
from placement.core.model import InvalidInputError

__all__ = ["parse_kubernetes", "CLIQUE_LABEL", "GPU_COUNT_LABEL"]

CLIQUE_LABEL = "nvidia.com/gpu.clique"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
_LIFECYCLE_TAINTS = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/shutdown")


def _obj(where: str, value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where}: {field or 'node'}: expected an object, found {type(value).__name__}")
    return value


def _list(where: str, value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise InvalidInputError(f"{where}: {field}: expected a list, found {type(value).__name__}")
    return value


def _count(where: str, value: Any) -> int:
    text = str(value)
    if isinstance(value, bool) or not text.isdigit():
        raise InvalidInputError(f"{where}: expected a GPU count, found {text!r}")
    return int(text)


def parse_kubernetes(
    texts: list[tuple[str, str]], *, down_taints: tuple[str, ...] = (), skip_unready: bool = False
) -> Discovered:
    """A :class:`Discovered` cluster from ``kubectl get nodes -o json`` outputs (``(label, text)``;
    several are merged, e.g. one per node pool).  ``skip_unready``: leave out GPU nodes without a
    clique label (``Discovered.left_out``) instead of refusing them."""
    cliques: dict[tuple[str, int], list[str]] = {}
    gpus: dict[str, int] = {}
    down: dict[str, str] = {}
    faulty: dict[str, str] = {}
    unusable: dict[str, tuple[int, ...]] = {}
    unready: dict[str, str] = {}
    for label, text in texts:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise InvalidInputError(f"{label}: not JSON (truncated?): {exc}") from None
        items = doc.get("items") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise InvalidInputError(f"{label}: items: expected the list of kubectl get nodes -o json")
        for i, node in enumerate(items):
            where = f"{label}: items[{i}]"
            meta = _obj(where, node, "")
            meta = _obj(where, meta.get("metadata"), "metadata")
            name = meta.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidInputError(f"{where}: metadata.name: expected a node name")
            where = f"{label}: node {name}"
            labels = _obj(where, meta.get("labels") or {}, "metadata.labels")
            spec = _obj(where, node.get("spec") or {}, "spec")
            status = _obj(where, node.get("status") or {}, "status")
            capacity = _obj(where, status.get("capacity") or {}, "status.capacity").get("nvidia.com/gpu")
            allocatable = _obj(where, status.get("allocatable") or {}, "status.allocatable").get("nvidia.com/gpu")
            if GPU_COUNT_LABEL in labels:
                n = _count(f"{where}: label {GPU_COUNT_LABEL}", labels[GPU_COUNT_LABEL])
            elif capacity is not None:
                n = _count(f"{where}: status.capacity nvidia.com/gpu", capacity)
            else:
                n = 0
            if n == 0 and CLIQUE_LABEL not in labels:
                continue  # no GPUs (a GPU node without its count and clique labels says nothing either)
            if name in gpus or name in unready:
                raise InvalidInputError(f"{where}: listed twice")
            clique = labels.get(CLIQUE_LABEL)
            if clique is None:
                unready[name] = (f"{where}: {n} GPUs but no {CLIQUE_LABEL} label (GPU feature discovery writes "
                                 "none while the NVLink fabric registration has not finished)")
                continue
            uuid, dot, cid = str(clique).rpartition(".")
            if not dot or not uuid or not cid.isdigit():
                raise InvalidInputError(f"{where}: label {CLIQUE_LABEL}={clique!r}: expected <ClusterUUID>.<CliqueId>")
            if uuid.strip("0-") == "":
                unready[name] = f"{where}: label {CLIQUE_LABEL}={clique!r}: an all-zero cluster UUID is no NVLink fabric"
                continue
            gpus[name] = n
            cliques.setdefault((uuid, int(cid)), []).append(name)
            if allocatable is None:
                faulty[name] = f"{n} GPUs but no nvidia.com/gpu in status.allocatable (device plugin not running?)"
                unusable[name] = tuple(range(n))
            elif (usable := _count(f"{where}: status.allocatable nvidia.com/gpu", allocatable)) < n:
                faulty[name] = f"{usable} of {n} GPUs allocatable"
                unusable[name] = tuple(range(usable, n))
            why: list[str] = []
            if spec.get("unschedulable") is True:
                why.append("unschedulable")
            conditions = [_obj(where, c, "status.conditions[]") for c in _list(where, status.get("conditions") or [], "status.conditions")]
            ready = [c for c in conditions if c.get("type") == "Ready"]
            if ready and ready[0].get("status") != "True":
                why.append(f"Ready={ready[0].get('status')}")
            for taint in _list(where, spec.get("taints") or [], "spec.taints"):
                taint = _obj(where, taint, "spec.taints[]")
                key, effect = str(taint.get("key", "")), str(taint.get("effect", ""))
                if effect in ("NoSchedule", "NoExecute") and (key.startswith(_LIFECYCLE_TAINTS) or key in down_taints):
                    why.append(f"taint {key}:{effect}")
            if why:
                down[name] = ", ".join(why)
    left_out = settle_unready(unready, skip_unready)
    if not gpus and not left_out:
        raise InvalidInputError(f"kubernetes: no node with GPUs in {', '.join(label for label, _ in texts)}")
    domains = [(f"{uuid}.{cid}", sorted(hosts, key=natural_key)) for (uuid, cid), hosts in sorted(cliques.items())]
    return Discovered("kubectl get nodes", domains, gpus, down_hosts=down, faulty=faulty, left_out=left_out,
                      unusable=unusable)
