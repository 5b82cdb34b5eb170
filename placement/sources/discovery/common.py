"""What every source gives (NVLink domains of hosts, GPUs per host, what is down) and the
cluster file built from it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from placement.core.model import InvalidInputError

__all__ = [
    "Discovered",
    "UnreadyHostWarning",
    "SKIP_UNREADY_FLAG",
    "settle_unready",
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


SKIP_UNREADY_FLAG = "--skip-unready"


class UnreadyHostWarning(UserWarning):
    """A host left out of the cluster file because its NVLink domain is not known yet (its fabric
    registration has not finished, no clique label, in no block); ``skip_unready=True`` only."""


def settle_unready(unready: dict[str, str], skip: bool) -> dict[str, str]:
    """The hosts to leave out, or the error for the first of them.

    ``unready``: host -> one line naming the host, where it was read and why its NVLink domain is
    not known.  Without ``skip`` the first (in natural host order) is an error that names the flag
    leaving it out; with it they are returned (host -> line) for :class:`Discovered` ``left_out``.
    """
    if not unready or skip:
        return dict(unready)
    hosts = sorted(unready, key=natural_key)
    more = f" (and {len(hosts) - 1} more)" if len(hosts) > 1 else ""
    raise InvalidInputError(f"{unready[hosts[0]]}{more}; {SKIP_UNREADY_FLAG} leaves it out")


@dataclass
class Discovered:
    """A cluster as a source reports it.

    ``domains``: NVLink domains in order, each ``(name, [host, ...])`` with its hosts in tray
    order.  ``gpus``: GPUs per host (what it has, usable or not).  ``down_hosts``: host -> reason
    (the whole tray unusable).  ``faulty``: host -> why some of its GPUs are unusable (which ones,
    when the source says).  ``left_out``: hosts in no domain because their domain is not known yet,
    host -> why (see :func:`settle_unready`).  ``tray_slots``: trays per domain when the source
    says (Slurm's BlockSize), else the largest domain's host count.

    One rule for every source (:func:`cluster_document`): a host with a faulty GPU, or with fewer
    GPUs than the most any host has, is down as a whole tray.
    """

    source: str
    domains: list[tuple[str, list[str]]]
    gpus: dict[str, int]
    down_hosts: dict[str, str] = field(default_factory=dict)
    faulty: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    tray_slots: int | None = None

    def check(self) -> None:
        if not self.domains:
            why = f" ({len(self.left_out)} hosts left out: their NVLink domain is not known)" if self.left_out else ""
            raise InvalidInputError(f"{self.source}: no NVLink domain found{why}")
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

    def tray_down(self, gpus_per_tray: int) -> dict[str, str]:
        """Host -> why its whole tray is unusable: down, a faulty GPU, or fewer GPUs than
        ``gpus_per_tray``.

        Why the whole tray and not only the missing GPUs: Kubernetes (allocatable
        ``nvidia.com/gpu``) and Slurm (``Gres``) give a count, not which GPUs are gone, so a plan
        could only guess them; Slurm itself drains a node whose GPUs are fewer than configured
        (``gres/gpu count reported lower than configured``, ``src/common/gres.c``); and the
        launchers start the same number of ranks on every host (``torchrun --nproc-per-node``,
        ``srun --ntasks-per-node``, a pod per host asking for ``nvidia.com/gpu``), so a half tray
        holds no share of the job.  nvidia-smi names the GPU, and follows the same rule so that the
        three sources give the same file for the same cluster.
        """
        out: dict[str, str] = {}
        for _, hosts in self.domains:
            for h in hosts:
                if h in self.down_hosts:
                    out[h] = self.down_hosts[h]
                elif h in self.faulty:
                    out[h] = self.faulty[h]
                elif self.gpus[h] < gpus_per_tray:
                    out[h] = f"{self.gpus[h]} of {gpus_per_tray} GPUs"
        return out


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

    ``gpus_per_tray`` is the most GPUs any host has; a host with fewer, or with a faulty GPU, is
    down as a whole tray (:meth:`Discovered.tray_down` says why).  Hosts in tray order per domain;
    a domain with fewer hosts than the others (or than ``tray_slots``) leaves its last tray slots
    empty.  ``unavailable_gpus`` stays empty: discovery downs trays, not single GPUs.
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
    down = found.tray_down(gpt)
    unavailable_trays = [[d, t] for d, (_, hosts) in enumerate(found.domains) for t, h in enumerate(hosts) if h in down]
    n_hosts = sum(len(hosts) for _, hosts in found.domains)
    free = gpt * (n_hosts - len(down))
    doc: dict[str, Any] = {
        "schema_version": 1,
        "kind": "cluster",
        "name": name,
        "description": (
            f"read by placement cluster from {found.source}: {n_domains} NVLink domains, {n_hosts} hosts, "
            f"{gpt} GPUs per host, {len(down)} hosts down, {free} GPUs usable"
            + (f", {len(found.left_out)} hosts left out (domain not known yet)" if found.left_out else "")
        ),
        "num_domains": n_domains,
        "trays_per_domain": trays,
        "gpus_per_tray": gpt,
        "nvlink_gbps": float(nvlink_gbps),
        "scaleout_gbps": float(scaleout_gbps),
        "gpu_hbm_gb": float(gpu_hbm_gb),
        "unavailable_gpus": [],
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
    from placement.formats.job import cluster_spec_from_document

    cluster_spec_from_document(doc, Path(path))
    atomic_write_text(Path(path), json.dumps(doc, indent=1, sort_keys=True) + "\n")
