"""A cluster from Slurm: ``scontrol show topology`` (or ``topology.conf``) and ``scontrol show node``.

NVLink domains are the topology's racks:

- ``topology/block`` (Slurm 23.11 and later, the plugin for NVL72 racks): one domain per block.
  ``scontrol show topology`` prints ``BlockName=b1 BlockIndex=0 Nodes=gb[001-018] BlockSize=18``
  per block; ``topology.conf`` has ``BlockName=b1 Nodes=gb[001-018]`` lines and ``BlockSizes=18``.
  The block size (the first of ``BlockSizes``) is the trays per domain.  ``AggregatedBlock=`` lines
  (higher-level blocks of several base blocks) are checked and skipped.  The printed format is
  Slurm's ``_print_topo_record`` (``src/plugins/topology/block/topology_block.c`` @284c3b9).
- ``topology/tree``: one domain per leaf switch (a ``SwitchName`` line with ``Nodes`` and no
  ``Switches``): ``SwitchName=rack00 Level=0 LinkSpeed=1 Nodes=gb[001-018]``.

``scontrol show node`` gives each node's ``State`` and ``Gres`` (``gpu:4``, ``gpu:gb200:4(S:0-1)``).
A node is unusable when its state's base or any flag says so (DOWN, DRAIN, DRAINED, DRAINING,
FAIL, FAILING, ERROR, FUTURE, MAINTENANCE (sinfo's ``maint``), NOT_RESPONDING or a ``*`` suffix,
POWERED_DOWN, POWERING_DOWN, REBOOT_REQUESTED, REBOOT_ISSUED, INVALID_REG, BLOCKED, EXTERNAL): the
words of ``node_states`` / ``node_state_flags`` in ``src/common/slurm_protocol_defs.c``
(SchedMD/slurm @284c3b9), which print a node in a maintenance reservation as
``IDLE+MAINTENANCE+RESERVED``.  IDLE, ALLOCATED, MIXED, COMPLETING, RESERVED, PLANNED and UNKNOWN
(the controller has not heard from it since it started) are usable: the allocation (``placement
solve --allocation``) says which of them the job has.  A node with fewer GPUs (``Gres``) than the others
keeps them: only the GPUs it lacks, its highest local indices, are down
(:meth:`placement.sources.discovery.common.Discovered.unusable_at`).  Any other state
word is an error naming the node and line, as is a block's node missing from the node list, or a
record cut short; a node with GPUs that is in no block or switch has no known domain: an error
naming it, or with ``skip_unready`` left out with a warning.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from placement.sources.discovery.common import Discovered, settle_unready
from placement.sources.discovery.hostlist import expand_hostlist
from placement.core.model import InvalidInputError

__all__ = [
    "parse_slurm",
    "slurm_texts",
    "node_state_usable",
    "USABLE_STATES",
    "UNUSABLE_STATES",
]

USABLE_STATES = frozenset({
    "IDLE", "ALLOCATED", "ALLOC", "MIXED", "MIX", "COMPLETING", "COMP", "UNKNOWN", "UNK", "RESERVED",
    "RESV", "PLANNED", "PLND", "CLOUD", "DYNAMIC_NORM", "POWERING_UP", "POWER_UP", "RESUME",
    "REBOOT_CANCELED", "UNDRAIN",
})
UNUSABLE_STATES = frozenset({
    "DOWN", "DRAIN", "DRAINED", "DRAINING", "DRNG", "DRAIN_MAINT", "FAIL", "FAILING", "ERROR", "FUTURE",
    "FUTR", "MAINT", "MAINTENANCE", "NOT_RESPONDING", "NO_RESPOND", "POWERED_DOWN", "POWER_DOWN",
    "POWERING_DOWN", "POWERED_OFF", "REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT", "INVALID_REG", "INVAL",
    "BLOCKED", "DYNAMIC_FUTURE", "EXTERNAL",
})
_SUFFIXES = "*~#!%$@^-"  # sinfo-style state suffixes; '*' = not responding


def node_state_usable(state: str, *, allow_not_responding: bool = False) -> tuple[bool, str]:
    """Whether a node in Slurm state ``state`` (``IDLE``, ``DOWN+DRAIN``, ``IDLE*``) can run the job.

    Returns ``(usable, why)``; raises ``ValueError`` on a state word Slurm does not have.
    """
    words = [w for w in state.strip().upper().split("+")]
    if not state.strip() or any(not w for w in words):
        raise ValueError(f"empty state in {state!r}")
    bad: list[str] = []
    for word in words:
        core = word.rstrip(_SUFFIXES)
        marks = word[len(core):]
        if "*" in marks and not allow_not_responding:
            bad.append("NOT_RESPONDING")
        if core in USABLE_STATES:
            continue
        if core not in UNUSABLE_STATES:
            raise ValueError(f"unknown state {word!r}")
        if core in ("NOT_RESPONDING", "NO_RESPOND") and allow_not_responding:
            continue
        bad.append(core)
    return (not bad, "+".join(bad))


_PAIR = re.compile(r"(?:^|\s)([A-Za-z_]+)=(\S*)")


def _pairs(line: str) -> dict[str, str]:
    return {k.lower(): v for k, v in _PAIR.findall(line)}


def _gpus_of_gres(gres: str) -> int:
    """GPUs in a ``Gres`` value: ``gpu:4``, ``gpu:gb200:4(S:0-1)``, ``gpu:4,shard:8``, ``(null)``."""
    if gres in ("", "(null)"):
        return 0
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        item = item.split("(", 1)[0]
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) < 2:
            total += 1  # "gpu" alone: one
            continue
        count = parts[-1]
        if not count.isdigit():
            count = "1" if len(parts) == 2 else ""
        if not count:
            raise ValueError(f"GPU count missing in {item!r}")
        total += int(count)
    return total


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines without comments, backslash continuations joined, with their 1-based numbers."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip():
            out.append((start, line))
    if pending.strip():
        out.append((start, pending))
    return out


def _parse_topology(label: str, text: str) -> tuple[list[tuple[str, list[str]]], int | None, str]:
    """Domains, block size (or None) and the plugin ('block' or 'tree') of a topology text."""
    blocks: list[tuple[int, str, list[str]]] = []
    leaves: list[tuple[str, list[str]]] = []
    block_size: int | None = None
    for n, line in _logical_lines(text):
        kv = _pairs(line)
        where = f"{label}:{n}"
        try:
            if "aggregatedblock" in kv:  # a higher-level block (BlockSizes beyond the first): its
                expand_hostlist(kv.get("nodes", ""))  # base blocks are the domains; checked, skipped
                continue
            if "blockname" in kv:
                printed = "blockindex" in kv  # scontrol prints BlockSize last on every block line
                if printed and "blocksize" not in kv:
                    raise InvalidInputError(f"{where}: block {kv['blockname']!r} without BlockSize= (truncated?)")
                if "nodes" not in kv:
                    if printed:
                        continue  # a block without nodes (scontrol omits Nodes=)
                    raise InvalidInputError(f"{where}: block {kv['blockname']!r} without Nodes=")
                hosts = expand_hostlist(kv["nodes"])
                index = kv.get("blockindex", str(len(blocks)))
                if not index.isdigit():
                    raise InvalidInputError(f"{where}: BlockIndex={index!r} is not a number")
                if "blocksize" in kv:
                    size = kv["blocksize"]
                    if not size.isdigit() or int(size) < 1:
                        raise InvalidInputError(f"{where}: BlockSize={size!r} is not a positive number")
                    block_size = int(size) if block_size is None else block_size
                blocks.append((int(index), kv["blockname"], hosts))
            elif "blocksizes" in kv:
                first = kv["blocksizes"].split(",")[0]
                if not first.isdigit() or int(first) < 1:
                    raise InvalidInputError(f"{where}: BlockSizes={kv['blocksizes']!r}: expected positive numbers")
                block_size = int(first)
            elif "switchname" in kv:
                if "switches" in kv:
                    expand_hostlist(kv["switches"])  # an upper switch: checked, not a domain
                    continue
                if "nodes" not in kv:
                    raise InvalidInputError(f"{where}: switch {kv['switchname']!r} has neither Nodes= nor Switches= (truncated?)")
                leaves.append((kv["switchname"], expand_hostlist(kv["nodes"])))
            else:
                raise InvalidInputError(
                    f"{where}: expected BlockName=, AggregatedBlock=, BlockSizes= or SwitchName=, found {line.strip()[:60]!r}"
                )
        except InvalidInputError as exc:
            msg = str(exc)
            raise InvalidInputError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    if blocks and leaves:
        raise InvalidInputError(f"{label}: both blocks and switches; give one topology")
    if blocks:
        blocks.sort(key=lambda b: b[0])
        return [(name, hosts) for _, name, hosts in blocks], block_size, "block"
    if not leaves:
        raise InvalidInputError(f"{label}: no BlockName= or SwitchName= line (empty or truncated?)")
    return leaves, None, "tree"


def _parse_nodes(label: str, text: str, allow_not_responding: bool) -> tuple[dict[str, int], dict[str, str], dict[str, int]]:
    """GPUs, unusable nodes (with the reason) and the line of each node of ``scontrol show node``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("NodeName=")]
    if not starts:
        raise InvalidInputError(f"{label}: no NodeName= record (empty or not scontrol show node output?)")
    gpus: dict[str, int] = {}
    down: dict[str, str] = {}
    at: dict[str, int] = {}
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        record = " ".join(lines[s:end])
        kv = _pairs(record)
        node = kv.get("nodename", "")
        where = f"{label}:{s + 1}"
        if not node:
            raise InvalidInputError(f"{where}: empty NodeName=")
        if node in gpus:
            raise InvalidInputError(f"{where}: node {node} listed twice")
        if "state" not in kv:
            raise InvalidInputError(f"{where}: node {node}: no State= (truncated record?)")
        try:
            usable, why = node_state_usable(kv["state"], allow_not_responding=allow_not_responding)
        except ValueError as exc:
            raise InvalidInputError(f"{where}: node {node}: State={kv['state']}: {exc}") from None
        try:
            gpus[node] = _gpus_of_gres(kv.get("gres", "(null)"))
        except ValueError as exc:
            raise InvalidInputError(f"{where}: node {node}: Gres={kv.get('gres')}: {exc}") from None
        if not usable:
            down[node] = why
        at[node] = s + 1
    return gpus, down, at


def slurm_texts() -> list[tuple[str, str]]:
    """Run ``scontrol show topology`` and ``scontrol show node`` (the ``SLURM_CONF`` cluster)."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise InvalidInputError("scontrol not found on PATH: give the outputs of 'scontrol show topology' and 'scontrol show node' as files")
    out: list[tuple[str, str]] = []
    for what in ("topology", "node"):
        try:
            run = subprocess.run([exe, "show", what], capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InvalidInputError(f"scontrol show {what}: {exc}") from None
        if run.returncode != 0:
            err = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[0]
            raise InvalidInputError(f"scontrol show {what}: {err}")
        out.append((f"scontrol show {what}", run.stdout))
    return out


def parse_slurm(
    texts: list[tuple[str, str]],
    *,
    gpus_per_node: int | None = None,
    allow_not_responding: bool = False,
    skip_unready: bool = False,
) -> Discovered:
    """A :class:`Discovered` cluster from ``(label, text)`` pairs: one topology text (``scontrol
    show topology`` output or ``topology.conf``) and optionally ``scontrol show node`` output.

    Without node output every node is usable with ``gpus_per_node`` GPUs.  ``skip_unready``: leave
    out nodes with GPUs that are in no block or leaf switch (``Discovered.left_out``) instead of
    refusing them.
    """
    topo: list[tuple[str, str]] = []
    nodes: list[tuple[str, str]] = []
    for label, text in texts:
        if re.search(r"(?im)^\s*NodeName=\S+", text) and re.search(r"(?m)\bState=", text):
            nodes.append((label, text))
        elif re.search(r"(?im)^\s*(BlockName|SwitchName|BlockSizes)\s*=", text):
            topo.append((label, text))
        else:
            raise InvalidInputError(f"{label}: neither scontrol show topology / topology.conf nor scontrol show node output")
    if len(topo) != 1:
        raise InvalidInputError(f"slurm: expected one topology text (scontrol show topology or topology.conf), found {len(topo)}")
    if len(nodes) > 1:
        raise InvalidInputError(f"slurm: expected at most one scontrol show node output, found {len(nodes)}")
    t_label, t_text = topo[0]
    domains, size, plugin = _parse_topology(t_label, t_text)
    where = {h: name for name, hosts in domains for h in hosts}
    if not nodes:
        if gpus_per_node is None or gpus_per_node < 1:
            raise InvalidInputError("slurm: without scontrol show node output, give the GPUs per node (--gpus-per-node)")
        gpus = {h: gpus_per_node for h in where}
        return Discovered(f"{t_label} (topology/{plugin})", domains, gpus, tray_slots=size)
    n_label, n_text = nodes[0]
    gpus, down, at = _parse_nodes(n_label, n_text, allow_not_responding)
    for name, hosts in domains:
        for h in hosts:
            if h not in gpus:
                raise InvalidInputError(f"{t_label}: node {h} of {name!r} is not in {n_label} (truncated?)")
    kind = "block" if plugin == "block" else "leaf switch"
    unready = {h: f"{n_label}:{at[h]}: node {h} has {gpus[h]} GPUs but is in no {kind} of {t_label}"
               for h in gpus if h not in where and gpus[h] > 0}
    left_out = settle_unready(unready, skip_unready)
    return Discovered(
        f"{t_label} + {n_label} (topology/{plugin})",
        domains,
        {h: gpus[h] for h in where},
        down_hosts={h: why for h, why in down.items() if h in where},
        left_out=left_out,
        tray_slots=size,
    )
