"""The cluster as the scheduler sees it: discovery and a job's allocation."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from placement.core.model import Cluster, Instance, InvalidInputError
from placement.sources.discovery import cluster_from_kubernetes, cluster_from_nvidia_smi, cluster_from_slurm, write_cluster

__all__ = [
    "allocate",
    "allocate_cluster",
    "allocation_hosts",
    "cluster_from_slurm",
    "cluster_from_kubernetes",
    "cluster_from_nvidia_smi",
    "write_cluster",
]


def allocation_hosts(allocation: str | Sequence[str]) -> list[str]:
    """The host names of an allocation: a Slurm host list (``gb[001-018,025]``, as in
    ``SLURM_JOB_NODELIST``) or a sequence of names."""
    from placement.sources.discovery import expand_hostlist

    if isinstance(allocation, str):
        hosts = expand_hostlist(allocation)
    else:
        hosts = [str(h) for h in allocation]
    if not hosts:
        raise InvalidInputError("--allocation: empty host list")
    return hosts


def allocate(instance: Instance, allocation: str | Sequence[str]) -> Instance:
    """``instance`` restricted to the hosts of ``allocation``: every other host's GPUs unavailable.

    The instance keeps its ``sha256``: a placement solved for the allocation is a valid placement
    of the instance file (it uses a subset of its available GPUs), so ``placement export`` and
    ``placement verify`` take the instance file as it is.  Hosts of the allocation that the
    instance marks unavailable stay unavailable.

    Raises
    ------
    InvalidInputError
        A host the cluster does not have (named), or an empty allocation.
    """
    return dataclasses.replace(instance, cluster=allocate_cluster(instance.cluster, allocation))


def allocate_cluster(cluster: Cluster, allocation: str | Sequence[str]) -> Cluster:
    """``cluster`` with only the hosts of ``allocation`` available (see :func:`allocate`)."""
    hosts = allocation_hosts(allocation)
    index = cluster.host_index
    unknown = [h for h in hosts if h not in index]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise InvalidInputError(f"--allocation: host {unknown[0]!r} is not in the cluster{more}")
    keep = np.zeros(cluster.num_domains * cluster.trays_per_domain, dtype=bool)
    keep[[index[h] for h in hosts]] = True
    available = np.asarray(cluster.available) & np.repeat(keep, cluster.gpus_per_tray)
    return dataclasses.replace(cluster, available=available)
