"""JOB.json and CLUSTER.json: what ``placement plan`` is asked, and the checks on those files.

A job file says *what* to train (the model, its ``performance`` block, the global batch, the
micro-batch sizes to try, precision and optimizer state, recompute, where routing statistics come
from) and nothing about the parallel layout, which the plan chooses.  A cluster file is an
instance's ``cluster`` section plus each GPU's HBM.  Both are read with the instance reader's
parser (duplicate keys, non-finite numbers and unknown keys refused) and its field schemas, and
every error is one :class:`~placement.core.model.InvalidInputError` line naming the file and field.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from placement.formats import (
    INSTANCE_SPEC,
    _check_instance_semantics,
    _load_json,
    _performance,
    cluster_from_section,
    model_from_section,
    read_instance,
)
from placement.core.model import Cluster, CostMode, InvalidInputError, MoEModel
from placement.core.perfdata import Performance
from placement.formats.schema import Any_, Bool, Int, List, Num, Obj, Str, validate

__all__ = [
    "RECOMPUTE_MODES",
    "Recompute",
    "Training",
    "RoutingSource",
    "Job",
    "ClusterSpec",
    "JOB_SPEC",
    "CLUSTER_SPEC",
    "read_job",
    "read_cluster",
    "cluster_spec_from_document",
    "cluster_from_instance",
    "job_from_instance",
]

Recompute = Literal["selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("selective", "full")
GENERATOR_FUNCTION = "placement.generator.generate_routing"  # provenance recorded in instances: stable across code moves
# Generator parameters a job may give (generate_routing's keyword arguments, as instances record them).
_GENERATOR_KEYS = {
    "seed", "num_layers", "num_sources", "tokens_per_source", "num_windows", "num_experts", "top_k",
    "num_groups", "groups_per_token", "num_data_domains", "source_mix_concentration", "skew", "drift",
    "topic_strength",
}
_GENERATOR_REALS = ("source_mix_concentration", "skew", "drift", "topic_strength")
_GENERATOR_META = {"function", "window_fit", "window_heldout", "fit_tokens_per_source", "heldout_tokens_per_source"}


@dataclass(frozen=True)
class Training:
    """Precision and optimizer state per parameter, and the recompute setting.

    Megatron-Core's defaults with ``--bf16 --use-distributed-optimizer``: BF16 weights (2 B), FP32
    main gradients (4 B), FP32 master weights (4 B) and Adam's two FP32 moments (8 B), the last
    two sharded over the data-parallel replicas (``distributed_optimizer``).
    """

    param_bytes: float = 2.0
    grad_bytes: float = 4.0
    master_param_bytes: float = 4.0
    optimizer_state_bytes: float = 8.0
    distributed_optimizer: bool = True
    recompute: Recompute = "selective"


@dataclass(frozen=True)
class RoutingSource:
    """Where the routing statistics of every candidate come from.

    ``generator``: :func:`placement.sources.generator.generate_routing` with ``params`` (``num_sources``
    sources, ``fit_tokens`` and ``heldout_tokens`` per source of windows 0 and 1); ``instance``:
    the routing of the instance file ``path``.  Either gives one base routing, which each
    candidate regroups into its own data-parallel sources (:func:`placement.plan.evaluate.regroup`).
    """

    kind: Literal["generator", "instance"]
    params: dict = field(default_factory=dict, compare=False)
    fit_tokens: int = 0
    heldout_tokens: int = 0
    path: str = ""


@dataclass(frozen=True)
class Job:
    """A training job without its parallel layout (what ``placement plan`` is asked to shape).

    ``micro_batches``: the micro-batch sizes (sequences) the plan may choose from.
    ``performance.vpp`` is ignored: the virtual pipeline size is a candidate dimension.
    """

    name: str
    model: MoEModel
    performance: Performance
    global_batch: int
    seq_len: int
    micro_batches: tuple[int, ...]
    training: Training
    routing: RoutingSource
    cost_mode: CostMode = "per_domain"
    order: str = "tp-cp-ep-dp-pp"
    description: str = ""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster state (``cluster``: racks, trays, free GPUs, links) and each GPU's memory."""

    name: str
    cluster: Cluster
    gpu_hbm_gb: float  # 10^9 bytes per GPU
    hbm_reserve_gb: float  # kept free: CUDA context, NCCL and DeepEP buffers, allocator slack

    @property
    def usable_bytes_per_gpu(self) -> float:
        return (self.gpu_hbm_gb - self.hbm_reserve_gb) * 1e9

    @property
    def free_gpus(self) -> int:
        return int(self.cluster.available.sum())


_INSTANCE_FIELDS = INSTANCE_SPEC.fields
_PERF_SPEC: Obj = _INSTANCE_FIELDS["performance"]
JOB_SPEC = Obj(
    "A training job for placement plan: the model and batch, not the layout.",
    {
        "schema_version": Int("Job format version; must be 1.", 1, 1),
        "kind": Str("Always job.", ("job",)),
        "name": Str("Short name of the job."),
        "description": Str("What the job is."),
        "cost_mode": _INSTANCE_FIELDS["cost_mode"],
        "model": _INSTANCE_FIELDS["model"],
        "performance": Obj(_PERF_SPEC.desc, _PERF_SPEC.fields, _PERF_SPEC.optional | {"vpp"}),
        "batch": Obj(
            "The optimizer step's batch.",
            {
                "global_batch": Int("Sequences per optimizer step.", 1, 2**30),
                "seq_len": Int("Tokens per sequence.", 1, 2**24),
                "micro_batch": List("Micro-batch sizes (sequences) to try.", Int("Sequences.", 1, 2**20), 1),
            },
        ),
        "training": Obj(
            "Precision, optimizer state and recompute (defaults: Megatron-Core BF16, distributed Adam).",
            {
                "param_bytes": Num("Bytes per weight (BF16: 2).", minimum=0, unit="bytes"),
                "grad_bytes": Num("Bytes per main gradient (FP32: 4).", minimum=0, unit="bytes"),
                "master_param_bytes": Num("Bytes per FP32 master weight (4).", minimum=0, unit="bytes"),
                "optimizer_state_bytes": Num("Bytes of optimizer state per parameter (Adam, FP32: 8).", minimum=0, unit="bytes"),
                "distributed_optimizer": Bool("Shard master weights and optimizer state over the data-parallel replicas."),
                "recompute": Str("Activation recompute: selective (core attention) or full (every layer).", RECOMPUTE_MODES),
            },
            optional=frozenset(
                {"param_bytes", "grad_bytes", "master_param_bytes", "optimizer_state_bytes", "distributed_optimizer", "recompute"}
            ),
        ),
        "routing": Obj(
            "Where routing statistics come from: generator parameters, or an instance file whose routing is reused.",
            {
                "generator": Any_("placement.sources.generator.generate_routing's parameters, as instances record them."),
                "instance": Str("An instance file (relative to the job's folder) whose routing is reused."),
            },
            optional=frozenset({"generator", "instance"}),
        ),
    },
    optional=frozenset({"description", "cost_mode", "training"}),
)
_CLUSTER_FIELDS: Obj = _INSTANCE_FIELDS["cluster"]
CLUSTER_SPEC = Obj(
    "A cluster state for placement plan: an instance's cluster section plus GPU memory.",
    {
        "schema_version": Int("Cluster format version; must be 1.", 1, 1),
        "kind": Str("Always cluster.", ("cluster",)),
        "name": Str("Short name of the cluster state."),
        "description": Str("What the cluster state is."),
        **_CLUSTER_FIELDS.fields,
        "gpu_hbm_gb": Num("HBM per GPU.", exclusive_minimum=0, unit="10^9 bytes"),
        "hbm_reserve_gb": Num(
            "HBM per GPU kept free (CUDA context, NCCL and dispatcher buffers, allocator slack).", minimum=0, unit="10^9 bytes"
        ),
    },
    optional=_CLUSTER_FIELDS.optional | {"description", "hbm_reserve_gb"},
)
DEFAULT_HBM_RESERVE_GB = 16.0


def _fail(where: Path, path: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{where}: {path}: {msg}")


def _trivial_parallel(num_layers: int) -> dict:
    return {
        "tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1, "order": "tp-cp-ep-dp-pp",
        "stage_layers": [list(range(num_layers))], "seq_len": 1, "micro_batch": 1, "global_batch": 1,
    }


def _routing_source(where: Path, doc: dict, model: dict) -> RoutingSource:
    r = doc["routing"]
    if ("generator" in r) == ("instance" in r):
        raise _fail(where, "routing", "expected exactly one of generator or instance")
    L = len(model["moe_layers"])
    if "instance" in r:
        rel = r["instance"]
        path = Path(rel) if os.path.isabs(rel) else where.parent / rel
        inst = read_instance(path)  # its own errors name its file
        m = inst.model
        if (m.num_moe_layers, m.num_experts, m.top_k) != (L, model["num_experts"], model["top_k"]):
            raise _fail(where, "routing.instance", f"{rel}: its model's MoE layers, experts or top_k differ from the job's")
        return RoutingSource("instance", {}, inst.routing.tokens_per_source, inst.routing.heldout_topk.shape[2] if inst.routing.heldout_topk is not None else 0, str(path))
    g: dict[str, Any] = dict(r["generator"])
    fn = g.pop("function", GENERATOR_FUNCTION)
    if fn != GENERATOR_FUNCTION:
        raise _fail(where, "routing.generator.function", f"expected {GENERATOR_FUNCTION}, found {fn!r}")
    for key in g:
        if key not in _GENERATOR_KEYS | _GENERATOR_META:
            raise _fail(where, f"routing.generator.{key}", "unknown generator parameter")
    for key in ("seed", "num_sources", "tokens_per_source"):
        if key not in g:
            raise _fail(where, f"routing.generator.{key}", "missing required key")
    for key in _GENERATOR_KEYS | (_GENERATOR_META - {"function"}):
        if key in g and key not in _GENERATOR_REALS:
            v = g[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _fail(where, f"routing.generator.{key}", f"expected a non-negative integer, found {v!r}")
    for key in _GENERATOR_REALS:
        if key in g and (isinstance(g[key], bool) or not isinstance(g[key], (int, float)) or g[key] < 0):
            raise _fail(where, f"routing.generator.{key}", f"expected a non-negative number, found {g[key]!r}")
    for key, want in (("num_layers", L), ("num_experts", model["num_experts"]), ("top_k", model["top_k"]),
                      ("num_groups", model["num_groups"]), ("groups_per_token", model["groups_per_token"])):
        if key in g and g[key] != want:
            raise _fail(where, f"routing.generator.{key}", f"expected the model's {want}, found {g[key]}")
    if g.get("window_fit", 0) != 0 or g.get("window_heldout", 1) != 1:
        raise _fail(where, "routing.generator.window_fit", "only windows 0 (fit) and 1 (held out) are supported")
    if g["num_sources"] < 1 or g["tokens_per_source"] < 1:
        raise _fail(where, "routing.generator.tokens_per_source", "expected num_sources and tokens_per_source >= 1")
    fit = int(g.get("fit_tokens_per_source", g["tokens_per_source"]))
    held = int(g.get("heldout_tokens_per_source", g["tokens_per_source"]))
    if not (1 <= fit <= g["tokens_per_source"] and 1 <= held <= g["tokens_per_source"]):
        raise _fail(where, "routing.generator.fit_tokens_per_source", "fit and held-out tokens must be in [1, tokens_per_source]")
    if g["num_sources"] * g["tokens_per_source"] * L * model["top_k"] > 2**26:
        raise _fail(where, "routing.generator.tokens_per_source", "num_sources x tokens_per_source x MoE layers x top_k exceeds 2^26 ids")
    params = {k: g[k] for k in sorted(g) if k in _GENERATOR_KEYS}
    params.update(num_layers=L, num_experts=model["num_experts"], top_k=model["top_k"],
                  num_groups=model["num_groups"], groups_per_token=model["groups_per_token"], num_windows=2)
    return RoutingSource("generator", params, fit, held, "")


def read_job(path: str | os.PathLike[str]) -> Job:
    """Read and check a job file.

    Raises
    ------
    InvalidInputError
        One line naming the file and the field.
    """
    where = Path(path)
    doc, _ = _load_json(where, "job")
    validate(doc, JOB_SPEC, str(where))
    m = doc["model"]
    perf = copy.deepcopy(doc["performance"])
    perf.pop("vpp", None)
    # The overlap's pp/vpp/ep rules are per candidate (placement.plan.candidates); the trivial
    # layout below would refuse it, so the fake is checked without it.
    fake = {"model": m, "parallel": _trivial_parallel(m["num_layers"]), "performance": dict(perf, overlap="none"),
            "cluster": {"num_domains": 1, "trays_per_domain": 1, "gpus_per_tray": 1, "nvlink_gbps": 900.0, "scaleout_gbps": 100.0}}
    _check_instance_semantics(fake, where)
    performance = _performance({"performance": perf})
    tr = doc.get("training", {})
    defaults = Training()
    training = Training(
        param_bytes=float(tr.get("param_bytes", defaults.param_bytes)),
        grad_bytes=float(tr.get("grad_bytes", defaults.grad_bytes)),
        master_param_bytes=float(tr.get("master_param_bytes", defaults.master_param_bytes)),
        optimizer_state_bytes=float(tr.get("optimizer_state_bytes", defaults.optimizer_state_bytes)),
        distributed_optimizer=bool(tr.get("distributed_optimizer", defaults.distributed_optimizer)),
        recompute=tr.get("recompute", defaults.recompute),
    )
    b = doc["batch"]
    mbs = tuple(b["micro_batch"])
    if len(set(mbs)) != len(mbs):
        raise _fail(where, "batch.micro_batch", "duplicate micro-batch sizes")
    return Job(
        name=doc["name"],
        model=model_from_section(m),
        performance=performance,
        global_batch=b["global_batch"],
        seq_len=b["seq_len"],
        micro_batches=tuple(sorted(mbs)),
        training=training,
        routing=_routing_source(where, doc, m),
        cost_mode=doc.get("cost_mode", "per_domain"),
        description=doc.get("description", ""),
    )


def read_cluster(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read and check a cluster file (an instance's ``cluster`` section plus ``gpu_hbm_gb``).

    Raises
    ------
    InvalidInputError
        One line naming the file and the field.
    """
    where = Path(path)
    doc, _ = _load_json(where, "cluster")
    return cluster_spec_from_document(doc, where)


def cluster_spec_from_document(doc: Any, where: Path) -> ClusterSpec:
    """Check a cluster file's document (``where`` names it in errors) and build its state."""
    validate(doc, CLUSTER_SPEC, str(where))
    c = {k: v for k, v in doc.items() if k in _CLUSTER_FIELDS.fields}
    fake_model = {"num_layers": 1, "moe_layers": [0], "num_experts": 1, "num_groups": 1, "groups_per_token": 1, "top_k": 1}
    _check_instance_semantics({"model": fake_model, "parallel": _trivial_parallel(1), "cluster": c}, where)
    reserve = float(doc.get("hbm_reserve_gb", DEFAULT_HBM_RESERVE_GB))
    if reserve >= doc["gpu_hbm_gb"]:
        raise _fail(where, "hbm_reserve_gb", f"the reserve {reserve:g} GB leaves nothing of gpu_hbm_gb={doc['gpu_hbm_gb']:g}")
    return ClusterSpec(name=doc["name"], cluster=cluster_from_section(c), gpu_hbm_gb=float(doc["gpu_hbm_gb"]), hbm_reserve_gb=reserve)


def cluster_from_instance(instance: Any, *, gpu_hbm_gb: float, hbm_reserve_gb: float = DEFAULT_HBM_RESERVE_GB) -> ClusterSpec:
    """The cluster state of an in-memory instance (for notebooks and tests)."""
    return ClusterSpec(name=instance.name, cluster=instance.cluster, gpu_hbm_gb=gpu_hbm_gb, hbm_reserve_gb=hbm_reserve_gb)


def job_from_instance(
    instance: Any, *, micro_batches: tuple[int, ...] | None = None, training: Training | None = None, name: str | None = None
) -> Job:
    """A job with an instance's model, batch and performance block, its routing reused (in memory).

    The routing stays in ``instance.extra``-free form: the job carries the path when the instance
    was read from a file; an in-memory instance's arrays are passed with :func:`placement.plan.plan`'s
    ``routing`` argument instead.
    """
    if instance.performance is None:
        raise InvalidInputError(f"{instance.name}: performance: the instance has no performance block")
    par = instance.parallel
    held = instance.routing.heldout_topk
    return Job(
        name=name or instance.name,
        model=instance.model,
        performance=dataclasses.replace(instance.performance, vpp=1),
        global_batch=par.global_batch,
        seq_len=par.seq_len,
        micro_batches=micro_batches or (par.micro_batch,),
        training=training or Training(),
        routing=RoutingSource("instance", {}, instance.routing.tokens_per_source, 0 if held is None else held.shape[2],
                              str(instance.extra.get("path", ""))),
        cost_mode=instance.cost_mode,
    )
