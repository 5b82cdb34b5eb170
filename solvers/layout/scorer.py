"""The layout's estimator: a block's cross-domain bytes and all-to-all time under a footprint,
each EP group with the best domain-level expert map found for it.

Built on :mod:`placement.predict.cost`'s primitives (crossings per token, bytes per crossing): for a given
expert map the bytes are the evaluator's, exactly.  Times are per layer the busier of the
busiest NIC (the evaluator's per-GPU model) and the NVLink floor of the contiguous map (an
approximation; ``tests/test_layout.py`` states the bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from placement.predict.cost import fabric_bytes_per_crossing, nic_bytes_per_crossing
from placement.core.model import Instance
from solvers.layout.blocks import Block
from solvers.layout.budget import SCORE_BASE_S, SCORE_S_PER_PAIR, Stopped
from solvers.layout.experts_on_parts import MAX_SWAPS, PartPlacement, nic_copies, place_on_parts
from solvers.layout.shapes import contiguous_atom_parts
from solvers.layout.tokens import Tokens, crossings

__all__ = ["ShapeScore", "BlockScorer", "VALIDATION_FRACTION", "TokenRange"]

#: Share of each replica's sampled tokens (the last ones) held back to validate moved replicas.
VALIDATION_FRACTION = 0.25

#: Which of each replica's sampled tokens a scorer sees: ``"all"``, the ``"fit"`` part (the first
#: ``1 - VALIDATION_FRACTION``) or the ``"val"`` part (the rest).
TokenRange = str

#: Per layer, per EP group of a block: the expert placement, ``None`` for a group inside one part.
LayerPlacements = list[list[PartPlacement | None]]


@dataclass(frozen=True)
class ShapeScore:
    """One block's estimate under one footprint (bytes and seconds per optimizer step).

    total_bytes : cross-domain bytes summed over the block's EP groups and MoE layers.
    time_s : the block's all-to-all time: per layer the busier of its busiest NIC and the stage's
        NVLink floor, summed over the layers.
    layer_bytes : (m,) per MoE layer of the stage.
    layer_nic_s : (m,) busiest NIC time per MoE layer (without the NVLink floor).
    part_bytes : (P,) of ``total_bytes``, the bytes landing in each part (domain) of the block.
    part_nic_s : (P,) per part, its busiest NIC's time summed over the layers.
    """

    total_bytes: float
    time_s: float
    layer_bytes: tuple[float, ...]
    layer_nic_s: tuple[float, ...] = ()
    part_bytes: tuple[float, ...] = ()
    part_nic_s: tuple[float, ...] = ()


class BlockScorer:
    """Scores blocks under footprints; caches tokens and results.

    Parameters
    ----------
    instance : the problem (solver view).
    group_preserving : expert maps keep whole expert groups on group positions.
    tokens : ``"all"`` the sampled tokens, ``"fit"`` the first ``1 - VALIDATION_FRACTION`` of each
        replica's tokens, ``"val"`` the rest.
    """

    def __init__(self, instance: Instance, *, group_preserving: bool, tokens: TokenRange = "all"):
        self.instance = instance
        m = instance.model
        self.mode = instance.cost_mode
        self.group_size = m.experts_per_group if (group_preserving and m.num_groups > 1) else None
        self.experts_per_rank = instance.experts_per_rank
        T = instance.routing.tokens_per_source
        cut = T - int(round(T * VALIDATION_FRACTION)) if T > 1 else T
        self.token_range = {"all": (0, T), "fit": (0, cut), "val": (cut, T)}[tokens]
        t0, t1 = self.token_range
        n_tok = max(1, t1 - t0)
        self.bytes_per_crossing = fabric_bytes_per_crossing(instance, n_tok)
        nic_bytes = nic_bytes_per_crossing(instance, n_tok)
        # a NIC's busier direction carries each copy's four transfers (placement.predict.cost)
        self.nic_s_per_copy = self.bytes_per_crossing / (instance.cluster.scaleout_gbps * 1e9)
        self.nvl_s_per_copy = nic_bytes / (instance.cluster.nvlink_gbps * 1e9)
        self._tokens: dict[tuple[int, int, int], Tokens] = {}
        self._scores: dict[tuple, tuple[ShapeScore, LayerPlacements]] = {}
        self._nvl: dict[int, float] = {}
        #: predicted seconds of the expert placements done so far (deterministic: counts only)
        self.work_s = 0.0

    # ---- the work model (deterministic) ---------------------------------------------------
    def pairs_per_group(self) -> int:
        """(token, expert) pairs of one EP group in one layer, in this scorer's token range."""
        t0, t1 = self.token_range
        par = self.instance.parallel
        per_rank = -(-(t1 - t0) // max(1, par.tp * par.cp))
        return int(par.ep * per_rank * self.instance.model.top_k)

    def predict_s(self, block: Block, num_parts: int, num_layers: int | None = None) -> float:
        """Predicted seconds of scoring ``block`` on ``num_parts`` parts over ``num_layers`` layers
        (default: all of its stage), every EP group straddling (an upper estimate)."""
        if num_parts <= 1:
            return 0.0
        layers = len(block.moe_layers) if num_layers is None else num_layers
        one = SCORE_BASE_S + SCORE_S_PER_PAIR * self.pairs_per_group() * (num_parts - 1) ** 1.3
        return float(block.ep_groups.shape[0] * layers * one)

    # ---- data ---------------------------------------------------------------------------
    def tokens(self, block: Block, group: int, layer: int) -> Tokens:
        """The sampled tokens (in this scorer's range) of EP group ``group`` of ``block``."""
        key = (block.index, group, layer)
        tok = self._tokens.get(key)
        if tok is None:
            t0, t1 = self.token_range
            topk = self.instance.routing.topk[layer]  # (dp, T, k)
            rank2dp = self.instance.parallel.rank2dp
            a = block.atom_size
            parts_topk, parts_src = [], []
            for k_ep, r in enumerate(block.ep_groups[group]):
                atom = block.atoms[np.flatnonzero((block.atoms == r).any(axis=1))[0]]
                sub = int(np.flatnonzero(atom == r)[0])
                ts = np.arange(t0, t1)
                ts = ts[ts % a == sub]
                parts_topk.append(topk[int(rank2dp[r]), ts])
                parts_src.append(np.full(len(ts), k_ep))
            tok = Tokens(np.concatenate(parts_topk), np.concatenate(parts_src), self.instance.model.num_experts)
            self._tokens[key] = tok
        return tok

    def nvlink_floor_s(self, block: Block, layer: int) -> float:
        """NVLink time of one layer with the contiguous expert map (independent of domains).

        ``per_domain``: every distinct target GPU other than the source receives one copy over
        NVLink wherever the domains are, so this floor does not depend on the layout.
        """
        key = block.index * 100000 + layer
        if key not in self._nvl:
            worst = 0.0
            for g in range(block.ep_groups.shape[0]):
                tok = self.tokens(block, g, layer)
                tgt = np.sort(tok.topk // self.experts_per_rank, axis=1)
                first = np.ones_like(tgt, dtype=bool)
                first[:, 1:] = tgt[:, 1:] != tgt[:, :-1]
                mask = first & (tgt != tok.src[:, None])
                recv = np.bincount(tgt[mask], minlength=block.ep_groups.shape[1])
                worst = max(worst, float(recv.max()) if recv.size else 0.0)
            self._nvl[key] = worst * self.nvl_s_per_copy
        return self._nvl[key]

    # ---- scoring ------------------------------------------------------------------------
    def place_group(self, block: Block, group: int, layer: int, part_of_ep: np.ndarray,
                    max_swaps: int = MAX_SWAPS) -> PartPlacement | None:
        """Experts of ``layer`` on the parts of EP group ``group`` (``part_of_ep``: (ep,) block
        part of each EP rank), in the block's part ids; ``None`` when the group is in one part.
        Adds the placement's predicted seconds to :attr:`work_s`."""
        used = np.unique(part_of_ep)
        if len(used) == 1:
            return None
        local = np.searchsorted(used, part_of_ep)
        tok = self.tokens(block, group, layer)
        self.work_s += SCORE_BASE_S + SCORE_S_PER_PAIR * tok.n * tok.topk.shape[1] * (len(used) - 1) ** 1.3
        pl = place_on_parts(tok, local, len(used), experts_per_rank=self.experts_per_rank, mode=self.mode,
                            group_size=self.group_size, max_swaps=max_swaps)
        # map local part ids back to the block's parts
        return PartPlacement(used[pl.expert2part], pl.group2position, pl.crossings, pl.nic_copies, pl.arrivals)

    def score(
        self,
        block: Block,
        atom2part: np.ndarray,
        *,
        layers: Sequence[int] | None = None,
        max_swaps: int = MAX_SWAPS,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[ShapeScore, LayerPlacements]:
        """Score ``block`` with its atoms on parts ``atom2part`` (n_atoms,).

        ``layers``: only these MoE layers of the block's stage (default: all of them).  Returns the
        score and, per layer, per EP group, the :class:`PartPlacement` (``None`` for a group inside
        one part).  Every expert placement done adds its predicted seconds to :attr:`work_s`.

        Raises
        ------
        Stopped
            ``stop()`` turned true between two layers (nothing is cached then).
        """
        layer_ids = block.moe_layers if layers is None else np.asarray(layers, dtype=np.int64)
        key = (block.index, tuple(int(x) for x in atom2part), tuple(int(x) for x in layer_ids), max_swaps)
        hit = self._scores.get(key)
        if hit is not None:
            return hit
        rank_part = {int(r): int(atom2part[i]) for i, atom in enumerate(block.atoms) for r in atom}
        part_of_ep = [np.array([rank_part[int(r)] for r in eg], dtype=np.int64) for eg in block.ep_groups]
        acc = _ScoreSum(int(atom2part.max()) + 1)
        placements: LayerPlacements = []
        for layer in layer_ids:
            if stop is not None and stop():
                raise Stopped
            lay = [self.place_group(block, g, int(layer), part_of_ep[g], max_swaps)
                   for g in range(block.ep_groups.shape[0])]
            acc.add_layer(lay, part_of_ep, self.bytes_per_crossing, self.nic_s_per_copy,
                          self.nvlink_floor_s(block, int(layer)))
            placements.append(lay)
        out = (acc.result(), placements)
        self._scores[key] = out
        return out

    def score_fixed(self, block: Block, atom2part: np.ndarray, phy2log: np.ndarray) -> ShapeScore:
        """Score ``block`` with its atoms on parts ``atom2part`` (n_atoms,) under the given expert
        map ``phy2log`` (num_moe_layers, E) for every EP group: no search, no work counted.

        This is what the evaluator counts when a stage's EP groups share one map; with the map
        an EP group's own placement gives, it equals that placement's :meth:`score`.
        """
        E = self.instance.model.num_experts
        rank_part = {int(r): int(atom2part[i]) for i, atom in enumerate(block.atoms) for r in atom}
        part_of_ep = [np.array([rank_part[int(r)] for r in eg], dtype=np.int64) for eg in block.ep_groups]
        acc = _ScoreSum(int(atom2part.max()) + 1)
        for layer in block.moe_layers:
            lay: list[PartPlacement | None] = []
            for g, parts in enumerate(part_of_ep):
                used = np.unique(parts)
                if len(used) == 1:
                    lay.append(None)
                    continue
                local = np.searchsorted(used, parts)
                expert2local = np.empty(E, dtype=np.int64)
                expert2local[phy2log[int(layer)]] = np.repeat(local, self.experts_per_rank)[:E]
                tok = self.tokens(block, g, int(layer))
                src_part = local[tok.src]
                cross = crossings(tok, expert2local, src_part, self.mode)
                nic, into = nic_copies(tok, expert2local, local, src_part, len(used), self.mode, cross)
                lay.append(PartPlacement(used[expert2local], None, int(cross.sum()), nic, into))
            acc.add_layer(lay, part_of_ep, self.bytes_per_crossing, self.nic_s_per_copy,
                          self.nvlink_floor_s(block, int(layer)))
        return acc.result()

    def score_shape(self, block: Block, shape: Sequence[int], layers: Sequence[int] | None = None) -> ShapeScore:
        """Score ``block`` under ``shape`` with contiguous slices of atoms (larger parts first)."""
        return self.score(block, self.slices(block, shape), layers=layers)[0]

    def slices(self, block: Block, shape: Sequence[int]) -> np.ndarray:
        """(n_atoms,) atom -> part for ``shape``: consecutive slices, aligned to group positions
        where the map is group-preserving (see :func:`solvers.layout.shapes.slice_order`)."""
        align = None
        if self.group_size is not None and block.ep_groups.shape[0] == 1:
            if self.group_size % self.experts_per_rank == 0:
                align = self.group_size // self.experts_per_rank
        return contiguous_atom_parts(block, shape, align)

    def floor_time_s(self, block: Block) -> float:
        """The block's all-to-all time when it sits in one domain (NVLink only)."""
        return float(sum(self.nvlink_floor_s(block, int(l)) for l in block.moe_layers))


class _ScoreSum:
    """Running sums of one block's score over its layers (see :class:`ShapeScore`)."""

    def __init__(self, num_parts: int):
        self.total, self.time_s = 0.0, 0.0
        self.per_layer: list[float] = []
        self.per_nic: list[float] = []
        self.arrivals = np.zeros(num_parts)
        self.part_nic = np.zeros(num_parts)  # summed over layers of each part's busiest NIC

    def add_layer(self, lay: Sequence[PartPlacement | None], part_of_ep: Sequence[np.ndarray],
                  bytes_per_crossing: float, nic_s_per_copy: float, floor_s: float) -> None:
        layer_part_nic = np.zeros_like(self.part_nic)
        layer_bytes, nic_max = 0.0, 0.0
        for pl, parts in zip(lay, part_of_ep):
            if pl is None:
                continue
            used = np.unique(parts)
            local = np.searchsorted(used, parts)
            self.arrivals[used] += pl.arrivals * bytes_per_crossing
            layer_bytes += pl.crossings * bytes_per_crossing
            nic_max = max(nic_max, float(pl.nic_copies.max()) * nic_s_per_copy)
            for i, part in enumerate(used):
                busiest = float(pl.nic_copies[local == i].max()) * nic_s_per_copy
                layer_part_nic[part] = max(layer_part_nic[part], busiest)
        self.part_nic += layer_part_nic
        self.total += layer_bytes
        self.per_layer.append(layer_bytes)
        self.per_nic.append(nic_max)
        self.time_s += max(nic_max, floor_s)

    def result(self) -> ShapeScore:
        return ShapeScore(self.total, self.time_s, tuple(self.per_layer), tuple(self.per_nic),
                          tuple(float(x) for x in self.arrivals), tuple(float(x) for x in self.part_nic))
