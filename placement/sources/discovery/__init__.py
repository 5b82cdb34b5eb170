"""The cluster as the scheduler sees it: NVLink domains, real host names and what is down, read
from Slurm, Kubernetes or ``nvidia-smi -q``, as a cluster file (``placement cluster``).

One module per source (:mod:`.slurm`, :mod:`.kubernetes`, :mod:`.nvidia_smi`); each turns the
source's text into a :class:`~placement.sources.discovery.common.Discovered`, which
:func:`~placement.sources.discovery.common.cluster_document` turns into the cluster file that ``placement
plan --cluster`` reads, with ``hosts`` (real names per tray) and ``domain_names``.  Formats and
rules: docs/formats.md, "Cluster files from the scheduler".

A host whose NVLink domain is not known yet (fabric registration not finished, no clique label, in
no block) is an error naming it; with ``skip_unready=True`` (``placement cluster --skip-unready``)
it is left out of the file and each such host is reported by one :class:`UnreadyHostWarning`.
A host in its domain with some GPUs unusable keeps the others (``unavailable_gpus``), with one
:class:`UnusableGpuWarning` naming the GPUs and why; both are :class:`DiscoveryWarning`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from placement.sources.discovery.common import (
    DEFAULT_GPU_HBM_GB,
    DEFAULT_NVLINK_GBPS,
    DEFAULT_SCALEOUT_GBPS,
    Discovered,
    DiscoveryWarning,
    UnreadyHostWarning,
    UnusableGpuWarning,
    cluster_document,
    natural_key,
    write_cluster,
)
from placement.sources.discovery.hostlist import expand_hostlist
from placement.sources.discovery.kubernetes import parse_kubernetes
from placement.sources.discovery.nvidia_smi import parse_nvidia_smi
from placement.sources.discovery.slurm import parse_slurm, slurm_texts
from placement.core.model import InvalidInputError

__all__ = [
    "SOURCES",
    "Discovered",
    "DiscoveryWarning",
    "UnreadyHostWarning",
    "UnusableGpuWarning",
    "cluster_from_slurm",
    "cluster_from_kubernetes",
    "cluster_from_nvidia_smi",
    "cluster_document",
    "write_cluster",
    "expand_hostlist",
    "read_text",
    "DEFAULT_NVLINK_GBPS",
    "DEFAULT_SCALEOUT_GBPS",
    "DEFAULT_GPU_HBM_GB",
]

SOURCES = ("slurm", "kubernetes", "nvidia-smi")
MAX_TEXT_BYTES = 2**28


def read_text(path: str | os.PathLike[str]) -> str:
    """A scheduler output file as text; errors name the file."""
    where = Path(path)
    try:
        if not where.is_file():
            raise InvalidInputError(f"{where}: not a file")
        if where.stat().st_size > MAX_TEXT_BYTES:
            raise InvalidInputError(f"{where}: larger than {MAX_TEXT_BYTES} bytes")
        return where.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{where}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:
        raise InvalidInputError(f"{where}: {exc.strerror or exc}") from None


def _links(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: kw[k] for k in ("nvlink_gbps", "scaleout_gbps", "gpu_hbm_gb", "hbm_reserve_gb") if k in kw}


def _document(found: Discovered, name: str, links: dict[str, Any]) -> dict[str, Any]:
    """The cluster document, after one :class:`UnreadyHostWarning` per host left out and one
    :class:`UnusableGpuWarning` per host with unusable GPUs the scheduler has not downed."""
    doc = cluster_document(found, name=name, **_links(links))
    for host in sorted(found.left_out, key=natural_key):
        warnings.warn(f"left out: {found.left_out[host]}", UnreadyHostWarning, stacklevel=3)
    for line in found.warnings():
        warnings.warn(f"unusable: {line}", UnusableGpuWarning, stacklevel=3)
    return doc


def cluster_from_slurm(
    inputs: Sequence[str | os.PathLike[str]] = (),
    *,
    name: str = "slurm",
    gpus_per_node: int | None = None,
    allow_not_responding: bool = False,
    skip_unready: bool = False,
    **links: Any,
) -> dict[str, Any]:
    """The cluster file's document from Slurm.

    Parameters
    ----------
    inputs : files holding ``scontrol show topology`` output or ``topology.conf`` (one), and
        ``scontrol show node`` output (optional); empty: run both ``scontrol`` commands.
    gpus_per_node : GPUs of every node when no node output is given.
    allow_not_responding : count nodes whose slurmd does not answer (``NOT_RESPONDING``, ``*``)
        as usable (a plan made while the daemons are stopped); their other states still count.
    skip_unready : leave out nodes with GPUs in no block or leaf switch (one
        :class:`UnreadyHostWarning` each) instead of refusing them.
    links : ``nvlink_gbps``, ``scaleout_gbps``, ``gpu_hbm_gb``, ``hbm_reserve_gb`` (defaults:
        GB300 NVL72).

    Raises
    ------
    InvalidInputError
        One line naming the file and line, or the host.
    """
    texts = [(str(p), read_text(p)) for p in inputs] if inputs else slurm_texts()
    found = parse_slurm(texts, gpus_per_node=gpus_per_node, allow_not_responding=allow_not_responding,
                        skip_unready=skip_unready)
    return _document(found, name, links)


def cluster_from_kubernetes(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    name: str = "kubernetes",
    down_taints: Sequence[str] = (),
    skip_unready: bool = False,
    **links: Any,
) -> dict[str, Any]:
    """The cluster file's document from ``kubectl get nodes -o json`` outputs (see
    :mod:`placement.sources.discovery.kubernetes` for the labels and what counts as down).
    ``skip_unready``: leave out GPU nodes without a clique label (one :class:`UnreadyHostWarning`
    each) instead of refusing them."""
    if not inputs:
        raise InvalidInputError("kubernetes: give the output of 'kubectl get nodes -o json' as a file")
    found = parse_kubernetes([(str(p), read_text(p)) for p in inputs], down_taints=tuple(down_taints),
                             skip_unready=skip_unready)
    return _document(found, name, links)


def cluster_from_nvidia_smi(
    inputs: Sequence[str | os.PathLike[str]], *, name: str = "nvidia-smi", skip_unready: bool = False, **links: Any
) -> dict[str, Any]:
    """The cluster file's document from ``nvidia-smi -q`` outputs, one per host: ``HOST=PATH``, or
    a path whose file name without extension is the host name; or ``pdsh``/``clush`` outputs of
    several hosts (every line prefixed ``host: ``).  ``skip_unready``: leave out hosts none of whose
    GPUs is registered in an NVLink fabric (one :class:`UnreadyHostWarning` each) instead of
    refusing them."""
    if not inputs:
        raise InvalidInputError("nvidia-smi: give one 'nvidia-smi -q' output per host (HOST=PATH or HOST.txt)")
    from placement.sources.discovery.nvidia_smi import split_pdsh

    triples = []
    for item in inputs:
        text = str(item)
        host, eq, path = text.partition("=")
        if not eq:
            pdsh = split_pdsh(text, read_text(text))
            if pdsh is not None:
                triples.extend(pdsh)
                continue
            host, path = Path(text).name.split(".", 1)[0], text
        if not host:
            raise InvalidInputError(f"nvidia-smi: {text!r}: no host name")
        triples.append((host, path, read_text(path)))
    return _document(parse_nvidia_smi(triples, skip_unready=skip_unready), name, links)
