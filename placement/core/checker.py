"""The independent checker: every placement the project emits or reads passes through it.

It shares no code with the solvers: it recomputes what it needs from the instance with plain loops
and sets, and lists every violation it finds (an empty list means valid).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from placement.core.model import SUPPORTED_ETP, Instance, InvalidInputError, Placement

__all__ = [
    "check",
    "check_or_raise",
    "violates_group_preservation",
    "group_breaks",
    "deepep_violations",
    "tp_group_violations",
    "etp_violations",
]


def check(instance: Instance, placement: Placement) -> list[str]:
    """All structural violations of ``placement`` against ``instance``, one message each."""
    out: list[str] = []
    par, cl, m = instance.parallel, instance.cluster, instance.model
    world = par.world_size
    r2g = [int(x) for x in np.asarray(placement.rank2gpu).reshape(-1)]
    if len(r2g) != world:
        out.append(f"rank2gpu: expected {world} ranks (tp*cp*dp*pp), found {len(r2g)}")
    for r, g in enumerate(r2g):
        if not 0 <= g < cl.num_gpus:
            out.append(f"rank2gpu[{r}]: GPU {g} does not exist (cluster has {cl.num_gpus})")
        elif not bool(cl.available[g]):
            out.append(f"rank2gpu[{r}]: GPU {g} is unavailable")
    for g, n in sorted(Counter(r2g).items()):
        if n > 1:
            out.append(f"rank2gpu: GPU {g} runs {n} ranks")
    p2l = np.asarray(placement.phy2log)
    L, E = m.num_moe_layers, m.num_experts
    if p2l.ndim != 2 or p2l.shape[0] != L:
        out.append(f"phy2log: expected {L} MoE layers, found shape {p2l.shape}")
        return out
    if p2l.shape[1] != E:
        out.append(f"phy2log: expected {E} slots per layer (ep x slots per rank), found {p2l.shape[1]}")
        return out
    for li in range(L):
        row = [int(x) for x in p2l[li]]
        counts = Counter(row)
        missing = [e for e in range(E) if counts.get(e, 0) == 0]
        extra = [e for e, c in counts.items() if c > 1 or not 0 <= e < E]
        if missing or extra:
            out.append(
                f"phy2log[{li}]: not a permutation of the {E} experts "
                f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, repeated or invalid {extra[:5]})"
            )
    if placement.pipeline_layout:  # the layout it runs with must fit the instance (Megatron's rules)
        from placement.core.pipeline_layout import with_layout

        try:
            with_layout(instance, placement.pipeline_layout)
        except InvalidInputError as exc:
            out.append(str(exc))
    return out


def check_or_raise(instance: Instance, placement: Placement) -> None:
    """Raise :class:`InvalidInputError` with the first violation (and how many more)."""
    problems = check(instance, placement)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidInputError(problems[0] + more)


def violates_group_preservation(instance: Instance, placement: Placement) -> list[str]:
    """Layers whose permutation moves an expert out of its group block (group-limited routing).

    A group-preserving map sends each group of ``E/G`` contiguous logical ids onto one block of
    ``E/G`` contiguous physical slots (whole groups permute among group positions; experts permute
    inside their group).
    """
    m = instance.model
    return group_breaks(placement.phy2log, m.num_experts, m.num_groups)


def group_breaks(phy2log, num_experts: int, num_groups: int) -> list[str]:
    """Per layer, the first physical block of ``num_experts / num_groups`` slots that mixes groups.

    Parameters
    ----------
    phy2log : array-like, (num_layers, num_experts)
        Logical expert id of each physical slot.
    num_experts, num_groups : int
        Logical expert ``e`` belongs to group ``e // (num_experts // num_groups)``.

    Returns
    -------
    list of str
        One message per layer that breaks a group (empty: every layer is group-preserving).

    Examples
    --------
    >>> group_breaks([[2, 3, 0, 1], [0, 2, 1, 3]], 4, 2)
    ['phy2log[1]: slots 0..1 mix expert groups [0, 1]']
    """
    size = num_experts // num_groups
    out = []
    for li, row in enumerate(np.asarray(phy2log)):
        for b in range(num_groups):
            block = {int(e) // size for e in row[b * size : (b + 1) * size]}
            if len(block) != 1:
                out.append(f"phy2log[{li}]: slots {b * size}..{(b + 1) * size - 1} mix expert groups {sorted(block)}")
                break
    return out


def deepep_violations(instance: Instance, placement: Placement) -> list[str]:
    """EP groups that break DeepEP/HybridEP's rule ``rank == rdma_rank * num_nvl_ranks + nvl_rank``.

    Every EP group must hold the same number of consecutive EP ranks in each NVLink domain it
    touches, and the domains' slices must not interleave.
    """
    par, cl = instance.parallel, instance.cluster
    out = []
    for s in range(par.pp):
        for gi, ranks in enumerate(par.stage_ep_groups[s]):
            doms = [int(cl.gpu2domain[int(placement.rank2gpu[r])]) for r in ranks]
            runs: list[tuple[int, int]] = []
            for d in doms:
                if runs and runs[-1][0] == d:
                    runs[-1] = (d, runs[-1][1] + 1)
                else:
                    runs.append((d, 1))
            sizes = {n for _, n in runs}
            if len(runs) != len({d for d, _ in runs}) or len(sizes) != 1:
                out.append(
                    f"stage {s} EP group {gi}: domains {[d for d, _ in runs]} with slices {[n for _, n in runs]} "
                    "are not equal consecutive slices (DeepEP/HybridEP rule)"
                )
    return out



def tp_group_violations(instance: Instance, placement: Placement) -> list[str]:
    """Tensor- and context-parallel groups placed where their traffic cannot go.

    The rule (docs/formats.md, "Rank layout rules"):

    - ``tp > 1``: each TP group (the ``tp`` ranks that share ``cp``, ``dp`` and ``pp``) lies inside
      one NVLink domain (its all-reduces sit on every layer's critical path and must never cross
      the scale-out fabric) and, when ``tp`` divides ``gpus_per_tray``, inside one tray (one host:
      the launcher's convention, NCCL without multi-node NVLink, one host failure per TP group).
    - ``cp > 1``: each TP x CP group (the ``tp * cp`` ranks that share ``dp`` and ``pp``) lies inside
      one NVLink domain.
    """
    par, cl = instance.parallel, instance.cluster
    if par.tp == 1 and par.cp == 1:
        return []
    r2g = [int(x) for x in np.asarray(placement.rank2gpu).reshape(-1)]
    if len(r2g) != par.world_size or any(not 0 <= g < cl.num_gpus for g in r2g):
        return []  # check() reports these; the groups are not defined
    coords = par.rank_coords
    out: list[str] = []

    def groups(keys: tuple[str, ...]) -> dict[tuple[int, ...], list[int]]:
        found: dict[tuple[int, ...], list[int]] = {}
        for r in range(par.world_size):
            found.setdefault(tuple(int(coords[k][r]) for k in keys), []).append(r)
        return found

    if par.tp > 1:
        same_tray = cl.gpus_per_tray % par.tp == 0
        for key, ranks in sorted(groups(("cp", "dp", "pp")).items()):
            doms = sorted({int(cl.gpu2domain[r2g[r]]) for r in ranks})
            hosts = sorted({int(cl.gpu2host[r2g[r]]) for r in ranks})
            where = f"TP group of ranks {ranks} (cp={key[0]}, dp={key[1]}, pp={key[2]})"
            if len(doms) > 1:
                out.append(f"{where}: spans NVLink domains {doms} (a TP group must stay inside one domain)")
            elif same_tray and len(hosts) > 1:
                out.append(f"{where}: spans trays (hosts) {hosts} (tp={par.tp} divides {cl.gpus_per_tray} GPUs per tray: one tray required)")
    if par.cp > 1:
        for key, ranks in sorted(groups(("dp", "pp")).items()):
            doms = sorted({int(cl.gpu2domain[r2g[r]]) for r in ranks})
            if len(doms) > 1:
                out.append(
                    f"TP x CP group of ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} (dp={key[0]}, pp={key[1]}): "
                    f"spans NVLink domains {doms} (must stay inside one domain)"
                )
    return out


def etp_violations(instance: Instance) -> list[str]:
    """The layout's expert-tensor-parallel size, when the cost model cannot represent it.

    Every EP rank holds its experts whole (``etp = 1``): with ``etp > 1`` Megatron-Core builds its
    EP groups from ranks ``etp`` apart and splits each expert over ``etp`` GPUs, which neither the
    evaluator nor the solvers model.  Megatron defaults ``expert_tensor_parallel_size`` to ``tp``,
    so a job must be launched with ``--expert-tensor-parallel-size 1``.
    """
    etp = instance.parallel.etp
    if etp in SUPPORTED_ETP:
        return []
    return [
        f"parallel.etp: expert-tensor-parallel size {etp} is not supported (only "
        f"{', '.join(map(str, SUPPORTED_ETP))}: each expert whole on one GPU)"
    ]
