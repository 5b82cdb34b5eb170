"""Complete layouts: the first-fit warm start, concrete GPUs for footprints, and the estimator's
view of a complete layout (one expert map per stage and layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from placement.predict.cost import Metrics
from placement.core.model import Instance, SolverError
from solvers.layout.blocks import Block, block_footprints, layout_blocks
from solvers.layout.scorer import BlockScorer, LayerPlacements, ShapeScore

__all__ = ["first_fit", "assign_gpus", "estimate_layout", "summarise", "Candidate", "rank_key", "public_estimate",
           "estimate_from_metrics", "offer_exact", "ExactScores"]

#: (block index, shape) -> the block's exact score under that shape over all its layers, and the
#: (n_atoms,) atom -> part map that realises it.
ExactScores = dict[tuple[int, tuple[int, ...]], tuple[ShapeScore, np.ndarray]]


def first_fit(blocks: Sequence[Block], free: np.ndarray, unit: int) -> list[dict[int, int]] | None:
    """Blocks with most MoE layers first: the tightest domain that holds them whole, else split
    over the domains with the most free GPUs (in multiples of ``unit``)."""
    free = free.astype(np.int64).copy()
    order = sorted(range(len(blocks)), key=lambda b: (-len(blocks[b].moe_layers), -blocks[b].size, b))
    feet: list[dict[int, int]] = [dict() for _ in blocks]
    # whole blocks first
    pending = []
    for b in order:
        n = blocks[b].size
        fits = [d for d in range(len(free)) if free[d] >= n]
        if fits:
            d = min(fits, key=lambda d: (free[d], d))
            feet[b] = {d: n}
            free[d] -= n
        else:
            pending.append(b)
    for b in pending:
        rem = blocks[b].size
        while rem > 0:
            avail = [(int(free[d] // unit * unit), d) for d in range(len(free))]
            avail = [(c, d) for c, d in avail if c > 0 and d not in feet[b]]
            if not avail:
                return None
            # the smallest domain that closes the block, else the largest
            close = [(c, d) for c, d in avail if c >= rem]
            c, d = min(close) if close else max(avail, key=lambda cd: (cd[0], -cd[1]))
            take = min(c, rem)
            feet[b][d] = take
            free[d] -= take
            rem -= take
    return feet


def assign_gpus(instance: Instance, blocks: Sequence[Block], feet: Sequence[dict[int, int]],
                 atom2part: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """rank2gpu from per-block footprints and atom -> part maps (parts = footprint's domains,
    larger first, ties by domain).  Whole free trays go to parts first, in tray order; the rest is
    filled from the remaining GPUs, best fit.  Returns (rank2gpu, atoms split across trays)."""
    cl = instance.cluster
    g_per_tray = cl.gpus_per_tray
    rank2gpu = np.full(instance.parallel.world_size, -1, dtype=np.int64)
    # per domain: the parts that live there, in block order
    by_domain: dict[int, list[tuple[int, int]]] = {}
    for b, foot in enumerate(feet):
        for d in foot:
            by_domain.setdefault(d, []).append((b, d))
    part_gpus: dict[tuple[int, int], list[int]] = {}
    for d in sorted(by_domain):
        gpus = [int(g) for g in cl.available_gpus if cl.gpu2domain[g] == d]
        trays: dict[int, list[int]] = {}
        for g in gpus:
            trays.setdefault(int(cl.gpu2host[g]), []).append(g)
        full = [h for h in sorted(trays) if len(trays[h]) == g_per_tray]
        parts = by_domain[d]
        need = {p: feet[p[0]][d] for p in parts}
        got: dict[tuple[int, int], list[int]] = {p: [] for p in parts}
        # Step 1: whole trays, largest parts first (ties by block)
        for p in sorted(parts, key=lambda p: (-need[p], p[0])):
            while need[p] - len(got[p]) >= g_per_tray and full:
                got[p].extend(trays.pop(full.pop(0)))
        # Step 2: the rest, from the remaining GPUs, tray by tray, best fit
        for p in sorted(parts, key=lambda p: (-(need[p] - len(got[p])), p[0])):
            while len(got[p]) < need[p]:
                short = need[p] - len(got[p])
                hosts = sorted(trays, key=lambda h: (len(trays[h]) < short, abs(len(trays[h]) - short), h))
                if not hosts:
                    raise SolverError(f"domain {d}: footprints exceed its free GPUs")
                h = hosts[0]
                take = trays[h][:short]
                trays[h] = trays[h][short:]
                if not trays[h]:
                    del trays[h]
                got[p].extend(take)
        for p in parts:
            part_gpus[p] = sorted(got[p])
    # Inside a host, give GPUs to ranks in rank order: every GPU of a host is in one domain, so the
    # costs do not change, and a host's ranks then take its GPUs in local-rank order (Slurm).
    for b, block in enumerate(blocks):
        doms = sorted(feet[b], key=lambda d: (-feet[b][d], d))
        for i, d in enumerate(doms):
            ranks = block.atoms[atom2part[b] == i].reshape(-1)
            if len(ranks) != len(part_gpus[(b, d)]):
                raise SolverError(f"block {b}: part {i} has {len(ranks)} ranks for {len(part_gpus[(b, d)])} GPUs")
            rank2gpu[ranks] = part_gpus[(b, d)]
    host_of = cl.gpu2host[np.maximum(rank2gpu, 0)]
    for h in np.unique(host_of):
        ranks = np.flatnonzero(host_of == h)
        rank2gpu[ranks] = np.sort(rank2gpu[ranks])
    split_atoms = 0
    for block in blocks:
        for atom in block.atoms:
            if len({int(cl.gpu2host[rank2gpu[r]]) for r in atom}) > 1:
                split_atoms += 1
    return rank2gpu, split_atoms


def estimate_layout(instance: Instance, rank2gpu: np.ndarray, *, group_preserving: bool,
                    scorer: BlockScorer | None = None) -> dict:
    """The estimator's view of a complete layout (with its own expert placement).

    Returns ``{"total_bytes", "slowest_stage_s", "stage_bytes", "stage_time_s", "phy2log",
    "block_scores"}``: bytes and seconds per optimizer step; ``phy2log`` (num_moe_layers, E) is the
    expert map scored; ``block_scores`` one :class:`ShapeScore` per block of :func:`layout_blocks`.
    """
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    blocks = layout_blocks(instance)
    scorer = scorer or BlockScorer(instance, group_preserving=group_preserving)
    feet, a2ps = block_footprints(instance, blocks, rank2gpu)
    return summarise(instance, blocks, a2ps, scorer)


def summarise(instance: Instance, blocks: Sequence[Block], a2ps: Sequence[np.ndarray], scorer: BlockScorer,
              stop: Callable[[], bool] | None = None) -> dict:
    """The estimate of a complete layout given as (n_atoms,) atom -> part per block (see
    :func:`estimate_layout`).

    Every block is scored with its EP groups' own expert maps (``block_scores``, the prices the
    footprint search keeps); a stage and layer then gets one map, the costliest block's, and a
    stage with more than one EP group is scored again with that map for all of them (what the
    evaluator counts), so the bytes are the evaluator's for ``phy2log``.  ``layer_nic_s``:
    (num_moe_layers,) busiest NIC seconds of each MoE layer.

    Raises
    ------
    solvers.layout.budget.Stopped
        ``stop()`` turned true between layers.
    """
    pp = instance.parallel.pp
    stage_bytes = [0.0] * pp
    stage_time = [0.0] * pp
    chosen: dict[int, tuple[float, int, LayerPlacements]] = {}  # stage -> (weight, block, placements)
    block_scores: list[ShapeScore] = []
    for block, a2p in zip(blocks, a2ps):
        sc, placements = scorer.score(block, a2p, stop=stop)
        block_scores.append(sc)
        stage_bytes[block.stage] += sc.total_bytes
        stage_time[block.stage] = max(stage_time[block.stage], sc.time_s)
        if block.stage not in chosen or sc.total_bytes > chosen[block.stage][0]:
            chosen[block.stage] = (sc.total_bytes, block.index, placements)
    phy2log = _stage_phy2log(instance, blocks, a2ps, chosen, scorer)
    layer_nic_s = np.zeros(instance.model.num_moe_layers)
    for block, sc in zip(blocks, block_scores):
        layer_nic_s[block.moe_layers] = np.maximum(layer_nic_s[block.moe_layers], sc.layer_nic_s)
    for s in range(pp):
        members = [i for i, b in enumerate(blocks) if b.stage == s]
        if sum(blocks[i].ep_groups.shape[0] for i in members) > 1:
            stage_bytes[s], stage_time[s] = _shared_map_stage(blocks, a2ps, members, scorer, phy2log, layer_nic_s)
    return {
        "total_bytes": float(sum(stage_bytes)),
        "slowest_stage_s": float(max(stage_time)) if stage_time else 0.0,
        "stage_bytes": [float(x) for x in stage_bytes],
        "stage_time_s": [float(x) for x in stage_time],
        "layer_nic_s": [float(x) for x in layer_nic_s],
        "phy2log": phy2log,
        "block_scores": block_scores,
    }


def _shared_map_stage(blocks: Sequence[Block], a2ps: Sequence[np.ndarray], members: Sequence[int],
                      scorer: BlockScorer, phy2log: np.ndarray, layer_nic_s: np.ndarray) -> tuple[float, float]:
    """(bytes, seconds) of one stage whose EP groups all use ``phy2log``; writes the stage's
    layers' busiest NIC seconds into ``layer_nic_s``."""
    scores = [scorer.score_fixed(blocks[i], a2ps[i], phy2log) for i in members]
    layers = blocks[members[0]].moe_layers
    nic = np.max([sc.layer_nic_s for sc in scores], axis=0) if len(layers) else np.zeros(0)
    layer_nic_s[layers] = nic
    floor = [max(scorer.nvlink_floor_s(blocks[i], int(l)) for i in members) for l in layers]
    time_s = float(sum(max(float(n), f) for n, f in zip(nic, floor)))
    return float(sum(sc.total_bytes for sc in scores)), time_s


def _stage_phy2log(instance: Instance, blocks: Sequence[Block], a2ps: Sequence[np.ndarray],
             chosen: dict[int, tuple[float, int, LayerPlacements]], scorer: BlockScorer) -> np.ndarray:
    """One expert map per layer from the costliest block of its stage (first straddling EP group)."""
    m = instance.model
    E, epr = m.num_experts, instance.experts_per_rank
    phy2log = np.tile(np.arange(E, dtype=np.int64), (m.num_moe_layers, 1))
    for s, (_, b, placements) in chosen.items():
        block = blocks[b]
        rank_part = {int(r): int(a2ps[b][i]) for i, atom in enumerate(block.atoms) for r in atom}
        for li, layer in enumerate(block.moe_layers):
            for g, pl in enumerate(placements[li]):
                if pl is None:
                    continue
                part_of_ep = np.array([rank_part[int(r)] for r in block.ep_groups[g]], dtype=np.int64)
                slot2part = np.repeat(part_of_ep, epr)[:E]
                row = np.empty(E, dtype=np.int64)
                if pl.group2position is None:
                    for p in np.unique(slot2part):
                        row[np.flatnonzero(slot2part == p)] = np.flatnonzero(pl.expert2part == p)
                else:
                    gs = int(scorer.group_size or E)
                    for grp, position in enumerate(pl.group2position):
                        slots = np.arange(position * gs, (position + 1) * gs)
                        experts = np.arange(grp * gs, (grp + 1) * gs)
                        for p in np.unique(slot2part[slots]):
                            row[slots[slot2part[slots] == p]] = experts[pl.expert2part[experts] == p]
                phy2log[int(layer)] = row
                break
    return phy2log


@dataclass(frozen=True)
class Candidate:
    """A complete layout scored by the estimator: its name, (world,) rank2gpu and estimate."""

    name: str
    rank2gpu: np.ndarray
    estimate: dict


def rank_key(est: dict, objective: str) -> tuple[float, float]:
    """Bytes then time for ``total``, time then bytes for ``bottleneck``."""
    if objective == "total":
        return (est["total_bytes"], est["slowest_stage_s"])
    return (est["slowest_stage_s"], est["total_bytes"])


def public_estimate(est: dict) -> dict:
    """The JSON-serialisable part of an estimate (no expert map, no per-block scores)."""
    return {k: est[k] for k in ("total_bytes", "slowest_stage_s", "stage_bytes", "stage_time_s")}


def estimate_from_metrics(m: Metrics, phy2log: np.ndarray) -> dict:
    """An estimate dict from the evaluator's metrics (sampled tokens)."""
    return {
        "total_bytes": float(m.cross_domain_bytes_per_step),
        "slowest_stage_s": float(m.alltoall_time_s_per_step),
        "stage_bytes": [float(x) for x in m.cross_domain_bytes_per_stage],
        "stage_time_s": [float(x) for x in m.alltoall_time_s_per_stage],
        "phy2log": phy2log,
        "block_scores": [],
    }


def offer_exact(exact: ExactScores, key: tuple[int, tuple[int, ...]], score: ShapeScore, a2p: np.ndarray,
                 cap_s: float | None, objective: str) -> None:
    """Keep the better realisation of (block, shape) in ``exact``: within the time cap first, then by
    the objective (bytes then time for ``total``, time then bytes for ``bottleneck``)."""

    def rank(sc: ShapeScore) -> tuple:
        over = cap_s is not None and sc.time_s > cap_s * (1 + 1e-9) + 1e-12
        return (over, sc.total_bytes, sc.time_s) if objective == "total" else (over, sc.time_s, sc.total_bytes)

    old = exact.get(key)
    if old is None or rank(score) < rank(old[0]):
        exact[key] = (score, np.asarray(a2p, dtype=np.int64).copy())
