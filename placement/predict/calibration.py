"""Calibration of the step-time model against measured runs: the published ladder, or yours.

A *ladder* is a JSON file of measured training runs (``{"version": 1, "rows": [...]}``; the row
schema is in docs/formats.md and ``placement/schemas/ladder.schema.json``).  The package ships the
published one, ``placement/data/ladder.json``: DeepSeek-V3 pre-training runs read in Megatron-Bridge's
performance summaries (several releases), NVIDIA's DeepSeek-V3-on-GB200 write-up (its DeepEP and
HybridEP steps) and DeepSeek-V3's technical report.

:func:`calibrate` predicts every row with the step-time model (:mod:`placement.predict.performance`),
fits the named parameters on the rows marked ``fit`` and reports every row's error and the median
absolute error of the rows not fitted.  Fittable parameters: ``gemm_efficiency`` (one per GPU kind
that has a fitted row; H800 rows use H100's when they have none: the same chip), and the shared
``layer_overhead_s``, ``expert_gemm_efficiency`` and ``overlap_efficiency`` (at most two shared).

Each row is modelled as the benchmark ran it: EP groups inside NVLink domains where they fit (64 of
an NVL72 rack's 72 GPUs in use, Slurm ``--segment``; 8-GPU nodes otherwise), the default rank order
``tp-cp-ep-dp-pp``, forced-balanced routing (DeepSeek-V3's group-limited top-8, uniform scores),
stages split so that every stage holds the same number of layer slots where the counts allow.  The
published TFLOP/s of a row also checks the FLOP count, which is not fitted: ``tflops /
tokens_per_s`` equals :func:`placement.predict.performance.model_flops_per_token` within 1%.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.optimize import least_squares

from placement.predict.cost import evaluate
from placement.core.model import (
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
from placement.core.perfdata import (
    DEEPSEEK_V3,
    FP8_GEMM_RATIO,
    GPU_KINDS,
    Architecture,
    Performance,
)
from placement.predict.performance import StepTimeModel
from placement.formats.ladder import (  # noqa: F401  (re-exported: the ladder format lives in placement.formats.ladder)
    HYBRIDEP_FP8_DISPATCH,
    SHAPE_SPEC,
    ROW_SPEC,
    LADDER_SPEC,
    ladder_schema,
    LadderRow,
    default_ladder_path,
    read_ladder,
    ladder_rows,
)

__all__ = [
    "LADDER_SPEC",
    "FITTABLE",
    "FP8_RATIO_UNFITTED",
    "HYBRIDEP_FP8_DISPATCH",
    "LadderRow",
    "RowResult",
    "Calibration",
    "default_ladder_path",
    "read_ladder",
    "ladder_rows",
    "row_instance",
    "calibrate",
    "cross_validate",
    "CrossValidation",
    "HeldOut",
    "ceiling_for",
    "DEFAULT_FIT",
    "ladder_schema",
    "format_table",
    "format_cross_validation",
]

SHARED_FITTABLE = (
    "gemm_half_shape",
    "elementwise_bytes",
    "layer_overhead_s",
    "expert_gemm_efficiency",
    "overlap_efficiency",
)
PER_KIND_FITTABLE = ("gemm_efficiency", "fp8_gemm_ratio")
FITTABLE: tuple[str, ...] = PER_KIND_FITTABLE + SHARED_FITTABLE
#: What ``placement calibrate`` fits by default: per GPU kind the ceiling and (where the kind has
#: BF16 and FP8 rows) the FP8 ratio; three shared values: the non-GEMM HBM bytes, the per-layer
#: launch overhead and the EP-overlap efficiency (the share of an overlapped all-to-all that really
#: hides).  ``gemm_half_shape`` is not fitted: it stays at one 128-wide tensor-core tile
#: (``GEMM_HALF_SHAPE``, the lower bound of its range, where a fit of it on every row lands too).
#: With the overlap efficiency fitted instead, a fold without the small model no longer explains the
#: large models' slower steps by heavier non-GEMM work (which then mispredicts the small model, whose
#: all-to-all is a few per cent of its step) but partly by communication that does not hide:
#: leave-one-family-out on Qwen3-30B-A3B 11.9% -> 5.5% (docs/performance.md).
DEFAULT_FIT: tuple[str, ...] = (
    "gemm_efficiency",
    "fp8_gemm_ratio",
    "elementwise_bytes",
    "layer_overhead_s",
    "overlap_efficiency",
)
MAX_SHARED = 3
# Bounds of each fitted value (least squares in log error).
_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.05, 1.0),
    # At least one 128-wide tile (the tensor-core tile of CUTLASS's and cuBLAS's Hopper and Blackwell
    # GEMM kernels): a dimension of one tile cannot run at more than half the ceiling.
    "gemm_half_shape": (128.0, 5000.0),
    "fp8_gemm_ratio": (0.3, 1.0),
    "elementwise_bytes": (0.0, 200.0),
    "layer_overhead_s": (0.0, 0.05),
    "expert_gemm_efficiency": (0.05, 1.0),
    "overlap_efficiency": (0.05, 1.0),
}
# Starting values of the least squares (neutral, not fitted on anything).
_START: dict[str, float] = {
    "gemm_efficiency": 0.5,
    "gemm_half_shape": 500.0,
    "fp8_gemm_ratio": 0.8,
    "elementwise_bytes": 10.0,
    "layer_overhead_s": 1e-4,
    "expert_gemm_efficiency": 0.8,
    "overlap_efficiency": 0.8,
}
# The FP8 ratio when a fit has rows of one precision only (it is then not identified, e.g. with
# DeepSeek-V3, the only family with BF16 rows, held out): a stated prior, never a value fitted on the
# held-out rows.  Transformer Engine's published GEMM benchmark ("GEMM Speedups Across Precisions",
# nvidia.github.io/TransformerEngine/features/low_precision_training/speedups.html, benchmarks/gemm/
# benchmark_gemm.py): on B300 the GEMMs of a 5B model (hidden 4096, intermediate 16384) run 1.44x
# faster in MXFP8 than in BF16 with the per-step quantization included ("autocast"), against a 2x
# peak ratio: 1.44 / 2 = 0.72 of the BF16 share of the peak.
FP8_RATIO_UNFITTED = 0.72
# A GPU kind with no fitted row borrows the ceiling of the same chip (H800 = H100's compute), else of
# its sibling (the same chip in the other form factor), else the median of the fitted ceilings.
SAME_CHIP = {"h800": "h100", "h100": "h800"}
SIBLING = {"gb300": "b300", "b300": "gb300", "gb200": "b200", "b200": "gb200"}
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


def row_instance(row: LadderRow, performance: Performance, *, sampled_pairs: int = 8192) -> Instance:
    """An in-memory instance of ``row``: EP groups inside NVLink domains where they fit, balanced
    routing, ``sampled_pairs`` sampled tokens per stage (spread over the sources)."""
    arch = row.architecture
    shape = row.shape
    kind = GPU_KINDS[row.gpu]
    h = shape["hidden_size"]
    n_layers = shape["num_layers"]
    moe_layers = tuple(range(shape["first_dense_layers"], n_layers))
    model = MoEModel(
        name=row.family,
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
    sizes = _stage_sizes(n_layers, row.pp, arch.mtp_num_layers)
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
        dispatcher=row.dispatcher,
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
    """A row with its instance, placement, metrics and step-time model, computed once."""

    def __init__(self, row: LadderRow, base: Performance):
        self.row = row
        self.instance = row_instance(row, base)
        inst = self.instance
        self.rank2gpu = inst.cluster.available_gpus[: inst.parallel.world_size]
        e = inst.model.num_experts
        placement = Placement(rank2gpu=self.rank2gpu, phy2log=np.tile(np.arange(e), (inst.model.num_moe_layers, 1)))
        self.metrics = evaluate(inst, placement)
        assert inst.performance is not None
        self.perf = dataclasses.replace(
            inst.performance,
            dispatcher=row.dispatcher,
            nvlink_dispatch_efficiency=0.0,
            nvlink_combine_efficiency=0.0,
            nic_efficiency=0.0,
            comm_sms=0,
        )
        self.model = StepTimeModel(inst, self.perf)
        self.flops_per_token = self.model.flops_per_token

    def predict(self, values: dict[str, float]) -> tuple[float, float]:
        """(tflops, tokens/s) per GPU with the compute values ``values`` (field name -> value).

        ``layer_overhead_s`` (host launch gaps per layer) is not paid by a recipe that captures the
        whole iteration in one CUDA graph (``cuda_graphs: full_iteration``).
        """
        if self.row.cuda_graphs == "full_iteration" and "layer_overhead_s" in values:
            values = {**values, "layer_overhead_s": 0.0}
        p = dataclasses.replace(self.perf, **values)  # type: ignore[arg-type]
        pred = self.model.repriced(p).predict_metrics(self.metrics, self.rank2gpu)
        return pred.tflops_per_gpu, pred.tokens_per_s_per_gpu

    def measure(self, values: dict[str, float]) -> float:
        tflops, tokens = self.predict(values)
        return tflops if self.row.published[0] == "tflops" else tokens


def ceiling_for(gpu: str, ceilings: dict[str, float], default: float) -> tuple[float, str]:
    """The GEMM ceiling of ``gpu`` from the fitted ``ceilings`` and where it came from.

    Its own fitted value; else the same chip's (H800 = H100); else its sibling's (the same chip in
    the other form factor: GB300 = B300, GB200 = B200); else the median of the fitted ceilings
    ("pooled"); ``default`` when nothing was fitted.
    """
    if gpu in ceilings:
        return ceilings[gpu], "fitted"
    for table, how in ((SAME_CHIP, "same chip"), (SIBLING, "sibling")):
        other = table.get(gpu)
        if other in ceilings:
            return ceilings[other], f"{how} {other}"
    if ceilings:
        return float(np.median(list(ceilings.values()))), "pooled"
    return default, "default"


def _check_fit(fit: Sequence[str]) -> tuple[bool, list[str]]:
    unknown = [f for f in fit if f not in FITTABLE]
    if unknown:
        raise InvalidInputError(f"--fit: unknown parameter {unknown[0]!r} (choose from {', '.join(FITTABLE)})")
    shared = [f for f in SHARED_FITTABLE if f in fit]
    if len(shared) > MAX_SHARED:
        raise InvalidInputError(f"--fit: at most {MAX_SHARED} shared parameters")
    return "gemm_efficiency" in fit, shared


@dataclass(frozen=True)
class _Fit:
    ceilings: dict[str, float]  # GPU kind -> fitted ceiling (kinds with a training row)
    ratios: dict[str, float]  # GPU kind -> fitted FP8 ratio (kinds with BF16 and FP8 training rows)
    shared: dict[str, float]
    default_ceiling: float
    default_ratio: float

    def values(self, gpu: str) -> dict[str, float]:
        c, _ = ceiling_for(gpu, self.ceilings, self.default_ceiling)
        r, _ = ceiling_for(gpu, self.ratios, self.default_ratio)
        return {"gemm_efficiency": c, "fp8_gemm_ratio": r, **self.shared}


def _fit(prepared: Sequence[_Row], train: Sequence[int], fit: Sequence[str], base: Performance) -> _Fit:
    """Least squares in log error over the rows ``train``: per GPU kind among them a ceiling (H800
    rows fit H100's: the same chip) and, where the kind has both BF16 and FP8 rows, its FP8 ratio;
    and the shared values named in ``fit``.  A kind without its own value takes
    :func:`ceiling_for`'s same-chip, sibling or pooled one, recomputed at every step of the fit."""
    per_kind, shared = _check_fit(fit)
    rows = [prepared[i] for i in train]

    def chip(gpu: str) -> str:
        return SAME_CHIP["h800"] if gpu == "h800" else gpu

    kinds = sorted({chip(p.row.gpu) for p in rows}) if per_kind else []
    both = [k for k in kinds if len({p.row.precision == "bf16" for p in rows if chip(p.row.gpu) == k}) == 2]
    ratio_kinds = both if "fp8_gemm_ratio" in fit else []
    default_ceiling = base.gemm_efficiency
    # Neutral starting values, never the shipped constants (which were fitted on every row).
    names = ["gemm_efficiency"] * len(kinds) + ["fp8_gemm_ratio"] * len(ratio_kinds) + shared
    x0 = np.array([_START[n] for n in names], dtype=np.float64)
    lo = np.array([_BOUNDS[n][0] for n in names])
    hi = np.array([_BOUNDS[n][1] for n in names])
    nk, nr = len(kinds), len(ratio_kinds)

    def unpack(x: np.ndarray) -> _Fit:
        ceilings = {k: float(v) for k, v in zip(kinds, x[:nk])}
        ratios = {k: float(v) for k, v in zip(ratio_kinds, x[nk : nk + nr])}
        default_ratio = FP8_RATIO_UNFITTED if "fp8_gemm_ratio" in fit else base.fp8_gemm_ratio
        return _Fit(ceilings, ratios, {n: float(v) for n, v in zip(shared, x[nk + nr :])}, default_ceiling, default_ratio)

    def values(f: _Fit, gpu: str) -> dict[str, float]:
        out = f.values(gpu)
        if not per_kind:
            out["gemm_efficiency"] = GPU_KINDS[gpu].gemm_efficiency or default_ceiling
        if "fp8_gemm_ratio" not in fit:
            out["fp8_gemm_ratio"] = GPU_KINDS[gpu].fp8_gemm_ratio or FP8_GEMM_RATIO
        return out

    if not rows or x0.size == 0:
        f = unpack(x0)
    else:
        def residuals(x: np.ndarray) -> np.ndarray:
            f = unpack(x)
            return np.array([np.log(p.measure(values(f, p.row.gpu)) / p.row.published[1]) for p in rows])

        x_start = np.clip(x0, lo + 1e-9, hi - 1e-9)
        res = least_squares(
            residuals, x_start, bounds=(lo, hi), x_scale=np.maximum(np.abs(x_start), 1e-3), xtol=1e-8, ftol=1e-10
        )
        f = unpack(res.x)
    if per_kind and "fp8_gemm_ratio" in fit:
        return f
    # Parameters not fitted keep the shipped values: expressed through the per-kind tables.
    ceilings = f.ceilings if per_kind else {k: GPU_KINDS[k].gemm_efficiency or default_ceiling for k in GPU_KINDS}
    ratios = f.ratios if "fp8_gemm_ratio" in fit else {k: GPU_KINDS[k].fp8_gemm_ratio or FP8_GEMM_RATIO for k in GPU_KINDS}
    return dataclasses.replace(f, ceilings=ceilings, ratios=ratios)


def _result(p: _Row, values: dict[str, float]) -> RowResult:
    tflops, tokens = p.predict(values)
    what, published = p.row.published
    predicted = tflops if what == "tflops" else tokens
    ratio = None
    if p.row.tflops_per_gpu is not None and p.row.tokens_per_s_per_gpu is not None:
        ratio = p.row.tflops_per_gpu * 1e12 / p.row.tokens_per_s_per_gpu / p.flops_per_token - 1.0
    return RowResult(
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


def _base(base: Performance | None) -> Performance:
    return base or Performance(gpu="gb300", precision="mxfp8", architecture=DEEPSEEK_V3)


def calibrate(
    rows: Sequence[LadderRow],
    fit: Sequence[str] = DEFAULT_FIT,
    *,
    base: Performance | None = None,
) -> Calibration:
    """Predict every row, fit ``fit`` on the rows marked ``fit``, report every row's error.

    Parameters
    ----------
    rows : the ladder (:func:`read_ladder`).
    fit : parameter names from :data:`FITTABLE`; ``gemm_efficiency`` is one ceiling per GPU kind
        with a fitted row (a kind without one: :func:`ceiling_for`); at most three shared ones.
    base : starting values (default: the package defaults).

    Returns
    -------
    Calibration; fitted values minimise the squared log errors of the fitted rows (least squares).
    """
    _check_fit(fit)
    base = _base(base)
    prepared = [_Row(r, base) for r in rows]
    train = [i for i, p in enumerate(prepared) if p.row.fit]
    f = _fit(prepared, train, fit, base)

    def values(gpu: str) -> dict[str, float]:
        return f.values(gpu)

    results = [_result(p, values(p.row.gpu)) for p in prepared]
    unfitted = [abs(r.error) for r in results if not r.fit]
    fitted = {}
    if "gemm_efficiency" in fit:
        fitted.update({f"gemm_efficiency:{k}": v for k, v in f.ceilings.items()})
    if "fp8_gemm_ratio" in fit:
        fitted.update({f"fp8_gemm_ratio:{k}": v for k, v in f.ratios.items()})
    fitted.update(f.shared)
    first = prepared[train[0]].row if train else rows[0]
    perf = dataclasses.replace(
        base, gpu=first.gpu, precision=first.precision, dispatcher=first.dispatcher, architecture=first.architecture
    )
    perf = dataclasses.replace(perf, **values(first.gpu))  # type: ignore[arg-type]
    return Calibration(
        fitted=fitted,
        results=results,
        median_abs_error_unfitted=float(np.median(unfitted)) if unfitted else None,
        performance=perf,
        gemm_efficiency_per_gpu=dict(f.ceilings) if "gemm_efficiency" in fit else {},
    )


@dataclass(frozen=True)
class HeldOut:
    """One row predicted by a fit that did not see it (nor any row of its configuration or family)."""

    name: str
    family: str
    gpu: str
    published: float
    predicted: float
    error: float
    ceiling_from: str  # "fitted", "same chip h100", "sibling b300", "pooled"


@dataclass(frozen=True)
class CrossValidation:
    """Leave-one-configuration-out (LOCO) and leave-one-model-family-out (LOFO) errors."""

    loco: list[HeldOut]
    lofo: list[HeldOut]

    @property
    def loco_median(self) -> float:
        return float(np.median([abs(r.error) for r in self.loco]))

    def lofo_median(self) -> dict[str, float]:
        fams = sorted({r.family for r in self.lofo})
        return {f: float(np.median([abs(r.error) for r in self.lofo if r.family == f])) for f in fams}

    def to_dict(self) -> dict:
        return {
            "loco": [dataclasses.asdict(r) for r in self.loco],
            "lofo": [dataclasses.asdict(r) for r in self.lofo],
            "loco_median_abs_error": self.loco_median,
            "lofo_median_abs_error": self.lofo_median(),
        }


def cross_validate(
    rows: Sequence[LadderRow],
    fit: Sequence[str] = DEFAULT_FIT,
    *,
    base: Performance | None = None,
    folds: Sequence[str] = ("loco", "lofo"),
    only: Sequence[str] | None = None,
) -> CrossValidation:
    """Hold out each configuration (every release of it) and each model family in turn, fit on the
    rest of the ladder (every row, whatever its ``fit`` mark), and predict what was held out.

    A held-out row's GPU kind with no row left in the fit takes :func:`ceiling_for`'s same-chip,
    sibling or pooled ceiling, never a value fitted on the held-out rows.  ``only`` restricts the
    held-out configurations to those of the named rows (a reduced run for tests).
    """
    _check_fit(fit)
    base = _base(base)
    prepared = [_Row(r, base) for r in rows]
    loco: list[HeldOut] = []
    lofo: list[HeldOut] = []

    def held(out: list[HeldOut], members: list[int]) -> None:
        members_set = set(members)
        train = [i for i in range(len(prepared)) if i not in members_set]
        f = _fit(prepared, train, fit, base)
        for i in members:
            p = prepared[i]
            values = f.values(p.row.gpu)
            _, how = ceiling_for(p.row.gpu, f.ceilings, f.default_ceiling)
            r = _result(p, values)
            out.append(HeldOut(p.row.name, p.row.family, p.row.gpu, r.published, r.predicted, r.error, how))

    wanted = set(only) if only is not None else None
    if "loco" in folds:
        configs: dict[tuple, list[int]] = {}
        for i, p in enumerate(prepared):
            configs.setdefault(p.row.configuration, []).append(i)
        for members in configs.values():
            if wanted is None or any(prepared[i].row.name in wanted for i in members):
                held(loco, members)
    if "lofo" in folds:
        families: dict[str, list[int]] = {}
        for i, p in enumerate(prepared):
            families.setdefault(p.row.family, []).append(i)
        for fam, members in families.items():
            if wanted is None or any(prepared[i].row.name in wanted for i in members):
                held(lofo, members)
    order = {r.name: i for i, r in enumerate(rows)}
    loco.sort(key=lambda r: order[r.name])
    lofo.sort(key=lambda r: order[r.name])
    return CrossValidation(loco, lofo)


def format_cross_validation(cv: CrossValidation) -> str:
    """The LOCO and LOFO tables as the CLI prints them."""
    lines = []
    for title, rows in (("leave-one-configuration-out (LOCO)", cv.loco), ("leave-one-model-family-out (LOFO)", cv.lofo)):
        if not rows:
            continue
        lines.append(title)
        lines.append(f"  {'row':34} {'family':16} {'gpu':6} {'published':>10} {'predicted':>10} {'error':>8}  ceiling")
        for r in rows:
            lines.append(
                f"  {r.name:34} {r.family:16} {r.gpu:6} {r.published:10.1f} {r.predicted:10.1f} {100 * r.error:+7.1f}%  {r.ceiling_from}"
            )
    if cv.loco:
        lines.append(f"LOCO median absolute error over {len(cv.loco)} rows: {100 * cv.loco_median:.1f}%")
    for fam, med in cv.lofo_median().items():
        n = sum(1 for r in cv.lofo if r.family == fam)
        lines.append(f"LOFO median absolute error, {fam} ({n} rows): {100 * med:.1f}%")
    return "\n".join(lines)


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
