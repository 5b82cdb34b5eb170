"""Calibration of the step-time model against measured runs: the published ladder, or yours.

A *ladder* is a JSON file of measured training runs (``{"version": 1, "rows": [...]}``; the row
schema is in docs/formats.md and ``placement/schemas/ladder.schema.json``).  The package ships the
published one, ``placement/data/ladder.json``: DeepSeek-V3 pre-training runs read in Megatron-Bridge's
performance summaries (several releases), NVIDIA's DeepSeek-V3-on-GB200 write-up (its DeepEP and
HybridEP steps) and DeepSeek-V3's technical report.

:func:`calibrate` predicts every row with the step-time model (:mod:`placement.performance`),
fits the named parameters on the rows marked ``fit`` and reports every row's error and the median
absolute error of the rows not fitted.  Fittable parameters: ``gemm_efficiency`` (one per GPU kind
that has a fitted row; H800 rows use H100's when they have none: the same chip), and the shared
``layer_overhead_s``, ``expert_gemm_efficiency`` and ``overlap_efficiency`` (at most two shared).

Each row is modelled as the benchmark ran it: EP groups inside NVLink domains where they fit (64 of
an NVL72 rack's 72 GPUs in use, Slurm ``--segment``; 8-GPU nodes otherwise), the default rank order
``tp-cp-ep-dp-pp``, forced-balanced routing (DeepSeek-V3's group-limited top-8, uniform scores),
stages split so that every stage holds the same number of layer slots where the counts allow.  The
published TFLOP/s of a row also checks the FLOP count, which is not fitted: ``tflops /
tokens_per_s`` equals :func:`placement.performance.model_flops_per_token` within 1%.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares

from placement.cost import evaluate
from placement.model import (
    Cluster,
    Instance,
    InvalidInputError,
    MoEModel,
    ParallelLayout,
    Placement,
    Routing,
    combine_bytes_bf16,
    dispatch_bytes_fp8,
)
from placement.perfdata import (
    DEEPSEEK_V3,
    DISPATCHERS,
    GPU_KINDS,
    OVERLAP_MODES,
    PRECISIONS,
    QWEN3_235B_A22B,
    Architecture,
    Performance,
)
from placement.performance import StepTimeModel
from placement.schema import Any_, Bool, Int, List, Num, Obj, Str, to_json_schema, validate

__all__ = [
    "LADDER_SPEC",
    "FITTABLE",
    "LadderRow",
    "RowResult",
    "Calibration",
    "default_ladder_path",
    "read_ladder",
    "ladder_rows",
    "row_instance",
    "calibrate",
    "ladder_schema",
    "format_table",
]

_BIG_SHAPE = 100_000_000
# Models a row may name: (Architecture, MoE shape).
_MODELS: dict[str, tuple[Architecture, dict[str, Any]]] = {
    "deepseek_v3": (
        DEEPSEEK_V3,
        dict(num_layers=61, first_moe=3, num_experts=256, top_k=8, num_groups=8, groups_per_token=4, hidden_size=7168),
    ),
    "qwen3_235b_a22b": (
        QWEN3_235B_A22B,
        dict(num_layers=94, first_moe=0, num_experts=128, top_k=8, num_groups=1, groups_per_token=1, hidden_size=4096),
    ),
}
# A row's own model shape (rows built from training logs, placement.runlogs): Architecture's fields
# plus the MoE layout; ``first_dense_layers`` leading dense decoder layers.
SHAPE_SPEC = Obj(
    "The model's shape (instead of a named model).",
    {
        "attention": Str("Attention kind.", ("mla", "gqa")),
        **{
            f: Int(f"Architecture.{f} (placement.perfdata).", 0, _BIG_SHAPE)
            for f in (
                "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size",
                "vocab_size", "mtp_num_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim", "num_query_groups", "kv_channels",
            )
        },
        "swiglu": Bool("Gated (SwiGLU) MLPs."),
        "num_layers": Int("Decoder layers.", 1, _BIG_SHAPE),
        "first_dense_layers": Int("Leading dense decoder layers (DeepSeek-V3: 3).", 0, _BIG_SHAPE),
        "hidden_size": Int("Hidden size.", 1, _BIG_SHAPE),
        "num_experts": Int("Routed experts per MoE layer.", 1, _BIG_SHAPE),
        "top_k": Int("Experts per token.", 1, _BIG_SHAPE),
        "num_groups": Int("Expert groups of group-limited routing (1 = none).", 1, _BIG_SHAPE),
        "groups_per_token": Int("Groups a token may use.", 1, _BIG_SHAPE),
    },
)
SHARED_FITTABLE = ("layer_overhead_s", "expert_gemm_efficiency", "overlap_efficiency")
FITTABLE: tuple[str, ...] = ("gemm_efficiency",) + SHARED_FITTABLE
_BIG = 1_000_000

ROW_SPEC = Obj(
    "One measured training run.",
    {
        "name": Str("Unique name of the row."),
        "source": Str("Where the figures were published (title, URL, section)."),
        "release": Str("Software release or document the figures belong to."),
        "date": Str("Publication date, YYYY-MM-DD."),
        "gpu": Str("GPU kind (docs/formats.md).", tuple(GPU_KINDS)),
        "precision": Str("Precision of the GEMMs.", PRECISIONS),
        "model": Str("Model shape (or give family and shape).", tuple(_MODELS)),
        "family": Str("Model family (deepseek_v3, qwen3_235b_a22b, ...; rows with a shape)."),
        "shape": SHAPE_SPEC,
        "mtp_num_layers": Int("Multi-token-prediction layers of the run (0 = none).", 0, 1),
        "gpus": Int("GPUs of the job.", 1, _BIG),
        "tp": Int("Tensor-parallel size.", 1, _BIG),
        "cp": Int("Context-parallel size.", 1, _BIG),
        "pp": Int("Pipeline-parallel size.", 1, _BIG),
        "vpp": Int("Virtual pipeline stages per GPU (1 = none).", 1, _BIG),
        "ep": Int("Expert-parallel size.", 1, _BIG),
        "dp": Int("Data-parallel size: gpus / (tp * cp * pp).", 1, _BIG),
        "micro_batch": Int("Micro-batch size, sequences.", 1, _BIG),
        "global_batch": Int("Global batch size, sequences.", 1, _BIG),
        "seq_len": Int("Sequence length, tokens.", 1, _BIG),
        "dispatcher": Str("All-to-all backend.", tuple(DISPATCHERS)),
        "dispatch_precision": Str("Precision of the forward dispatch copies.", ("fp8", "bf16")),
        "overlap": Str("EP all-to-all overlap (Megatron-Core's combined 1F1B) or none.", OVERLAP_MODES),
        "recompute": Str("Recomputed modules as published (free text; not modelled)."),
        "expert_load": Str("balanced (forced-balanced benchmark) or routing (priced as balanced here).", ("balanced", "routing")),
        "tokens_per_s_per_gpu": Num("Published tokens/s per GPU.", exclusive_minimum=0),
        "tflops_per_gpu": Num("Published model TFLOP/s per GPU.", exclusive_minimum=0),
        "fit": Bool("Whether the fit uses this row."),
        "note": Str("Anything a reader needs to know about the row."),
    },
    optional=frozenset(
        {
            "release",
            "date",
            "model",
            "family",
            "shape",
            "mtp_num_layers",
            "cp",
            "vpp",
            "dispatcher",
            "dispatch_precision",
            "overlap",
            "recompute",
            "expert_load",
            "tokens_per_s_per_gpu",
            "tflops_per_gpu",
            "fit",
            "note",
        }
    ),
)
LADDER_SPEC = Obj(
    "Measured training runs to calibrate the step-time model on (placement calibrate).",
    {"version": Int("Format version.", 1, 1), "rows": List("The runs.", ROW_SPEC, 1)},
)


_TOP_SPEC = Obj(LADDER_SPEC.desc, {"version": LADDER_SPEC.fields["version"], "rows": List("The runs.", Any_("A row."), 1)})


def ladder_schema() -> dict:
    """The ladder's JSON Schema (``placement/schemas/ladder.schema.json``)."""
    return to_json_schema(LADDER_SPEC, "placement calibration ladder")


@dataclass(frozen=True)
class LadderRow:
    """One measured run (fields as in :data:`ROW_SPEC`)."""

    name: str
    source: str
    gpu: str
    precision: str
    gpus: int
    tp: int
    pp: int
    ep: int
    dp: int
    micro_batch: int
    global_batch: int
    seq_len: int
    model: str = ""
    family: str = ""
    shape: dict[str, Any] | None = None
    release: str = ""
    date: str = ""
    mtp_num_layers: int = 1
    cp: int = 1
    vpp: int = 1
    dispatcher: str = "hybridep"
    dispatch_precision: str = "bf16"
    overlap: str = "none"
    recompute: str = ""
    expert_load: str = "balanced"
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    fit: bool = False
    note: str = ""

    @property
    def published(self) -> tuple[str, float]:
        """``("tflops", value)`` when TFLOP/s is published, else ``("tokens", tokens/s)``."""
        if self.tflops_per_gpu is not None:
            return "tflops", float(self.tflops_per_gpu)
        assert self.tokens_per_s_per_gpu is not None
        return "tokens", float(self.tokens_per_s_per_gpu)


def default_ladder_path() -> Path:
    """The published ladder shipped with the package."""
    return Path(str(resources.files("placement") / "data" / "ladder.json"))


def _row_error(where: str, i: int, name: str, field: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{where}: rows[{i}] ({name}).{field}: {msg}")


def read_ladder(path: str | os.PathLike[str]) -> list[LadderRow]:
    """Read and check a ladder file; a malformed row raises :class:`InvalidInputError` naming the
    file, the row (index and name) and the field."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise InvalidInputError(f"{where}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{where}: not JSON: {e.msg} at line {e.lineno}") from None
    return ladder_rows(doc, where)


def ladder_rows(doc: Any, where: str) -> list[LadderRow]:
    """Check a ladder document already in memory (``{"version": 1, "rows": [...]}``, what
    :func:`placement.runlogs.rows_document` builds); errors name ``where``."""
    validate(doc, _TOP_SPEC, where)
    rows: list[LadderRow] = []
    seen: set[str] = set()
    for i, raw in enumerate(doc["rows"]):
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        validate(raw, ROW_SPEC, where, f"rows[{i}] ({name})")
        row = LadderRow(**raw)
        _check_row(where, i, row, seen)
        seen.add(row.name)
        rows.append(row)
    return rows


def _check_row(where: str, i: int, r: LadderRow, seen: set[str]) -> None:
    def fail(field: str, msg: str) -> InvalidInputError:
        return _row_error(where, i, r.name, field, msg)

    if r.name in seen:
        raise fail("name", f"duplicate row name {r.name!r}")
    if not r.model and r.shape is None:
        raise fail("model", "a row needs model or shape")
    if r.tokens_per_s_per_gpu is None and r.tflops_per_gpu is None:
        raise fail("tflops_per_gpu", "a row needs tokens_per_s_per_gpu or tflops_per_gpu")
    if r.gpus != r.tp * r.cp * r.pp * r.dp:
        raise fail("dp", f"gpus={r.gpus} is not tp*cp*pp*dp = {r.tp * r.cp * r.pp * r.dp}")
    if (r.tp * r.cp * r.dp) % r.ep:
        raise fail("ep", f"ep={r.ep} does not divide tp*cp*dp = {r.tp * r.cp * r.dp}")
    if r.global_batch % (r.micro_batch * r.dp):
        raise fail("global_batch", f"{r.global_batch} is not a multiple of micro_batch*dp = {r.micro_batch * r.dp}")
    if r.precision not in GPU_KINDS[r.gpu].peak_dense_tflops:
        raise fail("precision", f"no {r.precision} peak for {r.gpu}")
    layers = _model_of(r)[1]["num_layers"]
    if r.pp * r.vpp > layers + 2 + r.mtp_num_layers:
        raise fail("vpp", f"pp*vpp={r.pp * r.vpp} exceeds the model's layer slots")
    if r.overlap == "1f1b":
        if r.pp > 1 and r.vpp < 2:
            raise fail("vpp", f"overlap 1f1b with pp={r.pp} needs vpp > 1 (Megatron-Core refuses it)")
        if r.ep < 2:
            raise fail("overlap", "overlap 1f1b needs ep > 1")


# ---------------------------------------------------------------------------------------------
# A row as an instance
# ---------------------------------------------------------------------------------------------
def _stage_sizes(layers: int, pp: int, mtp: int) -> tuple[int, ...]:
    """Layers per stage, so that the stages' layer slots (layers, +1 embedding on the first, +MTP
    +1 output on the last) are as equal as possible, extra slots to the middle stages."""
    if pp == 1:
        return (layers,)
    total = layers + 2 + mtp
    base, extra = divmod(total, pp)
    slots = [base + (1 if 0 < s <= extra else 0) for s in range(pp)]
    sizes = list(slots)
    sizes[0] -= 1
    sizes[-1] -= 1 + mtp
    if min(sizes) < 1:
        raise ValueError("too many stages for the layers")
    return tuple(sizes)


def _balanced_routing(rng: np.random.Generator, layers: int, dp: int, tokens: int, shape: dict[str, Any]) -> np.ndarray:
    """(layers, dp, tokens, top_k) forced-balanced routing: uniform random scores, then the
    group-limited top-k (``groups_per_token`` of ``num_groups`` groups), as Megatron's
    ``--moe-router-force-load-balancing`` draws it."""
    e, k, g, gk = shape["num_experts"], shape["top_k"], shape["num_groups"], shape["groups_per_token"]
    per_group = e // g
    out = np.empty((layers, dp, tokens, k), dtype=np.int64)
    for li in range(layers):
        groups = np.argsort(rng.random((dp, tokens, g)), axis=-1)[..., :gk]
        local = np.argsort(rng.random((dp, tokens, gk * per_group)), axis=-1)[..., :k]
        out[li] = np.take_along_axis(groups, local // per_group, axis=-1) * per_group + local % per_group
    return out


def _model_of(row: LadderRow) -> tuple[Architecture, dict[str, Any]]:
    """(Architecture, MoE shape) of a row: its own ``shape`` when it has one, else its named model."""
    if row.shape is None:
        return _MODELS[row.model]
    s = row.shape
    arch = Architecture(**{f.name: s[f.name] for f in dataclasses.fields(Architecture)})
    moe = {k: s[k] for k in ("num_layers", "num_experts", "top_k", "num_groups", "groups_per_token", "hidden_size")}
    moe["first_moe"] = s["first_dense_layers"]
    return arch, moe


def row_instance(row: LadderRow, performance: Performance, *, sampled_pairs: int = 8192) -> Instance:
    """An in-memory instance of ``row``: EP groups inside NVLink domains where they fit, balanced
    routing, ``sampled_pairs`` sampled tokens per stage (spread over the sources)."""
    arch, shape = _model_of(row)
    arch = dataclasses.replace(arch, mtp_num_layers=row.mtp_num_layers)
    kind = GPU_KINDS[row.gpu]
    h = shape["hidden_size"]
    n_layers = shape["num_layers"]
    moe_layers = tuple(range(shape["first_moe"], n_layers))
    model = MoEModel(
        name=row.family or row.model,
        num_layers=n_layers,
        moe_layers=moe_layers,
        num_experts=shape["num_experts"],
        top_k=shape["top_k"],
        num_groups=shape["num_groups"],
        groups_per_token=shape["groups_per_token"],
        hidden_size=h,
        dispatch_bytes_per_token=dispatch_bytes_fp8(h) if row.dispatch_precision == "fp8" else combine_bytes_bf16(h),
        combine_bytes_per_token=combine_bytes_bf16(h),
    )
    sizes = _stage_sizes(n_layers, row.pp, row.mtp_num_layers)
    bounds = np.cumsum((0,) + sizes)
    parallel = ParallelLayout(
        tp=row.tp,
        cp=row.cp,
        ep=row.ep,
        dp=row.dp,
        pp=row.pp,
        order="tp-cp-ep-dp-pp",
        stage_layers=tuple(tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])),
        seq_len=row.seq_len,
        micro_batch=row.micro_batch,
        global_batch=row.global_batch,
    )
    domain = kind.nvlink_domain_gpus
    used = 64 if domain == 72 else domain  # NVL72: 64 of 72 GPUs per rack, as the benchmarks run
    racks = -(-row.gpus // used)
    gpus_per_tray = 4 if domain == 72 else domain
    trays = domain // gpus_per_tray
    available = np.zeros(racks * domain, dtype=bool)
    for d in range(racks):
        available[d * domain : d * domain + used] = True
    cluster = Cluster(
        num_domains=racks,
        trays_per_domain=trays,
        gpus_per_tray=gpus_per_tray,
        available=available,
        nvlink_gbps=kind.nvlink_gbps,
        scaleout_gbps=kind.nic_gbps,
    )
    tokens = max(4, -(-sampled_pairs // row.dp))
    rng = np.random.default_rng(row.gpus * 1000 + row.ep)
    routing = Routing(_balanced_routing(rng, len(moe_layers), row.dp, tokens, shape), None)
    perf = dataclasses.replace(
        performance,
        gpu=row.gpu,
        precision=row.precision,
        architecture=arch,
        vpp=row.vpp,
        overlap=row.overlap,
        expert_load="balanced",
    )
    return Instance(
        name=row.name,
        model=model,
        parallel=parallel,
        cluster=cluster,
        routing=routing,
        cost_mode="per_domain",
        description=f"ladder row {row.name}: {row.source}",
        performance=perf,
    )


# ---------------------------------------------------------------------------------------------
# Predict and fit
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowResult:
    """A row's published figure, its prediction and the relative error (predicted / published - 1)."""

    name: str
    gpu: str
    fit: bool
    measure: str  # "tflops" or "tokens"
    published: float
    predicted: float
    error: float
    predicted_tflops_per_gpu: float
    predicted_tokens_per_s_per_gpu: float
    flops_ratio_error: float | None  # published tflops/tokens over the model's FLOPs per token, - 1


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found."""

    fitted: dict[str, float]  # parameter name -> value (``gemm_efficiency:<gpu>`` per GPU kind)
    results: list[RowResult]
    median_abs_error_unfitted: float | None
    performance: Performance  # the block for the first fitted row's GPU kind and precision
    gemm_efficiency_per_gpu: dict[str, float]

    def to_dict(self) -> dict:
        from placement.formats import performance_document

        return {
            "performance": performance_document(self.performance),
            "gemm_efficiency_per_gpu": dict(sorted(self.gemm_efficiency_per_gpu.items())),
            "fitted": dict(sorted(self.fitted.items())),
            "median_abs_error_unfitted": self.median_abs_error_unfitted,
            "rows": [dataclasses.asdict(r) for r in self.results],
        }


class _Row:
    """A row with its instance, placement and metrics, computed once."""

    def __init__(self, row: LadderRow, base: Performance):
        self.row = row
        self.instance = row_instance(row, base)
        inst = self.instance
        self.rank2gpu = inst.cluster.available_gpus[: inst.parallel.world_size]
        e = inst.model.num_experts
        placement = Placement(rank2gpu=self.rank2gpu, phy2log=np.tile(np.arange(e), (inst.model.num_moe_layers, 1)))
        self.metrics = evaluate(inst, placement)

    def predict(self, perf: Performance) -> tuple[float, float]:
        """(tflops, tokens/s) per GPU predicted with ``perf``'s tunable values."""
        assert self.instance.performance is not None
        p = dataclasses.replace(
            self.instance.performance,
            gemm_efficiency=perf.gemm_efficiency,
            layer_overhead_s=perf.layer_overhead_s,
            expert_gemm_efficiency=perf.expert_gemm_efficiency,
            overlap_efficiency=perf.overlap_efficiency,
            dispatcher=self.row.dispatcher,
            nvlink_dispatch_efficiency=0.0,
            nvlink_combine_efficiency=0.0,
            nic_efficiency=0.0,
            comm_sms=0,
        )
        pred = StepTimeModel(self.instance, p).predict_metrics(self.metrics, self.rank2gpu)
        return pred.tflops_per_gpu, pred.tokens_per_s_per_gpu


def _kind_key(gpu: str, fitted_kinds: set[str]) -> str:
    if gpu in fitted_kinds:
        return gpu
    if gpu == "h800" and "h100" in fitted_kinds:
        return "h100"
    return gpu


def calibrate(
    rows: Sequence[LadderRow],
    fit: Sequence[str] = ("gemm_efficiency",),
    *,
    base: Performance | None = None,
) -> Calibration:
    """Predict every row, fit ``fit`` on the rows marked ``fit``, report every row's error.

    Parameters
    ----------
    rows : the ladder (:func:`read_ladder`).
    fit : parameter names from :data:`FITTABLE`; ``gemm_efficiency`` is one value per GPU kind
        with a fitted row; at most two shared ones.
    base : starting values (default: the package defaults).

    Returns
    -------
    Calibration; fitted values minimise the squared log errors of the fitted rows (least squares).
    """
    unknown = [f for f in fit if f not in FITTABLE]
    if unknown:
        raise InvalidInputError(f"--fit: unknown parameter {unknown[0]!r} (choose from {', '.join(FITTABLE)})")
    shared = [f for f in fit if f in SHARED_FITTABLE]
    if len(shared) > 2:
        raise InvalidInputError("--fit: at most two shared parameters")
    base = base or Performance(gpu="gb300", precision="mxfp8", architecture=DEEPSEEK_V3)
    prepared = [_Row(r, base) for r in rows]
    fit_rows = [p for p in prepared if p.row.fit]
    kinds = sorted({p.row.gpu for p in fit_rows}) if "gemm_efficiency" in fit else []
    default_eff = {k: (GPU_KINDS[k].gemm_efficiency or base.gemm_efficiency) for k in GPU_KINDS}
    names = [f"gemm_efficiency:{k}" for k in kinds] + shared
    x0 = np.array([default_eff[k] for k in kinds] + [getattr(base, s) or 1e-4 for s in shared], dtype=np.float64)
    lower = np.array([0.01] * len(kinds) + [0.0 if s == "layer_overhead_s" else 0.05 for s in shared])
    upper = np.array([1.0] * len(kinds) + [0.05 if s == "layer_overhead_s" else 1.0 for s in shared])
    kind_set = set(kinds)

    def perf_for(x: np.ndarray, gpu: str) -> Performance:
        eff = dict(default_eff)
        eff.update({k: float(v) for k, v in zip(kinds, x[: len(kinds)])})
        p = dataclasses.replace(base, gemm_efficiency=eff[_kind_key(gpu, kind_set)])
        for name, v in zip(shared, x[len(kinds) :]):
            p = dataclasses.replace(p, **{name: float(v)})  # type: ignore[arg-type]
        return p

    def measure(p: _Row, x: np.ndarray) -> float:
        tflops, tokens = p.predict(perf_for(x, p.row.gpu))
        return tflops if p.row.published[0] == "tflops" else tokens

    if names and fit_rows:
        def residuals(x: np.ndarray) -> np.ndarray:
            return np.array([np.log(measure(p, x) / p.row.published[1]) for p in fit_rows])

        res = least_squares(
            residuals,
            np.clip(x0, lower, upper),
            bounds=(lower, upper),
            x_scale=np.maximum(np.abs(x0), 1e-3),
            xtol=1e-10,
            ftol=1e-12,
        )
        x = res.x
    else:
        x = x0
    results = []
    for p in prepared:
        tflops, tokens = p.predict(perf_for(x, p.row.gpu))
        what, published = p.row.published
        predicted = tflops if what == "tflops" else tokens
        ratio = None
        if p.row.tflops_per_gpu is not None and p.row.tokens_per_s_per_gpu is not None:
            flops = StepTimeModel(p.instance).flops_per_token
            ratio = p.row.tflops_per_gpu * 1e12 / p.row.tokens_per_s_per_gpu / flops - 1.0
        results.append(
            RowResult(
                name=p.row.name,
                gpu=p.row.gpu,
                fit=p.row.fit,
                measure=what,
                published=published,
                predicted=predicted,
                error=predicted / published - 1.0,
                predicted_tflops_per_gpu=tflops,
                predicted_tokens_per_s_per_gpu=tokens,
                flops_ratio_error=ratio,
            )
        )
    unfitted = [abs(r.error) for r in results if not r.fit]
    fitted = {n: float(v) for n, v in zip(names, x)}
    per_gpu = {k: float(v) for k, v in zip(kinds, x[: len(kinds)])}
    first = fit_rows[0].row if fit_rows else rows[0]
    perf = dataclasses.replace(perf_for(x, first.gpu), gpu=first.gpu, precision=first.precision, dispatcher=first.dispatcher)
    return Calibration(
        fitted=fitted,
        results=results,
        median_abs_error_unfitted=float(np.median(unfitted)) if unfitted else None,
        performance=perf,
        gemm_efficiency_per_gpu=per_gpu,
    )


def format_table(cal: Calibration) -> str:
    """The predicted-against-published table :func:`calibrate` found, as the CLI prints it."""
    lines = [f"{'row':34} {'gpu':6} {'fit':4} {'published':>10} {'predicted':>10} {'error':>8}"]
    for r in cal.results:
        unit = "TFLOP/s" if r.measure == "tflops" else "tok/s"
        lines.append(
            f"{r.name:34} {r.gpu:6} {'yes' if r.fit else 'no':4} {r.published:10.1f} {r.predicted:10.1f} "
            f"{100 * r.error:+7.1f}% {unit}"
        )
    for name, value in sorted(cal.fitted.items()):
        lines.append(f"fitted {name} = {value:.4g}")
    if cal.median_abs_error_unfitted is not None:
        lines.append(f"median absolute error on rows not fitted: {100 * cal.median_abs_error_unfitted:.1f}%")
    return "\n".join(lines)
