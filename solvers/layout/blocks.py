"""Blocks: the smallest sets of a stage's ranks placed as one unit, and facts about a layout's
footprints over NVLink domains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from placement.core.model import Instance, SolverError

__all__ = ["Block", "layout_blocks", "free_per_domain", "part_units", "block_footprints", "stage_footprints",
           "split_atoms"]


@dataclass(frozen=True)
class Block:
    """The smallest set of a stage's ranks closed under TP x CP groups and EP groups.

    index : position in :func:`layout_blocks`'s list.
    stage : pipeline stage.
    ranks : (n,) global ranks in layout order: atoms in order of their first EP position.
    atoms : (n_atoms, a) global ranks of each TP x CP group (one data-parallel replica of the
        stage), sub-ranks in global-rank order (the evaluator deals a replica's sampled tokens to
        them in turn).
    atom_replica : (n_atoms,) data-parallel index of each atom.
    ep_groups : (n_groups, ep) global ranks of each EP group inside the block, in EP-rank order.
    moe_layers : (m,) MoE layer positions of the stage.
    """

    index: int
    stage: int
    ranks: np.ndarray
    atoms: np.ndarray
    atom_replica: np.ndarray
    ep_groups: np.ndarray
    moe_layers: np.ndarray

    @property
    def size(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def atom_size(self) -> int:
        return int(self.atoms.shape[1])


class _UnionFind:
    """Disjoint sets over ``0 .. n-1`` (path halving)."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, members: Iterable[int]) -> None:
        members = list(members)
        root = self.find(members[0])
        for m in members[1:]:
            other = self.find(m)
            if other != root:
                self.parent[other] = root


def _stage_blocks(instance: Instance, s: int, first_index: int) -> list[Block]:
    """The blocks of stage ``s``, ordered by their first rank, indexed from ``first_index``."""
    par = instance.parallel
    rank2dp = par.rank2dp
    groups = par.stage_ep_groups[s]  # (G, ep)
    stage_ranks = np.flatnonzero(par.rank2stage == s)
    pos = {int(r): i for i, r in enumerate(stage_ranks)}
    sets = _UnionFind(len(stage_ranks))
    atoms = [stage_ranks[rank2dp[stage_ranks] == j] for j in range(par.dp)]
    for atom in atoms:
        sets.union(pos[int(r)] for r in atom)
    for eg in groups:
        sets.union(pos[int(r)] for r in eg)
    roots: dict[int, list[int]] = {}
    for i in range(len(stage_ranks)):
        roots.setdefault(sets.find(i), []).append(i)
    ep_pos = {int(r): (gi, k) for gi, eg in enumerate(groups) for k, r in enumerate(eg)}
    moe_layers = np.flatnonzero(instance.moe_layer2stage == s).astype(np.int64)
    out: list[Block] = []
    for comp in sorted(roots.values(), key=lambda c: int(stage_ranks[c[0]])):
        members = set(int(stage_ranks[i]) for i in comp)
        block_atoms = [a for a in atoms if int(a[0]) in members]
        block_atoms.sort(key=lambda a: min(ep_pos[int(r)] for r in a))
        gids = sorted({ep_pos[r][0] for r in members})
        out.append(Block(
            index=first_index + len(out),
            stage=s,
            ranks=np.concatenate(block_atoms).astype(np.int64),
            atoms=np.stack(block_atoms).astype(np.int64),
            atom_replica=np.array([int(rank2dp[a[0]]) for a in block_atoms], dtype=np.int64),
            ep_groups=np.stack([groups[g] for g in gids]).astype(np.int64),
            moe_layers=moe_layers,
        ))
    return out


def layout_blocks(instance: Instance) -> list[Block]:
    """The blocks of every stage, stage by stage, each ordered by its first rank.

    Returns
    -------
    list of :class:`Block`; their ranks partition the world.
    """
    out: list[Block] = []
    for s in range(instance.parallel.pp):
        out.extend(_stage_blocks(instance, s, len(out)))
    return out


def free_per_domain(instance: Instance) -> np.ndarray:
    """(num_domains,) int64 free GPUs of each NVLink domain."""
    cl = instance.cluster
    return np.bincount(cl.gpu2domain[cl.available_gpus], minlength=cl.num_domains).astype(np.int64)


def part_units(instance: Instance, blocks: Sequence[Block]) -> list[int]:
    """Part granularities to try, finest last: whole trays (when TP x CP groups fit a tray), then atoms."""
    a = blocks[0].atom_size if blocks else 1
    g = instance.cluster.gpus_per_tray
    out = []
    if a <= g and g % a == 0:
        out.append(g)
    elif a > g and a % g == 0:
        out.append(a)
    out.append(a)
    return sorted(set(out), reverse=True)


def block_footprints(instance: Instance, blocks: Sequence[Block],
                     rank2gpu: np.ndarray) -> tuple[list[dict[int, int]], list[np.ndarray]]:
    """Per block: ``{domain: GPUs}`` and (n_atoms,) part of each atom (parts: larger first).

    Raises
    ------
    SolverError
        A TP x CP group spans NVLink domains (not a layout this package can score).
    """
    dom = instance.cluster.gpu2domain[rank2gpu]
    feet, a2ps = [], []
    for block in blocks:
        atom_dom = dom[block.atoms[:, 0]]
        if any(len(set(dom[a].tolist())) > 1 for a in block.atoms):
            raise SolverError(f"block {block.index}: a TP x CP group spans NVLink domains")
        counts = {int(d): int(c) for d, c in zip(*np.unique(dom[block.ranks], return_counts=True))}
        order = sorted(counts, key=lambda d: (-counts[d], d))
        feet.append(counts)
        a2ps.append(np.array([order.index(int(d)) for d in atom_dom], dtype=np.int64))
    return feet, a2ps


def stage_footprints(instance: Instance, rank2gpu: np.ndarray) -> list[list[list[int]]]:
    """Per pipeline stage, ``[[domain, GPUs], ...]`` sorted by GPUs (descending) then domain."""
    par = instance.parallel
    dom = instance.cluster.gpu2domain[np.asarray(rank2gpu, dtype=np.int64)]
    out = []
    for s in range(par.pp):
        counts = np.bincount(dom[par.rank2stage == s], minlength=instance.cluster.num_domains)
        nz = [[int(d), int(counts[d])] for d in np.flatnonzero(counts)]
        out.append(sorted(nz, key=lambda dc: (-dc[1], dc[0])))
    return out


def split_atoms(instance: Instance, blocks: Sequence[Block], rank2gpu: np.ndarray) -> int:
    """TP x CP groups whose ranks sit on more than one tray."""
    host = instance.cluster.gpu2host[np.asarray(rank2gpu, dtype=np.int64)]
    return int(sum(len(set(host[atom].tolist())) > 1 for blk in blocks for atom in blk.atoms))
