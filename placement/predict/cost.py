"""The cost model: the single source of truth for every number the project prints.

For a placement (rank -> GPU, and per MoE layer expert -> EP rank) and a window of sampled tokens,
:func:`evaluate` returns the cross-domain all-to-all bytes of one training step and everything
derived from them.  Every solver, benchmark, notebook and report scores placements with it.

How bytes move (docs/design.md section 3)
------------------------------------
A sampled token of data-parallel index ``j`` in MoE layer ``l`` (pipeline stage ``s``) is sent by
one of the ``tp*cp`` ranks of replica ``j`` in stage ``s`` (sampled tokens are dealt to them in
turn: ``t % (tp*cp)``), and goes to the GPUs of its EP group that host its top-k experts.

- ``per_domain`` (HybridEP, DeepEP normal kernels; the training default): the dispatcher numbers
  an EP group as nodes of ``n`` consecutive EP ranks (:mod:`placement.core.dispatch`: HybridEP ``n`` =
  the gcd of the group's runs per NVLink domain, DeepEP at most 8).  The token crosses the scale-out
  fabric once per node ``!=`` its sender's node that hosts one of its experts, even when both nodes
  sit in one domain; the RDMA copy lands on the rank of that node with the sender's local index
  (exact receiver) and is fanned out over NVLink inside the node; the combine is reduced inside the
  node before RDMA, so it moves the same number of copies back.  With equal consecutive slices per
  domain a node is the group's slice of a domain, and the count is the distinct remote domains.
- ``per_pair`` (Megatron ``alltoall`` dispatcher over NCCL, DeepEP low-latency): once per expert of
  the token hosted outside the source domain, received by the expert's GPU.

One crossing costs ``MoEModel.roundtrip_bytes_per_copy`` fabric bytes per step (the four transfers:
forward dispatch and combine, and the gradient of each in the backward pass, each with its own bytes
per copy).  Each NIC is priced per direction: per layer and GPU the copies it sends (as a source)
and receives (as a landing GPU) are counted apart; in every transfer one direction carries one of
the two counts (dispatch and combine swap them), so the NIC's busier direction carries
``max(sent, received)`` copies per transfer, ``max(sent, received) x roundtrip_bytes_per_copy`` over
the step.  HybridEP's RDMA goes between same-index ranks of two nodes (one rail of a
rail-optimised fabric), so no PXN or spine hop is priced.

NVLink (intra-domain) traffic: in ``per_domain`` every distinct (token, GPU) target other than the
GPU the copy reached first (the source, or the landing GPU of a remote node) receives one copy over
NVLink (``MoEModel.nic_bytes_per_copy`` per copy); in ``per_pair`` every
(token, expert) pair hosted on another GPU of the source domain.

A sampled token stands for ``global_batch * seq_len / dp / tokens_per_source`` real tokens of its
replica in one optimizer step.  The all-to-all time of a layer is the slower of its busiest NIC
(bytes / ``scaleout_gbps``) and its busiest NVLink port (bytes / ``nvlink_gbps``); a stage's time
is the sum over its layers, and the step's is the slowest stage's (the pipeline waits for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal

import numpy as np

from placement.predict.imbalance import lasting_max_over_mean_per_layer
from placement.core.dispatch import NodeRule, node_labels, node_rule
from placement.core.model import CostMode, Instance, InvalidInputError, Placement

if TYPE_CHECKING:  # pragma: no cover
    from placement.core.replicas import ReplicaMap

__all__ = [
    "Window",
    "Metrics",
    "LayoutIndex",
    "evaluate",
    "remote_domains_per_token",
    "crossings_per_token",
    "sampled_token_weight",
    "fabric_bytes_per_crossing",
    "nic_bytes_per_crossing",
]

Window = Literal["sampled", "heldout"]


@dataclass(frozen=True)
class Metrics:
    """Scores of one placement on one window of tokens, in one cost mode (per optimizer step).

    Arrays are plain lists so the object serialises to JSON with stable keys.
    """

    cost_mode: str
    window: str
    cross_domain_bytes_per_step: float
    intra_domain_bytes_per_step: float
    # busiest NIC over the step: per layer and transfer its busier direction (max of copies sent and
    # received), summed over the four transfers and the layers
    max_gpu_cross_domain_bytes_per_step: float
    expert_load_max_over_mean: float  # worst MoE layer: max over GPUs / mean, within EP groups
    remote_domains_per_token: float  # mean over sampled tokens and layers
    remote_experts_per_token: float
    alltoall_time_s_per_step: float  # slowest pipeline stage
    cross_domain_bytes_per_layer: list[float]  # (num_moe_layers,)
    cross_domain_bytes_per_stage: list[float]  # (pp,)
    max_gpu_cross_domain_bytes_per_layer: list[float]  # (num_moe_layers,)
    expert_load_max_over_mean_per_layer: list[float]  # (num_moe_layers,)
    alltoall_time_s_per_stage: list[float]  # (pp,)
    # (pp, ep_groups_per_stage): bytes of the tokens each EP group's ranks send; rows sum to
    # cross_domain_bytes_per_stage
    cross_domain_bytes_per_ep_group: list[list[float]]
    alltoall_time_s_per_layer: list[float]  # (num_moe_layers,) slower of busiest NIC and NVLink port
    # (num_moe_layers,) busiest GPU's NVLink bytes (received copies, one direction, like the NIC
    # column); empty in Metrics built before this field existed
    max_gpu_nvlink_bytes_per_layer: list[float] = field(default_factory=list)
    # (num_moe_layers,) the load ratio above with the window's sampling noise removed
    # (placement.predict.imbalance); what the step-time model prices.  Empty in Metrics built before it.
    expert_load_lasting_max_over_mean_per_layer: list[float] = field(default_factory=list)
    expert_load_lasting_max_over_mean: float = 0.0  # worst MoE layer of the list above (0: absent)
    # (num_moe_layers,) the busiest sender's and the busiest receiver's NIC copies, each times the
    # four transfers' bytes (max_gpu_cross_domain_bytes_per_layer is the busier direction of one GPU)
    max_gpu_nic_sent_bytes_per_layer: list[float] = field(default_factory=list)
    max_gpu_nic_received_bytes_per_layer: list[float] = field(default_factory=list)
    # mean over sampled tokens and layers of the remote nodes (per_domain) or domains (per_pair) reached
    remote_nodes_per_token: float = 0.0
    # EP groups (all stages) the dispatcher runs with nodes smaller than their slice of a domain
    small_node_ep_groups: int = 0
    # Redundant expert slots (placement.predict.replica_cost; zeros without a replica map): N per MoE layer,
    # (pp,) seconds of the replicas' gradient sum on each stage's busiest GPU (spec links, exposed),
    # its bytes over the step on NVLink and on the NIC, and the bytes the slots add to the fullest GPU
    num_redundant_experts: int = 0
    replica_grad_time_s_per_stage: list[float] = field(default_factory=list)
    replica_grad_nvlink_bytes_per_step: float = 0.0
    replica_grad_nic_bytes_per_step: float = 0.0
    replica_memory_bytes_per_gpu: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class LayoutIndex:
    """Everything about a rank layout that scoring needs, computed once.

    ``src_rank``: (pp, dp, tokens_per_source) global rank that sends each sampled token.
    ``rank2group``: (world,) EP group index within its stage; ``rank2eprank``: (world,) EP rank.
    """

    def __init__(self, instance: Instance, rank2gpu: np.ndarray, tokens_per_source: int):
        par = instance.parallel
        self.instance = instance
        self.rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
        groups = par.stage_ep_groups  # (pp, G, ep)
        self.groups = groups
        world = par.world_size
        self.rank2group = np.empty(world, dtype=np.int64)
        self.rank2eprank = np.empty(world, dtype=np.int64)
        pp, ngroups, ep = groups.shape
        self.rank2group[groups.reshape(-1)] = np.repeat(np.tile(np.arange(ngroups), pp), ep)
        self.rank2eprank[groups.reshape(-1)] = np.tile(np.arange(ep), pp * ngroups)
        # Sampled token t of replica j in stage s is sent by the (t % n)-th rank of that replica.
        n_sub = par.tp * par.cp
        src = np.empty((par.pp, par.dp, tokens_per_source), dtype=np.int64)
        t_sub = np.arange(tokens_per_source) % n_sub
        for s in range(par.pp):
            for j in range(par.dp):
                ranks = np.flatnonzero((par.rank2stage == s) & (par.rank2dp == j))
                src[s, j] = ranks[t_sub]
        self.src_rank = src
        gpu2domain = instance.cluster.gpu2domain
        # (pp, G, ep) GPU and domain of each EP rank of each group
        self.group_gpu = self.rank2gpu[groups]
        self.group_domain = gpu2domain[self.group_gpu]
        self._nodes: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def nodes(self, rule: NodeRule | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(group_node (pp, G, ep), node_size (pp, G))``: the dispatcher's node label of every EP
        rank and each EP group's ranks per node (:func:`placement.core.dispatch.node_labels`), under
        ``rule`` (default: the instance's, :func:`placement.core.dispatch.node_rule`).  A group with equal
        consecutive slices per domain keeps its domain ids as labels."""
        rule = rule or node_rule(self.instance)
        got = self._nodes.get(rule)
        if got is None:
            got = node_labels(self.group_domain, rule)
            self._nodes[rule] = got
        return got

    @property
    def group_node(self) -> np.ndarray:
        """(pp, G, ep) node label of each EP rank under the instance's rule (see :meth:`nodes`)."""
        return self.nodes()[0]

    def small_node_groups(self, rule: NodeRule | None = None) -> int:
        """EP groups (over all stages) whose node is smaller than their part of some domain."""
        labels, _ = self.nodes(rule)
        return int((labels != self.group_domain).any(axis=2).sum())

    @cached_property
    def group_domain_counts(self) -> np.ndarray:
        """(pp, G, num_domains) how many GPUs of each EP group sit in each domain."""
        pp, ngroups, _ = self.groups.shape
        nd = self.instance.cluster.num_domains
        out = np.zeros((pp, ngroups, nd), dtype=np.int64)
        for s in range(pp):
            for g in range(ngroups):
                out[s, g] = np.bincount(self.group_domain[s, g], minlength=nd)
        return out


def _window_topk(instance: Instance, window: Window) -> np.ndarray:
    if window == "sampled":
        return instance.routing.topk
    if instance.routing.heldout_topk is None:
        raise InvalidInputError("routing.heldout_topk: no held-out window in this instance view")
    return instance.routing.heldout_topk


def _first_occurrence(values: np.ndarray) -> np.ndarray:
    """(..., k) bool: True where an entry differs from every earlier entry of its row.

    Rows stay in their order; only which entries are marked matters to the callers, which count
    them, so the result equals marking the first of each run after a sort.  Short rows (top-k is 8
    for DeepSeek-V3) compare pairwise, which is much faster than sorting millions of tiny rows.
    """
    k = values.shape[-1]
    if k > 16:
        order = np.argsort(values, axis=-1, kind="stable")
        d = np.take_along_axis(values, order, axis=-1)
        first_sorted = np.ones(d.shape, dtype=bool)
        first_sorted[..., 1:] = d[..., 1:] != d[..., :-1]
        first = np.empty_like(first_sorted)
        np.put_along_axis(first, order, first_sorted, axis=-1)
        return first
    cols = np.ascontiguousarray(values.reshape(-1, k).T)  # (k, tokens): contiguous columns
    first = np.ones(cols.shape, dtype=bool)
    for j in range(1, k):
        seen = cols[0] == cols[j]
        for i in range(1, j):
            seen |= cols[i] == cols[j]
        np.logical_not(seen, out=first[j])
    return np.ascontiguousarray(first.T).reshape(values.shape)


def remote_domains_per_token(token_domains: np.ndarray, src_domain: np.ndarray) -> np.ndarray:
    """Distinct domains of each token's experts other than its source domain.

    Parameters
    ----------
    token_domains : (..., top_k) int, domain hosting each of a token's experts.
    src_domain : (...) int, the token's source domain.

    Returns
    -------
    (...) int count of remote domains.

    Examples
    --------
    >>> remote_domains_per_token(np.array([[0, 1, 1, 2], [0, 0, 0, 0]]), np.array([0, 1]))
    array([2, 1])
    """
    first = _first_occurrence(token_domains)
    return (first & (token_domains != src_domain[..., None])).sum(axis=-1)


def evaluate(
    instance: Instance,
    placement: Placement,
    *,
    window: Window = "sampled",
    cost_mode: CostMode | None = None,
    layout: LayoutIndex | None = None,
    rule: NodeRule | None = None,
    replicas: ReplicaMap | None = None,
) -> Metrics:
    """Score ``placement`` on one window of ``instance``'s tokens.

    Parameters
    ----------
    instance : the problem; its ``cost_mode`` is used unless ``cost_mode`` is given.
    placement : a placement that passed :func:`placement.core.checker.check` (not re-checked here).
    window : ``"sampled"`` (the tokens solvers see) or ``"heldout"`` (scoring only).
    cost_mode : override the instance's dispatcher cost mode.
    layout : a precomputed :class:`LayoutIndex` for ``placement.rank2gpu`` (saves time in loops).
    rule : override the dispatcher's node rule (:func:`placement.core.dispatch.node_rule`); ``domain``
        prices a node as a group's whole part of a domain, what the rank layout's estimator counts.
    replicas : redundant expert slots (:class:`placement.core.replicas.ReplicaMap`, whose first slots per
        rank repeat ``placement.phy2log``): every (token, expert) goes to the slot the runtime's
        arrival-order split picks (:func:`placement.predict.replica_cost.physical_topk`) and bytes and loads
        are counted over slots; the gradient sum and the memory are added
        (:mod:`placement.predict.replica_cost`).  None or ``N = 0``: exactly the permutation's figures.

    Returns
    -------
    Metrics per optimizer step.
    """
    mode: CostMode = cost_mode or instance.cost_mode
    rule = rule or node_rule(instance, mode)
    model, par, cl = instance.model, instance.parallel, instance.cluster
    topk = _window_topk(instance, window)  # (L, dp, T, k)
    num_layers, dp, tokens, k = topk.shape
    if layout is None or layout.src_rank.shape[2] != tokens:
        layout = LayoutIndex(instance, placement.rank2gpu, tokens)
    weight = sampled_token_weight(instance, tokens)  # real tokens per sampled token
    nic_copy = model.nic_bytes_per_copy
    fabric_copy = model.roundtrip_bytes_per_copy
    gpu2domain = cl.gpu2domain
    ngpu = cl.num_gpus
    layer_stage = instance.moe_layer2stage  # (L,)
    e2r = placement.expert2eprank(instance.experts_per_rank)  # (L, E)
    group_node, node_n = layout.nodes(rule)  # (pp, G, ep) node labels, (pp, G) ranks per node

    src_rank = layout.src_rank[layer_stage]  # (L, dp, T)
    src_gpu = layout.rank2gpu[src_rank]
    src_dom = gpu2domain[src_gpu]
    src_group = layout.rank2group[src_rank]  # (L, dp, T)
    src_ep = layout.rank2eprank[src_rank]  # (L, dp, T) EP rank of the sender in its group
    stage3 = layer_stage[:, None, None]
    src_node = group_node[stage3, src_group, src_ep]
    if replicas is not None and replicas.num_redundant:  # price physical slots (placement.predict.replica_cost)
        from placement.predict.replica_cost import check_replica_map, physical_topk

        check_replica_map(instance, replicas)
        topk = physical_topk(topk, replicas, src_rank)
        e2r = np.broadcast_to(replicas.slot2rank, (num_layers, replicas.num_physical))
    # GPU, node and EP rank of every (layer, EP group, expert), then flat gathers for every (token, expert).
    num_experts = e2r.shape[1]
    ngroups = layout.groups.shape[1]
    # The (token, expert) arrays hold GPU and domain ids in the smallest integer type that fits.
    gpu_t = np.int16 if ngpu < 2**15 else np.int32
    expert_gpu = layout.group_gpu[stage3, np.arange(ngroups)[None, :, None], e2r[:, None, :]]
    expert_node = group_node[stage3, np.arange(ngroups)[None, :, None], e2r[:, None, :]]
    row = (np.arange(num_layers)[:, None, None] * ngroups + src_group) * num_experts  # (L, dp, T)
    flat = row[..., None] + topk  # (L, dp, T, k)
    tgt_gpu = expert_gpu.astype(gpu_t).reshape(-1)[flat]  # (L, dp, T, k)
    tgt_dom = gpu2domain.astype(gpu_t)[tgt_gpu]
    remote_pair = tgt_dom != src_dom[..., None]

    # Per-layer, per-GPU counters of copies sent and received over the NIC and of NVLink receptions,
    # indexed by flat (layer, GPU) keys; every (token, expert) gets its key once.
    sent = np.zeros((num_layers, ngpu), dtype=np.float64)
    recv = np.zeros((num_layers, ngpu), dtype=np.float64)
    nvl = np.zeros((num_layers, ngpu), dtype=np.float64)
    cells = num_layers * ngpu
    key_t = np.int32 if num_layers * ngpu < 2**31 else np.int64
    layer_base = np.arange(num_layers, dtype=key_t)[:, None, None] * ngpu  # (L, 1, 1)
    tgt_key = layer_base[..., None] + tgt_gpu  # (L, dp, T, k)

    def count(counter: np.ndarray, keys: np.ndarray) -> None:
        """counter[layer, gpu] += how often each flat key occurs (exact integer counts)."""
        counter += np.bincount(keys.reshape(-1), minlength=cells).reshape(num_layers, ngpu)

    remote_pairs_per_token = remote_pair.sum(axis=-1)  # (L, dp, T)
    # Distinct domains are counted, so the order of a token's experts does not matter.
    remote_dom_mask = _first_occurrence(tgt_dom) & remote_pair
    remote_doms_per_token = remote_dom_mask.sum(axis=-1)

    if mode == "per_domain":
        # HybridEP / DeepEP normal (placement.core.dispatch): one RDMA copy per remote *node* of the
        # token's EP group, landing on the rank of that node with the sender's local index
        # (deepseek-ai/DeepEP hybrid-ep @94a9f8f, docs/Hybrid-EP_Implementation.md: "GPUs with the
        # same local rank across different nodes" are peers), then NVLink fan-out inside the node.
        if rule == "domain" or layout.small_node_groups(rule) == 0:
            remote_node_mask = remote_dom_mask  # every node is a group's part of a domain
        else:
            tgt_node = expert_node.reshape(-1)[flat]  # (L, dp, T, k)
            remote_node_mask = _first_occurrence(tgt_node) & (tgt_node != src_node[..., None])
        crossings_per_token = remote_node_mask.sum(axis=-1)
        if rule == "domain":
            # No dispatcher's landing rule: an even share over the group's GPUs in each remote domain
            # (the rank layout's estimator, solvers/layout, counts it so).
            counts = layout.group_domain_counts  # (pp, G, nd)
            nd = cl.num_domains
            group_key = (np.arange(num_layers)[:, None, None] * ngroups + src_group) * nd  # (L, dp, T)
            into = np.bincount((group_key[..., None] + tgt_dom)[remote_node_mask],
                               minlength=num_layers * ngroups * nd).reshape(num_layers, ngroups, nd)
            for li in range(num_layers):
                s = layer_stage[li]
                for g in range(ngroups):
                    doms = layout.group_domain[s, g]
                    np.add.at(recv[li], layout.group_gpu[s, g], into[li, g, doms] / counts[s, g, doms])
            nv_mask = _first_occurrence(tgt_gpu) & (tgt_gpu != src_gpu[..., None])
        else:
            # The copy into a node lands on its EP rank ``node * n + src_local`` (the sender itself
            # inside its own node); gathered per (layer, group, expert), then per (token, expert).
            n_le = node_n[stage3, np.arange(ngroups)[None, :, None]]  # (L, G, 1) ranks per node
            expert_local = e2r[:, None, :] % n_le  # (L, G, E) the expert's rank's local index
            src_local = (src_ep % node_n[stage3, src_group]).astype(gpu_t)  # (L, dp, T)
            ep = layout.groups.shape[2]
            # (L, G, E) flat index of the expert's node's first rank in a (L, G, ep) table
            node_first = ((np.arange(num_layers)[:, None, None] * ngroups + np.arange(ngroups)[None, :, None]) * ep
                          + e2r[:, None, :] - expert_local).astype(np.int64)
            sel = remote_node_mask
            landing = node_first.reshape(-1)[flat[sel]] + np.broadcast_to(src_local[..., None], sel.shape)[sel]
            landing_key = (layer_base + layout.group_gpu[layer_stage]).reshape(-1)  # (L * G * ep,) flat keys
            count(recv, landing_key[landing])
            # NVLink: distinct target GPUs other than the GPU the copy reached first (the sender, or
            # the RDMA landing GPU of a remote node): a target whose local index is not the sender's.
            tgt_local = expert_local.astype(gpu_t).reshape(-1)[flat]
            nv_mask = _first_occurrence(tgt_gpu) & (tgt_local != src_local[..., None])
        count(nvl, tgt_key[nv_mask])
        remote_nodes_per_token = crossings_per_token
    else:
        crossings_per_token = remote_pairs_per_token
        count(recv, tgt_key[remote_pair])
        local_other = (~remote_pair) & (tgt_gpu != src_gpu[..., None])
        count(nvl, tgt_key[local_other])
        remote_nodes_per_token = remote_doms_per_token
    # Senders: the source GPU's NIC sends every crossing of its token (the combine, reduced per node
    # before RDMA, comes back as the same number of copies, landing GPU -> source).
    src_key = (layer_base + src_gpu).reshape(-1)
    sent += np.bincount(src_key, weights=crossings_per_token.astype(np.float64).reshape(-1), minlength=cells).reshape(
        num_layers, ngpu
    )
    # Each NIC per direction: in every transfer one direction carries the copies the GPU sends, the
    # other those it receives (dispatch and combine swap them), so the busier direction carries
    # max(sent, received) copies of that transfer's bytes; over the step's four transfers that is
    # max(sent, received) x roundtrip_bytes_per_copy.
    nic = np.maximum(sent, recv) * (weight * fabric_copy)
    nvl *= weight * nic_copy
    cross_per_layer = crossings_per_token.sum(axis=(1, 2)) * weight * fabric_copy
    intra_per_layer = nvl.sum(axis=1) * (fabric_copy / nic_copy)  # each NVLink copy counted like a fabric copy
    cross_per_stage = np.bincount(layer_stage, weights=cross_per_layer, minlength=par.pp)
    # The same crossings, by the (stage, EP group) of the rank that sends each token.
    stage_group = layer_stage[:, None, None] * ngroups + src_group  # (L, dp, T)
    cross_per_group = np.bincount(
        stage_group.reshape(-1), weights=crossings_per_token.astype(np.float64).reshape(-1), minlength=par.pp * ngroups
    ).reshape(par.pp, ngroups) * (weight * fabric_copy)

    # Expert load: (token, expert) pairs per GPU, max over mean within each EP group.
    load = np.zeros((num_layers, ngpu), dtype=np.float64)
    count(load, tgt_key)
    lmm = np.empty(num_layers)
    for li in range(num_layers):
        grp_gpus = layout.group_gpu[layer_stage[li]]  # (G, ep)
        gl = load[li][grp_gpus]
        mean = gl.mean(axis=1)
        lmm[li] = float(np.max(np.where(mean > 0, gl.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)))

    max_nic_layer = nic.max(axis=1)
    layer_time = np.maximum(max_nic_layer / (cl.scaleout_gbps * 1e9), nvl.max(axis=1) / (cl.nvlink_gbps * 1e9))
    stage_time = np.bincount(layer_stage, weights=layer_time, minlength=par.pp)
    ntok = dp * tokens * num_layers
    lasting = lasting_max_over_mean_per_layer(e2r, topk, src_group, par.ep)
    return Metrics(
        cost_mode=mode,
        window=window,
        cross_domain_bytes_per_step=float(cross_per_layer.sum()),
        intra_domain_bytes_per_step=float(intra_per_layer.sum()),
        max_gpu_cross_domain_bytes_per_step=float(nic.sum(axis=0).max()),
        expert_load_max_over_mean=float(lmm.max()),
        remote_domains_per_token=float(remote_doms_per_token.sum() / ntok),
        remote_experts_per_token=float(remote_pairs_per_token.sum() / ntok),
        alltoall_time_s_per_step=float(stage_time.max()),
        cross_domain_bytes_per_layer=[float(x) for x in cross_per_layer],
        cross_domain_bytes_per_stage=[float(x) for x in cross_per_stage],
        max_gpu_cross_domain_bytes_per_layer=[float(x) for x in max_nic_layer],
        expert_load_max_over_mean_per_layer=[float(x) for x in lmm],
        alltoall_time_s_per_stage=[float(x) for x in stage_time],
        cross_domain_bytes_per_ep_group=[[float(x) for x in row] for row in cross_per_group],
        alltoall_time_s_per_layer=[float(x) for x in layer_time],
        max_gpu_nvlink_bytes_per_layer=[float(x) for x in nvl.max(axis=1)],
        expert_load_lasting_max_over_mean_per_layer=lasting,
        expert_load_lasting_max_over_mean=max(lasting, default=1.0),
        max_gpu_nic_sent_bytes_per_layer=[float(x) for x in sent.max(axis=1) * (weight * fabric_copy)],
        max_gpu_nic_received_bytes_per_layer=[float(x) for x in recv.max(axis=1) * (weight * fabric_copy)],
        remote_nodes_per_token=float(remote_nodes_per_token.sum() / ntok),
        small_node_ep_groups=layout.small_node_groups(rule) if mode == "per_domain" else 0,
        **_replica_fields(instance, placement, replicas),
    )


def _replica_fields(instance: Instance, placement: Placement, replicas: ReplicaMap | None) -> dict:
    """The Metrics' replica fields (:mod:`placement.predict.replica_cost`); empty without redundant slots."""
    if replicas is None or not replicas.num_redundant:
        return {}
    from placement.predict.replica_cost import (expert_params_or_none, replica_grad_bytes_per_step,
                                        replica_grad_time_s_per_stage, replica_memory_bytes_per_gpu)

    params = expert_params_or_none(instance)
    nvl, nic = replica_grad_bytes_per_step(instance, replicas, placement.rank2gpu, params)
    return {
        "num_redundant_experts": replicas.num_redundant,
        "replica_grad_time_s_per_stage": replica_grad_time_s_per_stage(instance, replicas, placement.rank2gpu, params),
        "replica_grad_nvlink_bytes_per_step": nvl,
        "replica_grad_nic_bytes_per_step": nic,
        # 0 when the expert size is unknown (no performance block): JSON has no NaN
        "replica_memory_bytes_per_gpu": replica_memory_bytes_per_gpu(instance, replicas, params) if params else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# Primitives for the solvers' fast estimators (the rank layout's scorer): the same counting rules
# and per-crossing weights as :func:`evaluate`, on one group's tokens.
# ---------------------------------------------------------------------------------------------
def crossings_per_token(token_domains: np.ndarray, src_domain: np.ndarray, cost_mode: CostMode) -> np.ndarray:
    """Scale-out crossings of each token in ``cost_mode``, as :func:`evaluate` counts them.

    Parameters
    ----------
    token_domains : (..., top_k) int, domain (or any part label) hosting each of a token's experts.
    src_domain : (...) int, the token's source domain.
    cost_mode : ``per_domain`` (distinct remote domains) or ``per_pair`` (remote experts).

    Returns
    -------
    (...) int crossings.

    Examples
    --------
    >>> crossings_per_token(np.array([[0, 1, 1, 2]]), np.array([0]), "per_pair")
    array([3])
    """
    if cost_mode == "per_pair":
        return (token_domains != src_domain[..., None]).sum(axis=-1)
    return remote_domains_per_token(token_domains, src_domain)


def sampled_token_weight(instance: Instance, sampled_tokens_per_source: int) -> float:
    """Real tokens one sampled token stands for in one optimizer step (:func:`evaluate`'s weight)."""
    return instance.parallel.tokens_per_dp_rank_per_step / max(1, sampled_tokens_per_source)


def fabric_bytes_per_crossing(instance: Instance, sampled_tokens_per_source: int) -> float:
    """Scale-out bytes per step of one sampled crossing (forward and backward, dispatch and combine)."""
    return sampled_token_weight(instance, sampled_tokens_per_source) * instance.model.roundtrip_bytes_per_copy


def nic_bytes_per_crossing(instance: Instance, sampled_tokens_per_source: int) -> float:
    """Bytes per step one sampled NVLink copy puts on its receiving port (the NIC is priced per direction
    at :func:`fabric_bytes_per_crossing` per copy, see :func:`evaluate`)."""
    return sampled_token_weight(instance, sampled_tokens_per_source) * instance.model.nic_bytes_per_copy

