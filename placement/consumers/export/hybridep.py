"""DeepEP HybridEP / Megatron-Core ``flex``: the environment HybridEP reads (chosen per rank when EP
groups differ), as a POSIX ``sh`` file, and readers for it."""

from __future__ import annotations

import re
import shlex

import numpy as np

from placement.core.model import InfeasibleError, Instance, InvalidInputError, Placement


def hybridep_rank2n(instance: Instance, placement: Placement) -> np.ndarray:
    """(world,) ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` for each global rank's EP group.

    HybridEP numbers the ranks of an EP group ``local = rank % n``, ``node = rank // n``
    (deepseek-ai/DeepEP hybrid-ep @94a9f8f, ``deep_ep/hybrid_ep_buffer.py``) and needs every node
    inside one NVLink domain; two nodes talk over RDMA, even inside one domain.  ``n`` is the
    largest such value, the gcd of the group's runs of consecutive EP ranks per domain
    (:func:`placement.core.dispatch.node_size`): a group with equal consecutive slices per domain gets
    its slice; an unequal split (8/56) runs smaller nodes (8), exactly as :func:`placement.predict.cost.evaluate`
    prices it.  Every layout is runnable this way (``n = 1`` at worst).
    """
    from placement.core.dispatch import node_size

    cl, par = instance.cluster, instance.parallel
    rank2n = np.zeros(par.world_size, dtype=np.int64)
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    for s in range(par.pp):
        for ranks in par.stage_ep_groups[s]:
            rank2n[ranks] = node_size(cl.gpu2domain[r2g[ranks]], "hybridep")
    return rank2n


def hybridep_small_node_groups(instance: Instance, placement: Placement) -> list[str]:
    """One line per EP group that HybridEP runs with nodes smaller than its part of a domain."""
    cl, par = instance.cluster, instance.parallel
    rank2n = hybridep_rank2n(instance, placement)
    out = []
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    for s in range(par.pp):
        for gi, ranks in enumerate(par.stage_ep_groups[s]):
            doms = cl.gpu2domain[r2g[ranks]]
            n = int(rank2n[ranks[0]])
            counts = np.unique(doms, return_counts=True)[1]
            if (counts != n).any():
                out.append(f"stage {s} EP group {gi}: {counts.tolist()} ranks per domain, nodes of {n}")
    return out


def hybridep_env(instance: Instance, placement: Placement, rank: int | None = None) -> dict[str, str]:
    """The environment HybridEP reads, for one global ``rank`` (or for all, when they agree).

    ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` (current DeepEP and Megatron-Core), ``USE_MNNVL``
    (1 when an NVLink domain spans several trays: fabric memory handles), ``NVLINK_DOMAIN_SIZE``
    (GPUs per NVLink domain, read by earlier HybridEP versions).

    Raises
    ------
    InfeasibleError
        ``rank`` is None and the EP groups need different values (use :func:`hybridep_env_text`,
        which chooses by rank).
    """
    rank2n = hybridep_rank2n(instance, placement)
    if rank is None:
        values = sorted(set(rank2n.tolist()))
        if len(values) > 1:
            raise InfeasibleError(
                f"hybridep: EP groups need different NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN values {values}: "
                "give a rank, or write the per-rank file"
            )
        n = values[0]
    else:
        n = int(rank2n[rank])
    cl = instance.cluster
    return {
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": str(n),
        "USE_MNNVL": "1" if cl.trays_per_domain > 1 else "0",
        "NVLINK_DOMAIN_SIZE": str(cl.gpus_per_domain),
    }


_PER_RANK_LIST = "_placement_hybrid_ep_n"


def hybridep_env_text(instance: Instance, placement: Placement) -> str:
    """A POSIX ``sh`` file to source: :func:`hybridep_env` of every rank.

    When every EP group needs the same value the file is plain ``export NAME=VALUE`` lines (source
    it before the launch).  Otherwise the value is chosen from a per-rank list by the global rank
    (``RANK``, else ``SLURM_PROCID``): source it inside each task.
    """
    rank2n = hybridep_rank2n(instance, placement)
    values = sorted(set(rank2n.tolist()))
    par = instance.parallel
    head = f"# HybridEP layout for instance {instance.name} (sha256 {instance.sha256[:16]}...), written by placement export"
    env = hybridep_env(instance, placement, rank=0)
    small = hybridep_small_node_groups(instance, placement)
    if small:
        head += (f"\n# {len(small)} EP group(s) run nodes smaller than their part of an NVLink domain (RDMA between "
                 f"nodes of one domain), e.g. {small[0]}")
    if len(values) == 1:
        lines = [head, f"# every EP group (ep={par.ep}) runs {par.ep // values[0]} node(s) of {values[0]} consecutive EP ranks, "
                 "each node inside one NVLink domain"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        return "\n".join(lines) + "\n"
    lines = [
        head,
        f"# EP groups (ep={par.ep}) hold {' or '.join(map(str, values))} consecutive EP ranks per NVLink domain, so the",
        "# value depends on the global rank: source this file inside each task, once RANK or SLURM_PROCID is set,",
        "# e.g. srun ... sh -c '. ./hybridep.env && exec python train.py ...'",
        f"{_PER_RANK_LIST}='{' '.join(map(str, rank2n.tolist()))}'",
        '_placement_rank="${RANK:-${SLURM_PROCID:?hybridep env: set RANK or SLURM_PROCID}}"',
        "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=\"$(echo \"$" + _PER_RANK_LIST
        + "\" | cut -d ' ' -f \"$((_placement_rank + 1))\")\"",
        f"export USE_MNNVL={env['USE_MNNVL']}",
        f"export NVLINK_DOMAIN_SIZE={env['NVLINK_DOMAIN_SIZE']}",
        f"unset {_PER_RANK_LIST} _placement_rank",
    ]
    return "\n".join(lines) + "\n"


def parse_hybridep_env_text(text: str, rank: int) -> dict[str, str]:
    """The environment :func:`hybridep_env_text`'s file gives global ``rank``."""
    rows = text.splitlines()
    per_rank = [r for r in rows if r.startswith(f"{_PER_RANK_LIST}=")]
    if not per_rank:
        return parse_env_text(text)
    (values,) = shlex.split(per_rank[0].split("=", 1)[1])
    n_of_rank = values.split(" ")
    if not 0 <= rank < len(n_of_rank):
        raise InvalidInputError(f"env: rank {rank} is outside the file's {len(n_of_rank)} ranks")
    plain = [r for r in rows if r.startswith("export ") and "$(" not in r]
    env = parse_env_text("\n".join(plain))
    return {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": n_of_rank[rank], **env}


def parse_env_text(text: str) -> dict[str, str]:
    """``NAME=VALUE`` pairs from lines ``export NAME=VALUE`` (comments and blank lines skipped)."""
    env: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not m:
            raise InvalidInputError(f"env: line {n}: expected 'export NAME=VALUE', found {line!r}")
        try:
            words = shlex.split(m.group(2))
        except ValueError as exc:
            raise InvalidInputError(f"env: line {n}: {exc}") from None
        if len(words) > 1:
            raise InvalidInputError(f"env: line {n}: expected one value for {m.group(1)}, found {len(words)}")
        env[m.group(1)] = words[0] if words else ""
    return env
