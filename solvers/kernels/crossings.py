"""Crossings of weighted nets, and what one crossing costs in bytes: both from :mod:`placement.predict.cost`.

A *net* is a set of tokens with the same source domain and the same expert set, weighted by how
many sampled tokens it stands for.  Its crossings per token are, in the evaluator's words,
``per_domain``: the distinct remote domains its experts reach
(:func:`placement.predict.cost.remote_domains_per_token`); ``per_pair``: the experts hosted outside its
source domain.  Multiplied by :func:`bytes_per_crossing` they are the evaluator's cross-domain bytes.
"""

from __future__ import annotations

import numpy as np

from placement.predict.cost import fabric_bytes_per_crossing, remote_domains_per_token
from placement.core.model import Instance

__all__ = ["net_crossings_of", "bytes_per_crossing"]


def net_crossings_of(token_domains: np.ndarray, src_domain: np.ndarray, weight: np.ndarray, cost_mode: str) -> int:
    """Weighted crossings (an exact integer) of nets whose experts sit in ``token_domains``.

    Parameters
    ----------
    token_domains : (N, k) int, domain of each expert of each net.
    src_domain : (N,) int, each net's source domain.
    weight : (N,) int, sampled tokens per net.
    cost_mode : ``per_domain`` or ``per_pair``.

    Examples
    --------
    >>> dom = np.array([[0, 1, 1], [2, 2, 0]])
    >>> net_crossings_of(dom, np.array([0, 0]), np.array([3, 1]), "per_domain")
    4
    >>> net_crossings_of(dom, np.array([0, 0]), np.array([3, 1]), "per_pair")
    8
    """
    if token_domains.shape[0] == 0:
        return 0
    if cost_mode == "per_pair":
        per_net = (token_domains != src_domain[:, None]).sum(axis=1)
    else:
        per_net = remote_domains_per_token(token_domains, src_domain)
    return int((per_net * weight).sum())


def bytes_per_crossing(instance: Instance, tokens_per_source: int) -> float:
    """Fabric bytes per step of one crossing of one sampled token (:func:`placement.predict.cost.fabric_bytes_per_crossing`)."""
    return fabric_bytes_per_crossing(instance, tokens_per_source)
