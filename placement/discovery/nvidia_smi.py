"""A cluster from ``nvidia-smi -q`` run on every host.

Each GPU's section of ``nvidia-smi -q`` (``GPU 00000000:01:00.0``) has a ``Fabric`` subsection
on NVLink-fabric systems (GB200/GB300)::

    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : 1
        ClusterUUID                       : 8a2c3a37-...
        Health
            ...

The GPUs of one NVLink domain share ClusterUUID and CliqueId.  A GPU whose fabric ``State`` is not
``Completed`` or whose ``Status`` is not ``Success`` is unusable (its fabric registration has not
finished or failed).  The output carries no host name: each input is ``HOST=PATH``, or a file
named after its host (``gb001.txt`` -> ``gb001``), or one ``pdsh -w HOSTS nvidia-smi -q`` output
whose lines carry a ``host: `` prefix.  A host whose GPUs disagree on the clique, or
with a GPU without a Fabric section, is an error naming the host and line.
"""

from __future__ import annotations

import re

from placement.discovery.common import Discovered, natural_key
from placement.model import InvalidInputError

__all__ = ["parse_nvidia_smi", "split_pdsh"]

_GPU = re.compile(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]\s*$")
_FIELD = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")


def _gpu_sections(host: str, label: str, text: str) -> list[tuple[int, dict[str, str]]]:
    """Per GPU: its line and its Fabric fields (State, Status, CliqueId, ClusterUUID)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _GPU.match(line)]
    if not starts:
        raise InvalidInputError(f"{label}: host {host}: no 'GPU <bus id>' section (not nvidia-smi -q output?)")
    out: list[tuple[int, dict[str, str]]] = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        fabric: dict[str, str] = {}
        indent: int | None = None
        for line in lines[s + 1 : end]:
            if indent is None:
                if line.strip() == "Fabric":
                    indent = len(line) - len(line.lstrip())
                continue
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            if depth <= indent:
                break
            m = _FIELD.match(line)
            if m and m.group(3):
                fabric.setdefault(m.group(2), m.group(3))
        out.append((s + 1, fabric))
    return out


_PDSH = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*): ?(.*)$")


def split_pdsh(label: str, text: str) -> list[tuple[str, str, str]] | None:
    """``pdsh -w HOSTS nvidia-smi -q`` (or clush) output, each line prefixed ``host: ``, as
    ``(host, label, text)`` per host in order of first appearance; ``None`` when ``text`` is not
    prefixed so (a plain ``nvidia-smi -q``)."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first or _GPU.match(first) or first.startswith("=") or not _PDSH.match(first):
        return None
    per: dict[str, list[str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _PDSH.match(line)
        if not m:
            raise InvalidInputError(f"{label}:{n}: expected a 'host: ' prefix as on every other line, found {line[:60]!r}")
        per.setdefault(m.group(1), []).append(m.group(2))
    return [(host, f"{label} ({host})", "\n".join(lines)) for host, lines in per.items()]


def parse_nvidia_smi(texts: list[tuple[str, str, str]]) -> Discovered:
    """A :class:`Discovered` cluster from ``(host, label, text)`` triples of ``nvidia-smi -q``."""
    cliques: dict[tuple[str, int], list[str]] = {}
    gpus: dict[str, int] = {}
    down_gpus: dict[str, list[int]] = {}
    for host, label, text in texts:
        if host in gpus:
            raise InvalidInputError(f"{label}: host {host} given twice")
        keys: set[tuple[str, int]] = set()
        sections = _gpu_sections(host, label, text)
        for local, (line, fab) in enumerate(sections):
            where = f"{label}:{line}: host {host} GPU {local}"
            for key in ("ClusterUUID", "CliqueId", "State"):
                if key not in fab:
                    raise InvalidInputError(f"{where}: Fabric {key} missing (no NVLink fabric, or truncated?)")
            if fab["State"] == "N/A" or fab["CliqueId"] == "N/A":
                raise InvalidInputError(f"{where}: Fabric State {fab['State']}, CliqueId {fab['CliqueId']}: not on an NVLink fabric")
            if not fab["CliqueId"].isdigit():
                raise InvalidInputError(f"{where}: Fabric CliqueId {fab['CliqueId']!r} is not a number")
            if fab["State"] not in ("Completed", "In Progress", "Not Started", "Not Supported"):
                raise InvalidInputError(f"{where}: unknown Fabric State {fab['State']!r}")
            keys.add((fab["ClusterUUID"], int(fab["CliqueId"])))
            if fab["State"] != "Completed" or fab.get("Status", "Success") != "Success":
                down_gpus.setdefault(host, []).append(local)
        if len(keys) != 1:
            raise InvalidInputError(f"{label}: host {host}: its GPUs are in {len(keys)} NVLink cliques {sorted(keys)}")
        gpus[host] = len(sections)
        cliques.setdefault(keys.pop(), []).append(host)
    if not gpus:
        raise InvalidInputError("nvidia-smi: no host given")
    domains = [(f"{uuid}.{cid}", sorted(hosts, key=natural_key)) for (uuid, cid), hosts in sorted(cliques.items())]
    down_hosts = {h: "fabric not ready on every GPU" for h, gl in down_gpus.items() if len(gl) == gpus[h]}
    return Discovered(
        "nvidia-smi -q", domains, gpus, down_hosts=down_hosts,
        down_gpus={h: gl for h, gl in down_gpus.items() if h not in down_hosts},
    )
