"""A cluster from ``nvidia-smi -q`` run on every host.

Each GPU's section of ``nvidia-smi -q`` (``GPU 00000000:01:00.0``) has a ``Fabric`` subsection
on NVLink-fabric systems (GB200/GB300); drivers from R570 on print its ``Health`` too (the
``Summary`` line from R580)::

    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : 1
        ClusterUUID                       : 8a2c3a37-...
        Health
            Summary                       : Healthy
            Bandwidth                     : Full
            Route Recovery in progress    : False
            Route Unhealthy               : False
            Access Timeout Recovery       : False

A GPU is registered in an NVLink fabric when its ``State`` is ``Completed``, its ``Status``
``Success`` and its ``ClusterUUID`` a UUID other than all zeros: the test of go-nvlib's
``IsFabricAttached`` (``pkg/nvlib/device/device.go``, NVIDIA/go-nvlib), which GPU feature
discovery uses before it writes the ``nvidia.com/gpu.clique`` label, so the two sources agree.  The
registered GPUs of one NVLink domain share ClusterUUID and CliqueId.  What drivers print otherwise:

- registration still running: ``State : In Progress`` with ``CliqueId`` and ``ClusterUUID``
  ``N/A`` (NVIDIA/gpu-operator#2511);
- registration failed: ``State : Completed``, ``Status : Insufficient Resources``, ``CliqueId :
  0``, ``ClusterUUID : 00000000-0000-0000-0000-000000000000`` (Azure/azhpc-images#506);
- no fabric at all (H100 and older): ``N/A`` everywhere.

Such a GPU is never read as a clique: it is unusable.  A registered GPU whose ``Health`` says
``Summary : Unhealthy`` (kubernetes-sigs/dra-driver-nvidia-gpu#626 shows one) or ``Route Unhealthy
: True`` is unusable too, as is one the driver asks to recover first (``GPU Recovery Action``
other than ``None``: ``Reset``, ``Node Reboot``, ``Drain P2P``, ``Drain and Reset``; or, on drivers
before R570, ``GPU Reset Status`` ``Reset Required : Yes`` / ``Drain and Reset Recommended :
Yes``).  An unusable GPU of a host whose other GPUs say its domain is left out on
its own (``unavailable_gpus``, one warning line per host naming the GPUs; the rule of
:meth:`placement.sources.discovery.common.Discovered.unusable_at`): it never stops the cluster file.  A
host none of whose GPUs is registered has no known domain: an error naming it and
``--skip-unready``, or with ``skip_unready`` left out with a warning.

The output carries no host name: each input is ``HOST=PATH``, or a file named after its host
(``gb001.txt`` -> ``gb001``), or one ``pdsh -w HOSTS nvidia-smi -q`` output whose lines carry a
``host: `` prefix.  A host whose registered GPUs disagree on the clique, a GPU without the four
Fabric fields, or a field that is neither a value nvidia-smi prints nor ``N/A``, is an error naming
the host and line.
"""

from __future__ import annotations

import re

from placement.sources.discovery.common import Discovered, natural_key, settle_unready
from placement.core.model import InvalidInputError

__all__ = ["parse_nvidia_smi", "split_pdsh"]

_GPU = re.compile(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]\s*$")
_FIELD = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")


def _gpu_sections(host: str, label: str, text: str) -> list[tuple[int, dict[str, str], dict[str, str]]]:
    """Per GPU: its line, its Fabric fields (``State``, ``Status``, ``CliqueId``, ``ClusterUUID``,
    ``Health/Summary``, ``Health/Route Unhealthy``, ...) and its other fields by path
    (``GPU Recovery Action``, ``GPU Reset Status/Reset Required``, ...); the first of a repeated
    path counts."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _GPU.match(line)]
    if not starts:
        raise InvalidInputError(f"{label}: host {host}: no 'GPU <bus id>' section (not nvidia-smi -q output?)")
    out: list[tuple[int, dict[str, str], dict[str, str]]] = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        fields: dict[str, str] = {}
        stack: list[tuple[int, str]] = []  # the subsections (Fabric, Health, ...) a line is in
        for line in lines[s + 1 : end]:
            if not line.strip():
                continue
            depth = len(line) - len(line.lstrip())
            while stack and stack[-1][0] >= depth:
                stack.pop()
            m = _FIELD.match(line)
            if m and m.group(3):
                fields.setdefault("/".join([name for _, name in stack] + [m.group(2)]), m.group(3))
            else:
                stack.append((depth, m.group(2) if m else line.strip()))
        fabric = {key[len("Fabric/"):]: v for key, v in fields.items() if key.startswith("Fabric/")}
        out.append((s + 1, fabric, fields))
    return out


# What nvidia-smi prints for a GPU the driver asks to recover (``GPU Recovery Action``: None,
# Reset, Node Reboot, Drain P2P, Drain and Reset; R565 on) and, before R570 deprecated them, the
# ``GPU Reset Status`` lines ``Reset Required`` / ``Drain and Reset Recommended`` (Yes/No).
_NO_RECOVERY = ("None", "N/A", "Not Supported", "[Not Supported]")
_RESET_FIELDS = ("GPU Reset Status/Reset Required", "GPU Reset Status/Drain and Reset Recommended")


def _recovery(fields: dict[str, str]) -> str | None:
    """Why the driver says the GPU needs recovering before it runs work, or None."""
    action = fields.get("GPU Recovery Action", "None")
    if action not in _NO_RECOVERY:
        return f"GPU Recovery Action {action}"
    for key in _RESET_FIELDS:
        if fields.get(key) == "Yes":
            return f"{key.replace('/', ' ')} Yes"
    return None


_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_STATES = ("Completed", "In Progress", "Not Started", "Not Supported", "N/A")


def _registered(fab: dict[str, str]) -> bool:
    """go-nvlib's ``IsFabricAttached``: Completed, Success and a non-zero cluster UUID."""
    uuid = fab["ClusterUUID"]
    return (
        fab["State"] == "Completed" and fab["Status"] == "Success" and uuid != "N/A"
        and uuid.strip("0-") != "" and fab["CliqueId"].isdigit()
    )


def _unhealthy(fab: dict[str, str]) -> bool:
    return fab.get("Health/Summary") == "Unhealthy" or fab.get("Health/Route Unhealthy") == "True"


def _why(fab: dict[str, str]) -> str:
    """Why a GPU is not registered, in the fields that say so."""
    if fab["State"] in ("N/A", "Not Supported"):
        kind = "no NVLink fabric"
    else:
        kind = "registration not finished" if fab["State"] != "Completed" else "registration failed"
    return f"Fabric State {fab['State']}, Status {fab['Status']}, CliqueId {fab['CliqueId']}, ClusterUUID {fab['ClusterUUID']} ({kind})"


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


def parse_nvidia_smi(texts: list[tuple[str, str, str]], *, skip_unready: bool = False) -> Discovered:
    """A :class:`Discovered` cluster from ``(host, label, text)`` triples of ``nvidia-smi -q``.

    ``skip_unready``: leave out a host none of whose GPUs is registered in an NVLink fabric
    (``Discovered.left_out``) instead of refusing it.
    """
    cliques: dict[tuple[str, int], list[str]] = {}
    gpus: dict[str, int] = {}
    faulty: dict[str, str] = {}
    unusable: dict[str, tuple[int, ...]] = {}
    unready: dict[str, str] = {}
    for host, label, text in texts:
        if host in gpus or host in unready:
            raise InvalidInputError(f"{label}: host {host} given twice")
        keys: set[tuple[str, int]] = set()
        bad: list[str] = []
        bad_local: list[int] = []
        sections = _gpu_sections(host, label, text)
        for local, (line, fab, fields) in enumerate(sections):
            where = f"{label}:{line}: host {host} GPU {local}"
            for key in ("State", "Status", "CliqueId", "ClusterUUID"):
                if key not in fab:
                    raise InvalidInputError(f"{where}: Fabric {key} missing (no NVLink fabric, or truncated?)")
            if fab["State"] not in _STATES:
                raise InvalidInputError(f"{where}: unknown Fabric State {fab['State']!r}")
            if not (fab["CliqueId"].isdigit() or fab["CliqueId"] == "N/A"):
                raise InvalidInputError(f"{where}: Fabric CliqueId {fab['CliqueId']!r} is not a number")
            if not (_UUID.match(fab["ClusterUUID"]) or fab["ClusterUUID"] == "N/A"):
                raise InvalidInputError(f"{where}: Fabric ClusterUUID {fab['ClusterUUID']!r} is not a UUID")
            if not _registered(fab):
                bad.append(f"GPU {local}: {_why(fab)}")
                bad_local.append(local)
                continue
            keys.add((fab["ClusterUUID"].lower(), int(fab["CliqueId"])))
            if _unhealthy(fab):
                health = "Summary Unhealthy" if fab.get("Health/Summary") == "Unhealthy" else "Route Unhealthy True"
                bad.append(f"GPU {local}: Fabric Health {health}")
                bad_local.append(local)
            elif (recover := _recovery(fields)) is not None:
                bad.append(f"GPU {local}: {recover}")
                bad_local.append(local)
        if len(keys) > 1:
            raise InvalidInputError(f"{label}: host {host}: its GPUs are in {len(keys)} NVLink cliques {sorted(keys)}")
        if not keys:
            unready[host] = f"{label}:{sections[0][0]}: host {host}: no GPU registered in an NVLink fabric; {bad[0]}"
            continue
        gpus[host] = len(sections)
        cliques.setdefault(keys.pop(), []).append(host)
        if bad:
            faulty[host] = "; ".join(bad)
            unusable[host] = tuple(bad_local)
    left_out = settle_unready(unready, skip_unready)
    if not gpus and not left_out:
        raise InvalidInputError("nvidia-smi: no host given")
    domains = [(f"{uuid}.{cid}", sorted(hosts, key=natural_key)) for (uuid, cid), hosts in sorted(cliques.items())]
    return Discovered("nvidia-smi -q", domains, gpus, faulty=faulty, left_out=left_out, unusable=unusable)
