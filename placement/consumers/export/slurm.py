"""Slurm: the ``SLURM_HOSTFILE`` (line ``i`` = rank ``i``), the per-host ``CUDA_VISIBLE_DEVICES`` file
beside it, and readers that give back the rank -> GPU map a launch with them produces."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement


def slurm_hostfile_text(instance: Instance, placement: Placement) -> str:
    """The ``SLURM_HOSTFILE`` for the placement's rank -> GPU map (:func:`placement.consumers.hostfile.slurm_hostfile`)."""
    from placement.consumers.hostfile import slurm_hostfile

    return slurm_hostfile(instance, np.asarray(placement.rank2gpu))


def slurm_gpus_text(instance: Instance, placement: Placement) -> str:
    """``HOST GPU,GPU,...`` lines: per host the ``CUDA_VISIBLE_DEVICES`` its tasks set, so that
    local rank ``j`` runs on the GPU the placement gives the host's ``j``-th rank
    (:func:`placement.consumers.hostfile.cuda_visible_devices_file`; written beside the hostfile)."""
    from placement.consumers.hostfile import cuda_visible_devices_file

    return cuda_visible_devices_file(instance, np.asarray(placement.rank2gpu))


def slurm_gpus_path(hostfile_path: str | os.PathLike) -> Path:
    """Where the GPU file goes: the hostfile's path with the suffix ``.gpus``."""
    out = Path(hostfile_path)
    return out.with_suffix(".gpus") if out.suffix else out.with_name(out.name + ".gpus")


def parse_slurm_hostfile(text: str) -> list[str]:
    """Host name of each rank, in rank order (blank lines and ``#`` comments skipped)."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line)
    return hosts


def parse_slurm_launch(hostfile_text: str, gpus_text: str, instance: Instance) -> np.ndarray:
    """(world,) ``rank2gpu`` that a launch with these two files produces.

    Slurm gives a host's tasks ``SLURM_LOCALID`` 0, 1, ... in global-rank order; local rank ``j``
    uses the ``j``-th entry of its host's ``CUDA_VISIBLE_DEVICES``.
    """
    cl = instance.cluster
    host_ids = {cl.host_name(h): h for h in range(cl.num_domains * cl.trays_per_domain)}
    hosts = parse_slurm_hostfile(hostfile_text)
    visible: dict[str, list[int]] = {}
    for n, line in enumerate(gpus_text.splitlines(), 1):
        if not line.strip():
            continue
        name, _, devices = line.strip().partition(" ")
        try:
            visible[name] = [int(x) for x in devices.split(",")]
        except ValueError:
            raise InvalidInputError(f"gpus file: line {n}: expected 'HOST GPU,GPU,...', found {line!r}") from None
    taken: dict[str, int] = {}
    rank2gpu = []
    for r, name in enumerate(hosts):
        if name not in host_ids:
            raise InvalidInputError(f"hostfile: line {r + 1}: unknown host {name!r}")
        j = taken.get(name, 0)
        taken[name] = j + 1
        host_gpus = visible.get(name, list(range(cl.gpus_per_tray)))
        if j >= len(host_gpus):
            raise InvalidInputError(f"hostfile: host {name} runs {j + 1} ranks but has {len(host_gpus)} visible GPUs")
        rank2gpu.append(host_ids[name] * cl.gpus_per_tray + host_gpus[j])
    return np.asarray(rank2gpu, dtype=np.int64)
