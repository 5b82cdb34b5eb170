"""The pure data model: a MoE model, its parallel layout, a cluster, routing statistics, a placement.

Nothing here imports a solver or touches a file. Every object is a frozen dataclass; arrays are
numpy arrays that the constructors make read-only, so a solver cannot change an instance by accident.

Naming: maps say their direction (``rank2gpu``, ``gpu2domain``, ``phy2log``), sizes their unit
(``*_bytes``, ``*_gbps`` = 10^9 bytes/s, ``*_s``).

Glossary (one meaning each, used everywhere in the package, the solvers and the docs)
-------------------------------------------------------------------------------------
- **domain**: an NVLink domain (an NVL72 rack); bytes between domains cross the scale-out fabric.
- **tray**: a compute tray of ``gpus_per_tray`` GPUs inside a domain; the unit a scheduler loses.
- **stage**: a pipeline-parallel stage (index ``0 .. pp-1``); it holds ``stage_layers``.
- **EP group**: the ``ep`` ranks of one stage that split a layer's experts between them (expert
  parallelism); a stage has ``dp * tp * cp / ep`` EP groups sharing one expert map.
- **expert group**: a routing group of ``num_experts / num_groups`` contiguous logical expert ids
  (DeepSeek's ``n_group``); group-limited routing lets a token use ``groups_per_token`` of them.
- **group position**: the ``num_experts / num_groups`` contiguous physical slots that hold one whole
  expert group in a group-preserving map.
- **source**: a data-parallel index ``j``; its sampled tokens are sent by replica ``j``'s ranks.
- **window**: a set of sampled tokens per (MoE layer, source): ``sampled`` is what solvers see
  (they split it into a *fit* part and a *validation* part), ``heldout`` a later window kept for
  scoring only.
- **class**: the EP ranks of a stage that sit in the same domain in every EP group of that stage;
  the cross-domain cost of an expert map depends only on the class of each expert.
- **block** (rank layout only): a set of ranks placed as one unit (an EP group, or the EP groups of
  a stage that must move together); its **footprint** is how many GPUs it takes in each domain,
  its **shape** the sorted multiset of those counts.
- **crossing**: one copy of one sampled token sent over the fabric (``per_domain``: per remote
  domain; ``per_pair``: per remote expert); bytes per step follow from it by one conversion.

Index conventions
-----------------
- GPU id: ``(domain * trays_per_domain + tray) * gpus_per_tray + local``, over every GPU of the
  cluster, available or not.
- Global rank: Megatron-Core's ``RankGenerator`` for the order string (first name fastest).  The
  expert layout uses the expert order (``cp`` removed, ``tp`` read as expert-tensor-parallel
  ``etp``), so with ``etp = 1`` every EP group is ``ep`` consecutive ranks inside one pipeline
  stage.  ``etp = 1`` is the only value supported (:data:`SUPPORTED_ETP`); Megatron-Core defaults
  ``expert_tensor_parallel_size`` to ``tp``, so launches must pass ``--expert-tensor-parallel-size 1``
  (the Slurm launcher that :mod:`placement.consumers.launch` writes does).
- Physical expert slot ``p`` of a layer lives on EP rank ``p // (num_experts // ep)``
  (contiguous blocks, as Megatron, TorchTitan and SGLang lay them out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from placement.core.perfdata import Performance

__all__ = [
    "CostMode",
    "COST_MODES",
    "Apply",
    "APPLY_MODES",
    "DEFAULT_APPLY",
    "MoEModel",
    "ParallelLayout",
    "SUPPORTED_ETP",
    "Cluster",
    "Routing",
    "Instance",
    "Placement",
    "PlacementError",
    "InvalidInputError",
    "InfeasibleError",
    "SolverError",
    "MoveRequest",
    "dispatch_bytes_fp8",
    "combine_bytes_bf16",
]

CostMode = Literal["per_domain", "per_pair"]
COST_MODES: tuple[CostMode, ...] = ("per_domain", "per_pair")
# How a placement's expert maps reach the job (the instance's ``apply`` field, ``solve --apply``):
# ``runtime`` maps logical to physical experts at dispatch time (placement.consumers.runtime hooks for
# Megatron-Core and TorchTitan, SGLang's and vLLM's own expert maps): any map is valid; ``checkpoint``
# renumbers router and experts offline, which must keep expert groups whole under group-limited routing.
Apply = Literal["runtime", "checkpoint"]
APPLY_MODES: tuple[Apply, ...] = ("runtime", "checkpoint")
DEFAULT_APPLY: Apply = "runtime"


# ---------------------------------------------------------------------------------------------
# Exceptions: one small hierarchy by meaning; the CLI maps each to an exit code.
# ---------------------------------------------------------------------------------------------
class PlacementError(Exception):
    """Base of every error this package raises on purpose (CLI exit code 1)."""

    exit_code = 1


class InvalidInputError(PlacementError, ValueError):
    """An input file or argument is malformed; the message names the file and field (exit 2)."""

    exit_code = 2


class InfeasibleError(PlacementError):
    """The request cannot be met: too few GPUs or slots, a consumer rule that cannot hold (exit 3)."""

    exit_code = 3


class SolverError(PlacementError):
    """A solver failed for a reason other than infeasibility (exit 1)."""


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def dispatch_bytes_fp8(hidden_size: int) -> int:
    """Bytes of one FP8 dispatch copy: the hidden vector plus one fp32 scale per 128 values."""
    return hidden_size + (hidden_size // 128) * 4


def combine_bytes_bf16(hidden_size: int) -> int:
    """Bytes of one BF16 combine copy."""
    return 2 * hidden_size


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEModel:
    """The transformer's MoE shape.

    ``moe_layers`` are the indices (0-based) of the MoE layers; every array over "MoE layers" in
    this package is indexed by position in that tuple, not by layer index.  Indices below
    ``num_layers`` are decoder layers; index ``num_layers + j`` (``0 <= j < mtp_num_layers``) is
    the MoE layer of multi-token-prediction layer ``j``, which runs on the stage holding ``m`` in
    :attr:`ParallelLayout.pipeline_layout`, the last stage without one (DeepSeek-V3's MTP module:
    one transformer layer with its own routed experts).  An MTP layer whose MLP is dense is simply
    not listed.
    """

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    num_groups: int  # expert groups of contiguous ids (n_group); 1 = no group-limited routing
    groups_per_token: int  # topk_group; equals num_groups when routing is not group-limited
    hidden_size: int
    dispatch_bytes_per_token: int  # forward dispatch, one copy (FP8 + scales for DeepSeek-V3: 7,392 B)
    combine_bytes_per_token: int  # forward combine, one copy (BF16: 14,336 B)
    # Backward of the dispatch: the gradient of each dispatched copy, expert GPU -> source GPU.
    # 0 = BF16 (2 * hidden_size), resolved at construction.
    dispatch_grad_bytes_per_token: int = 0
    # Backward of the combine: the gradient of each combined copy, source GPU -> expert GPU.
    # 0 = BF16 (2 * hidden_size), resolved at construction.
    combine_grad_bytes_per_token: int = 0
    # Multi-token-prediction layers after the decoder (Megatron's mtp_num_layers); their MoE
    # layers, if any, carry the indices num_layers + j in moe_layers.
    mtp_num_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("dispatch_grad_bytes_per_token", "combine_grad_bytes_per_token"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, combine_bytes_bf16(self.hidden_size))

    @property
    def group_limited(self) -> bool:
        return self.num_groups > 1 and self.groups_per_token < self.num_groups

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_mtp(self, layer: int) -> bool:
        """Whether layer index ``layer`` is a multi-token-prediction layer (``>= num_layers``)."""
        return self.num_layers <= layer < self.num_layers + self.mtp_num_layers

    @property
    def mtp_moe_layers(self) -> tuple[int, ...]:
        """The MoE layer indices of the MTP layers (``num_layers + j``), possibly empty."""
        return tuple(layer for layer in self.moe_layers if layer >= self.num_layers)

    @property
    def transfer_bytes_per_copy(self) -> dict[str, int]:
        """Bytes of one token copy in each of the four all-to-all transfers of a step.

        Keys, in time order: ``forward_dispatch`` (source -> expert), ``forward_combine``
        (expert -> source), ``backward_combine`` (the combine's gradient, source -> expert) and
        ``backward_dispatch`` (the dispatch's gradient, expert -> source).
        """
        return {
            "forward_dispatch": self.dispatch_bytes_per_token,
            "forward_combine": self.combine_bytes_per_token,
            "backward_combine": self.combine_grad_bytes_per_token,
            "backward_dispatch": self.dispatch_grad_bytes_per_token,
        }

    @property
    def roundtrip_bytes_per_copy(self) -> int:
        """Fabric bytes of one token copy over a step: the four transfers, forward and backward."""
        return sum(self.transfer_bytes_per_copy.values())

    @property
    def nic_bytes_per_copy(self) -> int:
        """Bytes one copy puts on each end's NIC in its busier direction over a step.

        The source's NIC sends the forward dispatch and the backward combine (the combine's
        gradient) and receives the forward combine and the backward dispatch (the dispatch's
        gradient); the expert end's NIC the reverse.  Each copy is priced at the busier of the two
        directions, ``max(dispatch + combine_grad, combine + dispatch_grad)``: with the defaults
        (FP8 dispatch, BF16 combine and gradients) 28,672 B for DeepSeek-V3, where the earlier
        model, which priced the dispatch gradient as FP8, had 21,728 B.
        """
        return max(
            self.dispatch_bytes_per_token + self.combine_grad_bytes_per_token,
            self.combine_bytes_per_token + self.dispatch_grad_bytes_per_token,
        )


# Expert-tensor-parallel sizes the cost model and the solvers handle: each expert whole on one GPU.
SUPPORTED_ETP: tuple[int, ...] = (1,)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelLayout:
    """Megatron-Core style parallel layout.

    ``dp`` is the data-parallel size of the dense part, so the world is ``tp * cp * dp * pp``.
    Expert parallelism splits the ``tp * cp * dp`` ranks of a stage into EP groups of ``ep``
    consecutive ranks (expert tensor parallel ``etp = 1``); ``stage_layers[s]`` lists the layer
    indices that pipeline stage ``s`` holds.  ``etp`` (Megatron's ``expert_tensor_parallel_size``)
    is stored so that it can be checked and launched with: only :data:`SUPPORTED_ETP` is modelled
    (:func:`placement.core.checker.etp_violations`).
    """

    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    order: str
    stage_layers: tuple[tuple[int, ...], ...]
    seq_len: int  # tokens per sequence
    micro_batch: int  # sequences per micro-batch
    global_batch: int  # sequences per optimizer step
    etp: int = 1  # expert-tensor-parallel size (Megatron defaults it to tp; only 1 is modelled)
    # Megatron-Core's pipeline_model_parallel_layout unrolled (placement.core.pipeline_layout): pp * vpp
    # strings over "EtmL", chunk i on stage i % pp; stage_layers then lists each stage's decoder
    # layers over its virtual stages.  Empty: no layout (E on the first stage, MTP and L on the last).
    pipeline_layout: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ranks_per_stage(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def ep_groups_per_stage(self) -> int:
        return self.ranks_per_stage // self.ep

    @property
    def tokens_per_dp_rank_per_step(self) -> int:
        """Tokens one data-parallel replica pushes through every layer in one optimizer step."""
        return self.global_batch * self.seq_len // self.dp

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @cached_property
    def rank_coords(self) -> dict[str, np.ndarray]:
        """Coordinates of every global rank: ``{"tp","cp","dp","pp": (world,) int}``.

        Follows Megatron-Core's ``RankGenerator``: the order string's first name varies fastest.
        ``ep`` is dropped from the dense order (it is a split of ``tp*cp*dp`` inside a stage).
        """
        names = [n for n in self.order.split("-") if n != "ep"]
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        ranks = np.arange(self.world_size)
        coords: dict[str, np.ndarray] = {}
        stride = 1
        for n in names:
            coords[n] = (ranks // stride) % sizes[n]
            stride *= sizes[n]
        return coords

    @cached_property
    def rank2stage(self) -> np.ndarray:
        """(world,) pipeline stage of each rank."""
        return _frozen(self.rank_coords["pp"])

    @cached_property
    def rank2dp(self) -> np.ndarray:
        """(world,) data-parallel index of each rank: whose routing statistics it carries."""
        return _frozen(self.rank_coords["dp"])

    @cached_property
    def stage_ep_groups(self) -> np.ndarray:
        """(pp, ep_groups_per_stage, ep) global ranks of every EP group, in EP-rank order.

        With expert tensor parallel 1 an EP group is ``ep`` consecutive ranks among the stage's
        ranks, taken in global-rank order (Megatron's expert ``RankGenerator``).
        """
        out = np.empty((self.pp, self.ep_groups_per_stage, self.ep), dtype=np.int64)
        for s in range(self.pp):
            ranks = np.flatnonzero(self.rank2stage == s)
            out[s] = ranks.reshape(self.ep_groups_per_stage, self.ep)
        return _frozen(out)

    @cached_property
    def layer2stage(self) -> dict[int, int]:
        return {layer: s for s, layers in enumerate(self.stage_layers) for layer in layers}

    def item_stage(self, item: str) -> int:
        """The stage holding layout item ``item`` (``E``, ``m`` MTP, ``L`` loss).

        Without a :attr:`pipeline_layout`: ``E`` on the first stage, ``m`` and ``L`` on the last.
        """
        for i, chunk in enumerate(self.pipeline_layout):
            if item in chunk:
                return i % self.pp
        return 0 if item == "E" else self.pp - 1


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """NVLink domains (racks) of trays (hosts) of GPUs; some GPUs unavailable.

    ``available``: (num_gpus,) bool.  Host ``h = domain * trays_per_domain + tray`` has GPUs
    ``h * gpus_per_tray ... + gpus_per_tray - 1``; its name is ``host_names[h]`` when the cluster
    was read from a scheduler (``placement cluster``), else ``host_format`` formatted with
    ``domain``, ``tray`` and ``host``.

    ``host_names``: ``None``, or (num_domains * trays_per_domain,) real host names in host order;
    ``""`` marks a tray slot with no host (a rack with fewer trays than the largest), whose GPUs
    are unavailable.  ``domain_names``: ``None``, or (num_domains,) the scheduler's names of the
    NVLink domains (Slurm blocks or switches, NVLink cliques).
    """

    num_domains: int
    trays_per_domain: int
    gpus_per_tray: int
    available: np.ndarray
    nvlink_gbps: float  # per GPU, 10^9 bytes/s
    scaleout_gbps: float  # per GPU NIC, 10^9 bytes/s, each direction
    host_format: str = "rack{domain:02d}-tray{tray:02d}"
    host_names: tuple[str, ...] | None = None
    domain_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "available", _frozen(np.asarray(self.available, dtype=bool)))
        if self.host_names is not None:
            names = tuple(str(n) for n in self.host_names)
            if len(names) != self.num_domains * self.trays_per_domain:
                raise InvalidInputError(
                    f"cluster.hosts: expected {self.num_domains * self.trays_per_domain} host slots, found {len(names)}"
                )
            object.__setattr__(self, "host_names", names)
        if self.domain_names is not None:
            domains = tuple(str(n) for n in self.domain_names)
            if len(domains) != self.num_domains:
                raise InvalidInputError(f"cluster.domain_names: expected {self.num_domains} names, found {len(domains)}")
            object.__setattr__(self, "domain_names", domains)

    @property
    def gpus_per_domain(self) -> int:
        return self.trays_per_domain * self.gpus_per_tray

    @property
    def num_gpus(self) -> int:
        return self.num_domains * self.gpus_per_domain

    @cached_property
    def gpu2domain(self) -> np.ndarray:
        """(num_gpus,) NVLink domain of each GPU."""
        return _frozen(np.arange(self.num_gpus) // self.gpus_per_domain)

    @cached_property
    def gpu2tray(self) -> np.ndarray:
        """(num_gpus,) tray index inside its domain."""
        return _frozen((np.arange(self.num_gpus) // self.gpus_per_tray) % self.trays_per_domain)

    @cached_property
    def gpu2host(self) -> np.ndarray:
        """(num_gpus,) global host (tray) index."""
        return _frozen(np.arange(self.num_gpus) // self.gpus_per_tray)

    @cached_property
    def available_gpus(self) -> np.ndarray:
        """Sorted ids of the available GPUs: by (domain, tray, GPU)."""
        return _frozen(np.flatnonzero(self.available))

    def host_name(self, host: int) -> str:
        """The name of host (tray) ``host``: its real name, else ``host_format``'s."""
        if self.host_names is not None and self.host_names[int(host)]:
            return self.host_names[int(host)]
        domain, tray = divmod(int(host), self.trays_per_domain)
        return self.host_format.format(domain=domain, tray=tray, host=int(host))

    def domain_name(self, domain: int) -> str:
        """The scheduler's name of NVLink domain ``domain``, else ``d<domain>``."""
        if self.domain_names is not None:
            return self.domain_names[int(domain)]
        return f"d{int(domain)}"

    @cached_property
    def host_index(self) -> dict[str, int]:
        """Host name -> host (tray) index, for every tray slot that has a host."""
        hosts = range(self.num_domains * self.trays_per_domain)
        return {self.host_name(h): h for h in hosts if self.host_names is None or self.host_names[h]}


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Sampled routing statistics.

    ``topk``: (num_moe_layers, dp, tokens_per_source, top_k) expert ids of the sampled tokens of
    each data-parallel rank (the fit window).  ``heldout_topk``: the same shape over a later window,
    for scoring only (no solver reads it); ``None`` in the view handed to solvers.

    ``window_tokens``: ``None`` (one sampled window), or the tokens per source of each of several
    time-ordered sampled windows, oldest first, summing to ``tokens_per_source``: window ``w`` is
    ``topk[:, :, a_w : a_w + window_tokens[w]]`` (:meth:`window_bounds`).  Everything that reads
    ``topk`` as one window sees the windows' union; the expert fit (``SolveOptions.fit``) reads them
    one by one.
    """

    topk: np.ndarray
    heldout_topk: np.ndarray | None
    window_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "topk", _frozen(self.topk))
        if self.heldout_topk is not None:
            object.__setattr__(self, "heldout_topk", _frozen(self.heldout_topk))
        if self.window_tokens is not None:
            wt = tuple(int(t) for t in self.window_tokens)
            if len(wt) < 2 or min(wt) < 1 or sum(wt) != self.topk.shape[2]:
                raise InvalidInputError(
                    f"routing.window_tokens: expected at least 2 positive counts summing to the "
                    f"{self.topk.shape[2]} sampled tokens per source, found {list(wt)}"
                )
            object.__setattr__(self, "window_tokens", wt)

    @property
    def tokens_per_source(self) -> int:
        return int(self.topk.shape[2])

    @property
    def num_windows(self) -> int:
        """Sampled windows (1 when ``window_tokens`` is None)."""
        return 1 if self.window_tokens is None else len(self.window_tokens)

    def window_bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` token range of each sampled window along ``topk``'s axis 2, oldest first."""
        counts = (self.tokens_per_source,) if self.window_tokens is None else self.window_tokens
        ends = np.cumsum((0,) + tuple(counts))
        return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """One placement problem: a model, a layout, a cluster, routing statistics, a cost mode."""

    name: str
    model: MoEModel
    parallel: ParallelLayout
    cluster: Cluster
    routing: Routing
    cost_mode: CostMode
    description: str = ""
    sha256: str = ""  # of the instance's files, set by the reader; identifies it in placements
    extra: dict = field(default_factory=dict, compare=False)  # provenance (generator parameters)
    performance: Performance | None = None  # the optional step-time block (placement.core.perfdata)
    apply: Apply | None = None  # how the expert maps are applied; None: not stated (DEFAULT_APPLY)

    def __post_init__(self) -> None:
        # HybridEP dispatches in BF16 only: megatron-core 0.16.1
        # megatron/core/transformer/moe/fused_a2a.py, init_hybrid_ep_buffer asserts
        # "HybridEP dispatcher does not support fp8 dispatch now" and HybridEPDispatch.forward sets
        # fp8_dispatch = False.  An FP8-sized dispatch copy would price a precision the stack cannot run.
        perf = self.performance
        bf16 = combine_bytes_bf16(self.model.hidden_size)
        if perf is not None and perf.dispatcher == "hybridep" and self.model.dispatch_bytes_per_token != bf16:
            raise InvalidInputError(
                f"model.dispatch_bytes_per_token: {self.model.dispatch_bytes_per_token} B is not HybridEP's BF16 "
                f"dispatch ({bf16} B = 2 x hidden_size): Megatron-Core's HybridEP path cannot dispatch in FP8 "
                "(megatron/core/transformer/moe/fused_a2a.py); use performance.dispatcher deepep for FP8 dispatch"
            )

    @property
    def apply_mode(self) -> Apply:
        """:attr:`apply`, or :data:`DEFAULT_APPLY` when the instance does not state it."""
        return self.apply if self.apply is not None else DEFAULT_APPLY

    @property
    def experts_per_rank(self) -> int:
        return self.model.num_experts // self.parallel.ep

    @cached_property
    def moe_layer2stage(self) -> np.ndarray:
        """(num_moe_layers,) pipeline stage of each MoE layer (MTP layers: the stage holding ``m``)."""
        l2s = self.parallel.layer2stage
        mtp_stage, m = self.parallel.item_stage("m"), self.model
        return _frozen(np.array([mtp_stage if m.is_mtp(layer) else l2s[layer] for layer in m.moe_layers], dtype=np.int64))

    def for_solver(self) -> Instance:
        """The view a solver gets: identical, but without the held-out window."""
        return replace(self, routing=Routing(self.routing.topk, None, self.routing.window_tokens))

    def with_cost_mode(self, cost_mode: CostMode) -> Instance:
        return replace(self, cost_mode=cost_mode)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where everything runs.

    ``rank2gpu``: (world,) physical GPU id of each global rank.
    ``phy2log``: (num_moe_layers, num_experts) logical expert id held by each physical slot of each
    MoE layer; slot ``p`` sits on EP rank ``p // experts_per_rank`` of every EP group of the
    layer's stage (all EP groups of a stage share the layer's expert map, as expert-data-parallel
    replicas must).
    ``pipeline_layout``: the pipeline layout (chunk list, :attr:`ParallelLayout.pipeline_layout`)
    the placement runs with; empty: the instance's.  The evaluator's report applies it.
    """

    rank2gpu: np.ndarray
    phy2log: np.ndarray
    pipeline_layout: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank2gpu", _frozen(np.asarray(self.rank2gpu, dtype=np.int64)))
        object.__setattr__(self, "phy2log", _frozen(np.asarray(self.phy2log, dtype=np.int64)))

    @cached_property
    def log2phy(self) -> np.ndarray:
        """(num_moe_layers, num_experts) physical slot of each logical expert."""
        out = np.empty_like(self.phy2log)
        rows = np.arange(self.phy2log.shape[0])[:, None]
        out[rows, self.phy2log] = np.arange(self.phy2log.shape[1])[None, :]
        return _frozen(out)

    def expert2eprank(self, experts_per_rank: int) -> np.ndarray:
        """(num_moe_layers, num_experts) EP rank hosting each logical expert."""
        return self.log2phy // experts_per_rank


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoveRequest:
    """A re-placement request: keep close to ``previous`` (what the solvers read; the accounting of
    what it moves is :mod:`placement.core.movecount`, reading and checking a previous file
    :mod:`placement.predict.moves`).

    previous : the placement training runs with (same instance shape).
    max_moved_bytes : hard budget on the moved bytes (cross-rack plus NVLink) of the whole placement.
    move_cost : weight ``W`` of a moved byte in per-step all-to-all bytes (the move-cost rule is
        written out in :mod:`placement.predict.moves`).
    expert_params : parameters per routed expert (default: from the instance's ``performance``
        block).
    sharded_optimizer : the optimizer state is sharded over the expert's replicas (Megatron's
        distributed optimizer); False: every replica holds it whole.
    """

    previous: Placement
    max_moved_bytes: float | None = None
    move_cost: float | None = None
    expert_params: int | None = None
    sharded_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.max_moved_bytes is not None and self.move_cost is not None:
            raise InvalidInputError("max_moved_bytes, move_cost: give at most one of them")
        for name in ("max_moved_bytes", "move_cost"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise InvalidInputError(f"{name}: expected a non-negative, finite number, found {v!r}")
        p = self.expert_params
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p <= 0):
            raise InvalidInputError(f"expert_params: expected a positive integer, found {p!r}")
