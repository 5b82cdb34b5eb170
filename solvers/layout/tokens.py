"""One EP group's sampled tokens in one MoE layer, and how they cross between parts (domains)."""

from __future__ import annotations

import numpy as np
from scipy import sparse

from placement.predict.cost import crossings_per_token
from placement.core.model import CostMode

__all__ = ["Tokens", "part_counts", "crossings"]


class Tokens:
    """Sampled tokens of one EP group in one MoE layer.

    Parameters
    ----------
    topk : (N, k) expert ids.
    src : (N,) EP rank (position in the group) of the sending rank.
    num_experts : E.

    Attributes
    ----------
    At : (E, N) sparse incidence, expert -> its tokens.
    """

    def __init__(self, topk: np.ndarray, src: np.ndarray, num_experts: int):
        self.topk = np.ascontiguousarray(topk, dtype=np.int64)
        self.src = np.ascontiguousarray(src, dtype=np.int64)
        n, k = self.topk.shape
        self.num_experts = num_experts
        rows = np.repeat(np.arange(n), k)
        a = sparse.csr_matrix((np.ones(n * k), (rows, self.topk.reshape(-1))), shape=(n, num_experts))
        self.At = a.T.tocsr()

    @property
    def n(self) -> int:
        return int(self.topk.shape[0])

    def tokens_of(self, e: int) -> np.ndarray:
        """(n_e,) the tokens that route to expert ``e``, in token order."""
        return self.At.indices[self.At.indptr[e] : self.At.indptr[e + 1]]


def part_counts(tok: Tokens, e2p: np.ndarray, num_parts: int) -> np.ndarray:
    """(N, P) how many of each token's experts sit in each part (``e2p``: (E,) part of each expert)."""
    idx = (np.arange(tok.n)[:, None] * num_parts + e2p[tok.topk]).reshape(-1)
    return np.bincount(idx, minlength=tok.n * num_parts).reshape(tok.n, num_parts).astype(np.int32)


def crossings(tok: Tokens, e2p: np.ndarray, src_part: np.ndarray, mode: CostMode | str) -> np.ndarray:
    """(N,) crossings of each token: remote parts (``per_domain``) or remote experts (``per_pair``),
    counted by :func:`placement.predict.cost.crossings_per_token`."""
    return crossings_per_token(e2p[tok.topk], src_part, "per_pair" if mode == "per_pair" else "per_domain")
