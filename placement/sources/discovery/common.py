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
    "DiscoveryWarning",
    "UnreadyHostWarning",
    "UnusableGpuWarning",
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


class DiscoveryWarning(UserWarning):
    """One line about one host that discovery leaves out or counts partly unusable
    (``placement cluster`` prints each as ``placement: warning: ...``)."""


class UnreadyHostWarning(DiscoveryWarning):
    """A host left out of the cluster file because its NVLink domain is not known yet (its fabric
    registration has not finished, no clique label, in no block); ``skip_unready=True`` only."""


class UnusableGpuWarning(DiscoveryWarning):
    """A host in its domain with some or all of its GPUs unusable (not registered in the fabric,
    unhealthy, not allocatable, fewer than the other hosts): which ones and why."""


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
    (the scheduler says the whole host is unusable: drained, not ready, ...).  ``unusable``: host
    -> the local indices (0 .. ``gpus[host]`` - 1) of its GPUs that cannot run a rank, and
    ``faulty``: host -> why, in one line (every host of ``unusable`` has a reason here).
    ``left_out``: hosts in no domain because their domain is not known yet, host -> why (see
    :func:`settle_unready`).  ``tray_slots``: trays per domain when the source says (Slurm's
    BlockSize), else the largest domain's host count.

    One rule for every source (:meth:`unusable_at`): only the unusable GPUs of a host are down;
    its tray is down when the scheduler downs the host or when none of its GPUs is usable.
    """

    source: str
    domains: list[tuple[str, list[str]]]
    gpus: dict[str, int]
    down_hosts: dict[str, str] = field(default_factory=dict)
    faulty: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    tray_slots: int | None = None
    unusable: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
        for h, local in self.unusable.items():
            if h not in self.faulty or any(not 0 <= g < self.gpus.get(h, 0) for g in local):
                raise ValueError(f"Discovered.unusable[{h!r}] = {local}: not GPUs of the host with a reason in faulty")

    def unusable_at(self, gpus_per_tray: int) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
        """What is down, with ``gpus_per_tray`` GPUs per tray: ``(trays, gpus)``.

        ``trays``: host -> why its whole tray is down (the scheduler downs the host, or none of its
        GPUs is usable).  ``gpus``: host -> (local indices of its unusable GPUs, why) for a host
        with some GPUs usable: those of ``unusable`` and, on a host with fewer GPUs than
        ``gpus_per_tray``, the indices it lacks.

        Why only the missing GPUs and not the whole tray: the plan and the launchers already run a
        host with fewer ranks than GPUs (``placement/consumers/hostfile.py``: per-host
        ``CUDA_VISIBLE_DEVICES``; ``placement/consumers/launch.py``: per-host ``--nproc-per-node``), and
        Kubernetes and Slurm still place work on a host's free GPUs (allocatable ``nvidia.com/gpu``,
        ``Gres``), so downing the tray would throw away GPUs the scheduler hands out.  Kubernetes
        and Slurm give a count, not which GPUs: the unusable ones are taken as the highest local
        indices, which is what a job sees (the scheduler shows a job its GPUs renumbered 0 .. k-1:
        device plugin; Slurm with ``ConstrainDevices=yes``); within a tray the GPUs are alike to the
        plan (one NVLink domain), so the choice moves no byte.  nvidia-smi names the GPU, and that
        GPU is the one marked (the source to use on Slurm without ``ConstrainDevices``, where the
        launcher's ``CUDA_VISIBLE_DEVICES`` addresses physical indices).
        """
        trays: dict[str, str] = {}
        part: dict[str, tuple[tuple[int, ...], str]] = {}
        for _, hosts in self.domains:
            for h in hosts:
                if h in self.down_hosts:
                    trays[h] = self.down_hosts[h]
                    continue
                bad = set(self.unusable.get(h, ())) | set(range(self.gpus[h], gpus_per_tray))
                if not bad:
                    continue
                why = [self.faulty[h]] if h in self.unusable else []
                if self.gpus[h] < gpus_per_tray:
                    why.append(f"{self.gpus[h]} GPUs where other hosts have {gpus_per_tray}")
                if len(bad) >= gpus_per_tray:
                    trays[h] = "; ".join(why)
                else:
                    part[h] = (tuple(sorted(bad)), "; ".join(why))
        return trays, part

    def gpus_per_tray(self) -> int:
        """The most GPUs any host in a domain has."""
        return max(self.gpus[h] for _, hosts in self.domains for h in hosts)

    def warnings(self) -> list[str]:
        """One line per host with unusable GPUs that the scheduler has not downed, in tray order
        (the lines :class:`UnusableGpuWarning` carries)."""
        self.check()
        gpt = self.gpus_per_tray()
        trays, part = self.unusable_at(gpt)
        out: list[str] = []
        for _, hosts in self.domains:
            for h in hosts:
                if h in part:
                    local, why = part[h]
                    out.append(f"{self.source}: host {h}: GPU {', '.join(map(str, local))} of {gpt} unusable: {why}")
                elif h in trays and h not in self.down_hosts:
                    out.append(f"{self.source}: host {h}: no usable GPU, tray down: {trays[h]}")
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

    ``gpus_per_tray`` is the most GPUs any host has.  A host the scheduler downs, or with no usable
    GPU, goes to ``unavailable_trays``; the unusable GPUs of a host with some usable go to
    ``unavailable_gpus`` (:meth:`Discovered.unusable_at` says which and why).  Hosts in tray order
    per domain; a domain with fewer hosts than the others (or than ``tray_slots``) leaves its last
    tray slots empty.
    """
    found.check()
    gpt = found.gpus_per_tray()
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
    down, part = found.unusable_at(gpt)
    unavailable_trays = [[d, t] for d, (_, hosts) in enumerate(found.domains) for t, h in enumerate(hosts) if h in down]
    unavailable_gpus = [
        (d * trays + t) * gpt + g
        for d, (_, hosts) in enumerate(found.domains) for t, h in enumerate(hosts) if h in part for g in part[h][0]
    ]
    n_hosts = sum(len(hosts) for _, hosts in found.domains)
    free = gpt * (n_hosts - len(down)) - len(unavailable_gpus)
    doc: dict[str, Any] = {
        "schema_version": 1,
        "kind": "cluster",
        "name": name,
        "description": (
            f"read by placement cluster from {found.source}: {n_domains} NVLink domains, {n_hosts} hosts, "
            f"{gpt} GPUs per host, {len(down)} hosts down, "
            + (f"{len(unavailable_gpus)} more GPUs down on {len(part)} hosts, " if part else "")
            + f"{free} GPUs usable"
            + (f", {len(found.left_out)} hosts left out (domain not known yet)" if found.left_out else "")
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
    from placement.formats.job import cluster_spec_from_document

    cluster_spec_from_document(doc, Path(path))
    atomic_write_text(Path(path), json.dumps(doc, indent=1, sort_keys=True) + "\n")
