"""The dispatcher's node rule: which EP ranks of an EP group share a node, and where RDMA lands.

HybridEP and DeepEP's normal (internode) kernels do not see NVLink domains: they number the ``ep``
ranks of an EP group as ``node = rank // n`` and ``local = rank % n`` and move every byte between
two different nodes over RDMA, even when both nodes sit in one NVLink domain.  The evaluator
(:func:`placement.predict.cost.evaluate`), the expert search's classes and the exports all read the node of
an EP rank from :func:`node_labels`, so they agree on every layout, runnable under the equal-slice
rule or not.

Sources (read for this module):

- HybridEP: deepseek-ai/DeepEP branch ``hybrid-ep`` @94a9f8f, ``deep_ep/hybrid_ep_buffer.py``
  (``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` read from the environment, else detected; the group
  size must be a multiple of it; ``local_rank = rank % n``, ``node_rank = rank // n``);
  ``docs/Hybrid-EP_Implementation.md`` ("GPUs with the same local rank across different nodes" are
  peers; IB between peers first, then each rank distributes over NVLink inside its node; the combine
  "pre-reduces data within node before sending to peers").
- DeepEP normal mode: deepseek-ai/DeepEP @dd758ca, ``csrc/legacy/buffer.hpp`` (``rdma_rank = rank /
  NUM_MAX_NVL_PEERS``, ``nvl_rank = rank % NUM_MAX_NVL_PEERS``, ``NUM_MAX_NVL_PEERS == 8``; a group
  of more than 8 ranks must be a multiple of 8) and ``csrc/kernels/legacy/internode.cu`` (the same
  numbering in the kernels).  Its multi-node NVLink path was not verified in the source; NVIDIA's
  GB200 write-up ("Optimizing DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72",
  NVIDIA/Megatron-LM docs, commit eb0783b) measured DeepEP at EP32 inside one NVL72 rack at about
  400 GB/s dispatch, an NVLink figure that RDMA between nodes of 8 over the rack's NICs could not
  reach.  So a DeepEP group inside one NVLink domain is one node (NVLink only), and a group over
  several domains runs nodes of at most 8 ranks (one copy per remote 8-rank node; copies between
  two such nodes of one rack are still priced on the NIC, an over-count that no fitted ladder row
  and no committed instance exercises: their DeepEP groups sit in one rack or in 8-GPU hosts).

Rules (``rule`` below):

- ``hybridep``: ``n`` is the gcd of the lengths of the group's runs of consecutive EP ranks in one
  NVLink domain: the largest value the kernel can run (every node inside one domain).  A group with
  equal consecutive slices per domain gets ``n`` = its slice, so a node is the group's part of a
  domain; an 8/56 split gets ``n = 8`` (eight nodes, seven of them in one rack, RDMA between them).
- ``deepep``: a group inside one domain is one node (NVLink only); a group over several domains
  runs nodes of ``gcd(n_hybridep, 8)`` ranks.
- ``pair`` (Megatron's ``alltoall`` dispatcher over NCCL, DeepEP low-latency): no node; a
  (token, expert) pair crosses the fabric when the expert's GPU is in another NVLink domain, so the
  label of an EP rank is its domain.
- ``domain``: a node is the group's whole part of an NVLink domain, however the group is split (no
  dispatcher runs this on an unequal split; it is what the rank layout's estimator counts,
  solvers/layout, and equals ``hybridep`` on every equal-slice layout).  Never the default.
"""

from __future__ import annotations

from math import gcd
from typing import Literal

import numpy as np

from placement.core.model import CostMode, Instance

__all__ = ["NodeRule", "NODE_RULES", "node_rule", "run_lengths", "node_size", "node_labels", "DEEPEP_MAX_NVL_PEERS"]

NodeRule = Literal["hybridep", "deepep", "pair", "domain"]
NODE_RULES: tuple[NodeRule, ...] = ("hybridep", "deepep", "pair", "domain")

#: DeepEP's ``NUM_MAX_NVL_PEERS`` (csrc/legacy/buffer.hpp): ranks per node of its internode kernels.
DEEPEP_MAX_NVL_PEERS = 8


def node_rule(instance: Instance, cost_mode: CostMode | None = None) -> NodeRule:
    """The node rule of ``instance``'s dispatcher in ``cost_mode`` (default: the instance's).

    ``per_pair`` -> ``pair``; ``per_domain`` -> ``deepep`` when ``performance.dispatcher`` is
    ``deepep``, else ``hybridep`` (the default dispatcher of the ``per_domain`` mode).
    """
    mode = cost_mode or instance.cost_mode
    if mode == "per_pair":
        return "pair"
    perf = getattr(instance, "performance", None)
    return "deepep" if getattr(perf, "dispatcher", None) == "deepep" else "hybridep"


def run_lengths(domains: np.ndarray) -> list[int]:
    """Lengths of the runs of equal consecutive values of one EP group's ``domains`` (ep,).

    Examples
    --------
    >>> run_lengths(np.array([1, 1, 0, 0, 0, 0, 0, 0]))
    [2, 6]
    """
    d = np.asarray(domains).reshape(-1)
    cuts = np.flatnonzero(d[1:] != d[:-1]) + 1
    bounds = np.concatenate([[0], cuts, [d.shape[0]]])
    return [int(x) for x in np.diff(bounds)]


def node_size(domains: np.ndarray, rule: NodeRule) -> int:
    """Ranks per node of one EP group whose EP ranks sit in ``domains`` (ep,) under ``rule``.

    For ``pair`` the value is the gcd of the runs too (informative only: that rule has no nodes).

    Examples
    --------
    >>> node_size(np.array([0] * 8 + [1] * 56), "hybridep")
    8
    >>> node_size(np.array([0] * 32 + [1] * 32), "hybridep"), node_size(np.array([0] * 32 + [1] * 32), "deepep")
    (32, 8)
    >>> node_size(np.array([0, 0, 1, 1, 1, 1]), "hybridep")
    2
    """
    runs = run_lengths(domains)
    n = 0
    for r in runs:
        n = gcd(n, r)
    if rule == "deepep" and len(set(np.asarray(domains).tolist())) > 1:
        n = gcd(n, DEEPEP_MAX_NVL_PEERS)
    return n


def node_labels(group_domain: np.ndarray, rule: NodeRule) -> tuple[np.ndarray, np.ndarray]:
    """Node label of every EP rank and node size of every EP group.

    Parameters
    ----------
    group_domain : (..., ep) int, NVLink domain of each EP rank of each EP group.
    rule : :data:`NodeRule`.

    Returns
    -------
    ``(labels (..., ep) int64, sizes (...) int64)``.  Within one EP group two EP ranks share a label
    exactly when they share a node (``pair``: a domain).  A label is ``domain`` when the node is
    the group's whole slice of that domain (every equal-slice layout, and ``pair``), else
    ``num_domains_bound + domain * ep + rank // n``, so labels are never shared across different
    nodes of one group and the equal-slice case keeps the domain ids.  ``num_domains_bound`` is
    ``group_domain.max() + 1``.

    Examples
    --------
    >>> lab, n = node_labels(np.array([[0, 0, 1, 1, 1, 1]]), "hybridep")
    >>> lab.tolist(), n.tolist()
    ([[2, 2, 9, 9, 10, 10]], [2])
    >>> node_labels(np.array([[2, 2, 1, 1]]), "hybridep")[0].tolist()
    [[2, 2, 1, 1]]
    """
    dom = np.asarray(group_domain, dtype=np.int64)
    ep = dom.shape[-1]
    flat = dom.reshape(-1, ep)
    base = int(flat.max()) + 1 if flat.size else 1
    labels = np.empty_like(flat)
    sizes = np.empty(flat.shape[0], dtype=np.int64)
    ranks = np.arange(ep, dtype=np.int64)
    for i, row in enumerate(flat):
        n = node_size(row, rule)
        sizes[i] = n
        whole = rule in ("pair", "domain") or all(
            int((row == d).sum()) == n for d in np.unique(row)
        )
        labels[i] = row if whole else base + row * ep + ranks // n
    return labels.reshape(dom.shape), sizes.reshape(dom.shape[:-1])
