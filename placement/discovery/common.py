"""What every source gives (NVLink domains of hosts, GPUs per host, what is down) and the
cluster file built from it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from placement.model import InvalidInputError

__all__ = [
    "Discovered",
    "DEFAULT_NVLINK_GBPS",
    "DEFAULT_SCALEOUT_GBPS",
    "DEFAULT_GPU_HBM_GB",
    "natural_key",
    "cluster_document",
    "write_cluster",
]

# GB300 NVL72 figures (the defaults of instances/dsv3_1024_cluster.json); no scheduler reports them.
DEFAULT_NVLINK_GBPS = 900.0
DEFAULT_SCALEOUT_GBPS = 100.0
DEFAULT_GPU_HBM_GB = 288.0


def natural_key(name: str) -> tuple:
    """Sort key that orders ``gb2`` before ``gb10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p)


@dataclass
class Discovered:
    """A cluster as a source reports it.

    ``domains``: NVLink domains in order, each ``(name, [host, ...])`` with its hosts in tray
    order.  ``gpus``: GPUs per host.  ``down_hosts``: host -> reason (the whole tray unusable).
    ``down_gpus``: host -> local GPU indices unusable.  ``tray_slots``: trays per domain when the
    source says (Slurm's BlockSize), else the largest domain's host count.
    """

    source: str
    domains: list[tuple[str, list[str]]]
    gpus: dict[str, int]
    down_hosts: dict[str, str] = field(default_factory=dict)
    down_gpus: dict[str, list[int]] = field(default_factory=dict)
    tray_slots: int | None = None

    def check(self) -> None:
        if not self.domains:
            raise InvalidInputError(f"{self.source}: no NVLink domain found")
        seen: dict[str, str] = {}
        for name, hosts in self.domains:
            if not hosts:
                raise InvalidInputError(f"{self.source}: domain {name!r} has no hosts")
            for h in hosts:
                if h in seen:
                    raise InvalidInputError(f"{self.source}: host {h} is in two domains, {seen[h]!r} and {name!r}")
                seen[h] = name
                if h not in self.gpus:
                    raise InvalidInputError(f"{self.source}: host {h} (domain {name!r}) has no GPU count")


def cluster_document(
    found: Discovered,
    *,
    name: str,
    nvlink_gbps: float = DEFAULT_NVLINK_GBPS,
    scaleout_gbps: float = DEFAULT_SCALEOUT_GBPS,
    gpu_hbm_gb: float = DEFAULT_GPU_HBM_GB,
    hbm_reserve_gb: float | None = None,
) -> dict[str, Any]:
    """The cluster file (``placement plan --cluster``, ``placement solve --cluster``) of ``found``.

    ``gpus_per_tray`` is the most GPUs any host has; a host with fewer has its missing local GPUs
    unavailable.  Hosts in tray order per domain; a domain with fewer hosts than the others (or than
    ``tray_slots``) leaves its last tray slots empty.
    """
    found.check()
    gpt = max(found.gpus[h] for _, hosts in found.domains for h in hosts)
    if gpt < 1:
        raise InvalidInputError(f"{found.source}: no host has a GPU")
    trays = max(len(hosts) for _, hosts in found.domains)
    if found.tray_slots is not None:
        if found.tray_slots < trays:
            big = max(found.domains, key=lambda d: len(d[1]))
            raise InvalidInputError(
                f"{found.source}: domain {big[0]!r} has {len(big[1])} hosts, more than its size {found.tray_slots}"
            )
        trays = found.tray_slots
    n_domains = len(found.domains)
    available = np.ones(n_domains * trays * gpt, dtype=bool)
    for d, (_, hosts) in enumerate(found.domains):
        for t, h in enumerate(hosts):
            base = (d * trays + t) * gpt
            if h in found.down_hosts:
                available[base : base + gpt] = False
                continue
            available[base + found.gpus[h] : base + gpt] = False
            for g in found.down_gpus.get(h, []):
                available[base + g] = False
        available[(d * trays + len(hosts)) * gpt : (d + 1) * trays * gpt] = False
    unavailable_trays: list[list[int]] = []
    unavailable_gpus: list[int] = []
    for hh in range(n_domains * trays):
        block = available[hh * gpt : (hh + 1) * gpt]
        d, t = divmod(hh, trays)
        if t >= len(found.domains[d][1]):
            continue  # an empty slot: unavailable through "hosts"
        if not block.any():
            unavailable_trays.append([d, t])
        elif not block.all():
            unavailable_gpus.extend(hh * gpt + int(i) for i in np.flatnonzero(~block))
    n_hosts = sum(len(hosts) for _, hosts in found.domains)
    free = int(available.sum())
    doc: dict[str, Any] = {
        "schema_version": 1,
        "kind": "cluster",
        "name": name,
        "description": (
            f"read by placement cluster from {found.source}: {n_domains} NVLink domains, {n_hosts} hosts, "
            f"{gpt} GPUs per host, {len(found.down_hosts)} hosts down, {free} GPUs usable"
        ),
        "num_domains": n_domains,
        "trays_per_domain": trays,
        "gpus_per_tray": gpt,
        "nvlink_gbps": float(nvlink_gbps),
        "scaleout_gbps": float(scaleout_gbps),
        "gpu_hbm_gb": float(gpu_hbm_gb),
        "unavailable_gpus": unavailable_gpus,
        "unavailable_trays": unavailable_trays,
        "hosts": [list(hosts) for _, hosts in found.domains],
        "domain_names": [d for d, _ in found.domains],
    }
    if hbm_reserve_gb is not None:
        doc["hbm_reserve_gb"] = float(hbm_reserve_gb)
    return doc


def write_cluster(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Check ``doc`` with the cluster reader's checks, then write it atomically."""
    from placement.formats import atomic_write_text
    from placement.plan.job import cluster_spec_from_document

    cluster_spec_from_document(doc, Path(path))
    atomic_write_text(Path(path), json.dumps(doc, indent=1, sort_keys=True) + "\n")
