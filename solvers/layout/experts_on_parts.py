"""Experts of one MoE layer on the parts (domains) of one EP group: the domain-level expert
placement that prices every shape of the rank layout.

Method: the ``per_pair`` optimum (an assignment problem over slots; exact for ``per_pair``) as a
start, then (``per_domain``) best-improvement swaps with exact deltas.  Group-preserving maps
first assign expert groups to group positions by an assignment problem on each group's own
optimum per position make-up, then try exchanging groups between positions of different make-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from solvers.kernels import NetSwapSearch, assign_to_counts
from solvers.layout.tokens import Tokens, crossings, part_counts

__all__ = ["PartPlacement", "place_on_parts", "MAX_SWAPS"]

#: Swap-search limit per (EP group, layer, shape) scoring, counted in swaps (deterministic).
MAX_SWAPS = 64


@dataclass(frozen=True)
class PartPlacement:
    """Experts of one layer on the parts (domains) of one EP group.

    expert2part : (E,) part of each logical expert.
    group2position : (G,) group position of each expert group (group-preserving), else ``None``.
    crossings : sampled-token crossings in the cost mode (remote domains, or remote experts).
    nic_copies : (ep,) crossings on each EP rank's NIC, one direction (sent as a source plus an
        even share of those received by its part).
    arrivals : (P,) crossings that land in each part (they sum to ``crossings``).
    """

    expert2part: np.ndarray
    group2position: np.ndarray | None
    crossings: int
    nic_copies: np.ndarray
    arrivals: np.ndarray


def _swaps(tok: Tokens, e2p: np.ndarray, src_part: np.ndarray, num_parts: int, mode: str,
           labels: np.ndarray | None, max_swaps: int) -> np.ndarray:
    """(E,) part of each expert after best-improvement swaps (the shared kernel, one net per token,
    each part its own domain; ``labels``: only experts with equal labels swap, None: any two)."""
    search = NetSwapSearch(tok.topk, np.tile(np.arange(num_parts)[:, None], (1, tok.n)), src_part,
                           np.ones(tok.n, dtype=np.int64), num_items=tok.num_experts, num_domains=num_parts,
                           cost_mode=mode, swap_label=labels, tie_break="lower_bound")
    e2p = e2p.copy()
    search.run_swaps(e2p, None, None, max_swaps)
    return e2p


def _pair_use(tok: Tokens, src_part: np.ndarray, num_parts: int) -> np.ndarray:
    """(E, P): (token, expert) pairs of each expert from sources in each part."""
    onehot = np.zeros((tok.n, num_parts))
    onehot[np.arange(tok.n), src_part] = 1.0
    return np.asarray(tok.At @ onehot)


class _GroupPlacement:
    """Group-preserving placement on parts: whole expert groups on group positions.

    Parameters
    ----------
    tok, src_part, num_parts : as for :func:`place_on_parts`.
    slot2part : (E,) part of each physical slot.
    group_size : experts per expert group.
    use : (E, P) from :func:`_pair_use`.
    """

    def __init__(self, tok: Tokens, src_part: np.ndarray, num_parts: int, slot2part: np.ndarray,
                 group_size: int, use: np.ndarray):
        E = tok.num_experts
        self.tok, self.src_part, self.P, self.gs = tok, src_part, num_parts, group_size
        self.G = G = E // group_size
        comp = np.stack([np.bincount(slot2part[b * group_size : (b + 1) * group_size], minlength=num_parts)
                         for b in range(G)])
        self.types, position_type = np.unique(comp, axis=0, return_inverse=True)
        self.position_type = position_type.reshape(-1)
        # each group's own best placement under each position make-up (per_pair proxy, exact there)
        self.own = np.empty((G, len(self.types), group_size), dtype=np.int64)
        own_val = np.empty((G, len(self.types)))
        for g in range(G):
            u = use[g * group_size : (g + 1) * group_size]
            for t, cap in enumerate(self.types):
                self.own[g, t] = assign_to_counts(-u, cap, method="slots")[0]
                own_val[g, t] = u[np.arange(group_size), self.own[g, t]].sum()
        self.g2pos = assign_to_counts(-own_val[:, self.position_type], np.ones(G, dtype=np.int64), method="slots")[0]
        self.labels = np.repeat(np.arange(G), group_size)

    def build(self) -> np.ndarray:
        """(E,) part of each expert from the groups' positions."""
        return np.concatenate([self.own[g, self.position_type[self.g2pos[g]]] for g in range(self.G)])

    def _contrib(self, At_g: list, g: int, parts: np.ndarray) -> np.ndarray:
        onehot_g = np.zeros((self.gs, self.P))
        onehot_g[np.arange(self.gs), parts] = 1.0
        return np.asarray(At_g[g] @ onehot_g)

    def improve(self, e2p: np.ndarray, max_swaps: int) -> np.ndarray:
        """Swaps inside groups, then exchanges of whole groups between positions of different
        make-up while they help.  A group's contribution to the (N, P) part counts is
        ``A_g @ onehot(parts of its experts)``, so an exchange is scored exactly from four such
        matrices."""
        tok, P, G, gs = self.tok, self.P, self.G, self.gs
        e2p = _swaps(tok, e2p, self.src_part, P, "per_domain", self.labels, max_swaps)
        notsrc = np.ones((tok.n, P), dtype=bool)
        notsrc[np.arange(tok.n), self.src_part] = False
        At_g = [tok.At[g * gs : (g + 1) * gs].T.tocsr() for g in range(G)]
        own_c = {(g, t): self._contrib(At_g, g, self.own[g, t]) for g in range(G) for t in range(len(self.types))}
        for _ in range(G):
            cur_c = [self._contrib(At_g, g, e2p[g * gs : (g + 1) * gs]) for g in range(G)]
            cnt = np.sum(cur_c, axis=0)
            best = self._best_exchange(cnt, cur_c, own_c, notsrc)
            if best is None:
                break
            g1, g2 = best
            self.g2pos[g1], self.g2pos[g2] = self.g2pos[g2], self.g2pos[g1]
            for g in (g1, g2):
                e2p[g * gs : (g + 1) * gs] = self.own[g, self.position_type[self.g2pos[g]]]
            e2p = _swaps(tok, e2p, self.src_part, P, "per_domain", self.labels, max_swaps)
        return e2p

    def _best_exchange(self, cnt: np.ndarray, cur_c: list, own_c: dict, notsrc: np.ndarray) -> tuple[int, int] | None:
        cur = int(((cnt > 0) & notsrc).sum())
        best: tuple[int, tuple[int, int] | None] = (cur, None)
        for g1 in range(self.G):
            for g2 in range(g1 + 1, self.G):
                t1, t2 = self.position_type[self.g2pos[g1]], self.position_type[self.g2pos[g2]]
                if t1 == t2:
                    continue
                new = cnt - cur_c[g1] - cur_c[g2] + own_c[g1, t2] + own_c[g2, t1]
                c = int(((new > 0.5) & notsrc).sum())
                if c < best[0]:
                    best = (c, (g1, g2))
        return best[1]


def place_on_parts(
    tok: Tokens,
    part_of_ep: np.ndarray,
    num_parts: int,
    *,
    experts_per_rank: int,
    mode: str,
    group_size: int | None,
    max_swaps: int = MAX_SWAPS,
) -> PartPlacement:
    """Place one layer's experts on the parts (domains) of one EP group (module docstring).

    Parameters
    ----------
    tok : the group's sampled tokens in this layer.
    part_of_ep : (ep,) part of each EP rank.
    num_parts : P, the number of parts (each holds at least one EP rank).
    experts_per_rank : slots per EP rank; slot ``p`` is on EP rank ``p // experts_per_rank``.
    mode : ``per_domain`` or ``per_pair``.
    group_size : experts per expert group when the map must be group-preserving (whole groups on
        group positions of ``group_size`` contiguous slots, experts moving only inside their
        group), else ``None``.
    max_swaps : swap-search limit.

    Returns
    -------
    PartPlacement
    """
    E = tok.num_experts
    P = num_parts
    slot2part = np.repeat(part_of_ep, experts_per_rank)[:E]
    src_part = part_of_ep[tok.src]
    use = _pair_use(tok, src_part, P)
    g2pos = None
    if group_size is None or group_size >= E:
        e2p = assign_to_counts(-use, np.bincount(slot2part, minlength=P), method="slots")[0]
        if mode == "per_domain":
            e2p = _swaps(tok, e2p, src_part, P, mode, None, max_swaps)
    else:
        groups = _GroupPlacement(tok, src_part, P, slot2part, group_size, use)
        e2p = groups.build()
        if mode == "per_domain" and len(groups.types) > 1:
            e2p = groups.improve(e2p, max_swaps)
        g2pos = groups.g2pos
    cross = crossings(tok, e2p, src_part, mode)
    nic, into = nic_copies(tok, e2p, part_of_ep, src_part, P, mode, cross)
    return PartPlacement(expert2part=e2p, group2position=g2pos, crossings=int(cross.sum()), nic_copies=nic,
                         arrivals=into)


def nic_copies(
    tok: Tokens, e2p: np.ndarray, part_of_ep: np.ndarray, src_part: np.ndarray, P: int, mode: str, cross: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ep,) copies on each EP rank's NIC in its busier direction: the larger of those it sends as
    a source and an even share of its part's arrivals (placement.predict.cost prices each NIC per
    direction); and (P,) the arrivals of each part.

    ``per_domain`` arrivals land on the group's GPUs of the remote domain evenly (the evaluator's
    model); ``per_pair`` arrivals land on the expert's GPU, approximated here by an even share.
    """
    ep = len(part_of_ep)
    sent = np.bincount(tok.src, weights=cross, minlength=ep)
    if mode == "per_pair":
        parts = e2p[tok.topk]
        remote = parts != src_part[:, None]
        into = np.bincount(parts[remote], minlength=P).astype(np.float64)
    else:
        present = part_counts(tok, e2p, P) > 0
        present[np.arange(tok.n), src_part] = False
        into = present.sum(axis=0).astype(np.float64)
    size = np.bincount(part_of_ep, minlength=P).astype(np.float64)
    return np.maximum(sent, into[part_of_ep] / size[part_of_ep]), into
