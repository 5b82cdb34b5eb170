"""The ladder and its calibration: rows carry the model's shape and cite their recipe, the FLOP
count matches every published TFLOP/s over tokens/s, the shipped constants are the fit, the
cross-validation never lets a held-out row's own figure into its prediction, ``placement
calibrate`` (with ``--cross-validate``) and its bad-input errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from placement.predict.calibration import (
    DEFAULT_FIT,
    FP8_RATIO_UNFITTED,
    MAX_SHARED,
    SHARED_FITTABLE,
    LadderRow,
    calibrate,
    ceiling_for,
    cross_validate,
    default_ladder_path,
    read_ladder,
    row_instance,
)
from placement.cli import main
from placement.predict.compute import ComputeRates
from placement.predict.performance import GPU_KINDS, Architecture, Performance, model_flops_per_token
from placement.core.perfdata import (
    ATTENTION_EFFICIENCY,
    CALIBRATED_GEMM_EFFICIENCY,
    ELEMENTWISE_BYTES,
    FP8_GEMM_RATIO,
    GEMM_HALF_SHAPE,
    LAYER_OVERHEAD_S,
)

ROWS = read_ladder(default_ladder_path())
BY_NAME = {r.name: r for r in ROWS}
SHAPE_EXTRA = {"num_layers", "first_dense_layers", "hidden_size", "num_experts", "top_k", "num_groups", "groups_per_token"}
# Small rows (8 and 16 GPUs: cheap to evaluate) of one family on three GPU kinds, plus a second
# family's small-world stand-in is not needed: LOFO is exercised by holding out the whole family.
SMALL = [r for r in ROWS if r.family == "qwen3_30b_a3b"]


def _ladder_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"version": 1, "rows": rows}))
    return str(path)


def _raw_rows(names: set[str] | None = None) -> list[dict]:
    doc = json.loads(default_ladder_path().read_text())
    return [r for r in doc["rows"] if names is None or r["name"] in names]


# ---------------------------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------------------------
def test_rows_carry_the_contract_shape_and_cover_three_families_with_cited_recipes():
    arch_fields = {f.name for f in dataclasses.fields(Architecture)}
    families = {r.family for r in ROWS}
    assert {"deepseek_v3", "qwen3_235b_a22b", "qwen3_30b_a3b"} <= families
    for r in ROWS:
        assert set(r.shape) == arch_fields | SHAPE_EXTRA, r.name
        assert r.source and r.note, r.name
        if r.source.startswith("Megatron-Bridge"):
            assert "recipe" in r.note and "at r0." in r.note, r.name  # read at its release commit


def test_flop_count_matches_every_published_tflops_over_tokens_ratio():
    # Not fitted: the shapes (layers, hidden, experts, top-k, FFN sizes, attention, MTP) are right
    # when Megatron's count of them reproduces the published TFLOP/s per token.
    base = Performance(gpu="gb300", precision="mxfp8", architecture=ROWS[0].architecture)
    checked = 0
    for r in ROWS:
        if r.tflops_per_gpu is None or r.tokens_per_s_per_gpu is None:
            continue
        flops = model_flops_per_token(row_instance(r, base, sampled_pairs=64))
        assert r.tflops_per_gpu * 1e12 / r.tokens_per_s_per_gpu / flops == pytest.approx(1.0, abs=0.01), r.name
        checked += 1
    assert checked >= 20


def test_qwen3_rows_have_no_mtp_layer_and_b300_rows_run_hybridep():
    for r in ROWS:
        if r.family.startswith("qwen3"):
            assert r.architecture.mtp_num_layers == 0, r.name
        if r.gpu == "b300" and r.family == "deepseek_v3":
            # Megatron-Bridge r0.4.0 and r0.5.0 scripts/performance/configs/deepseek/: hybridep.
            assert r.dispatcher == "hybridep", r.name
    # A Qwen3 row without mtp_num_layers in its shape gets none (not DeepSeek's one).
    raw = _raw_rows({"qwen3_30b_gb300_mxfp8_2608"})[0]
    raw["shape"].pop("mtp_num_layers")
    assert LadderRow(**raw).architecture.mtp_num_layers == 0


# ---------------------------------------------------------------------------------------------
# The fit and its fallbacks
# ---------------------------------------------------------------------------------------------
def test_a_kind_without_a_fitted_row_borrows_same_chip_then_sibling_then_pooled():
    fitted = {"h100": 0.3, "gb300": 0.7, "gb200": 0.5, "b200": 0.4}
    assert ceiling_for("h100", fitted, 0.9) == (0.3, "fitted")
    assert ceiling_for("h800", fitted, 0.9) == (0.3, "same chip h100")
    assert ceiling_for("b300", fitted, 0.9) == (0.7, "sibling gb300")
    assert ceiling_for("b300", {"h100": 0.3, "gb200": 0.5, "b200": 0.4}, 0.9) == (0.4, "pooled")
    assert ceiling_for("gb300", {}, 0.9) == (0.9, "default")


@pytest.fixture(scope="module")
def full_fit():
    return calibrate(ROWS)


def test_shipped_constants_are_the_fit_with_at_most_two_per_kind_and_three_shared(full_fit):
    shared = {k: v for k, v in full_fit.fitted.items() if ":" not in k}
    assert len(shared) <= MAX_SHARED == 3 and set(shared) <= set(SHARED_FITTABLE)
    for gpu, ceiling in full_fit.gemm_efficiency_per_gpu.items():
        assert ceiling == pytest.approx(GPU_KINDS[gpu].gemm_efficiency, abs=5e-4), gpu
    assert GPU_KINDS["h800"].gemm_efficiency == GPU_KINDS["h100"].gemm_efficiency  # the same chip
    assert CALIBRATED_GEMM_EFFICIENCY == GPU_KINDS["gb300"].gemm_efficiency
    ratios = {k.split(":")[1]: v for k, v in full_fit.fitted.items() if k.startswith("fp8_gemm_ratio:")}
    assert ratios and all(GPU_KINDS[g].fp8_gemm_ratio == pytest.approx(v, abs=5e-4) for g, v in ratios.items())
    assert all(GPU_KINDS[g].fp8_gemm_ratio == 0 for g in GPU_KINDS if g not in ratios)  # -> pooled
    assert FP8_GEMM_RATIO == pytest.approx(float(np.median(list(ratios.values()))), abs=5e-4)
    assert len(full_fit.fitted) - len(shared) <= 2 * len(GPU_KINDS)  # at most two per kind
    # not fitted: held at one 128-wide tile, where a fit of it on every row lands (its lower bound)
    assert "gemm_half_shape" not in shared and GEMM_HALF_SHAPE == 128.0
    refit = calibrate(ROWS, fit=("gemm_efficiency", "fp8_gemm_ratio", "gemm_half_shape", "elementwise_bytes",
                                 "layer_overhead_s"))
    assert refit.fitted["gemm_half_shape"] == pytest.approx(GEMM_HALF_SHAPE, rel=2e-3)
    # the overlap efficiency lands at its upper bound, the Performance default: every overlapped
    # all-to-all of the fitted rows hides (the constants of the old fit stay the shipped ones)
    default = Performance(gpu="gb300", precision="mxfp8", architecture=ROWS[0].architecture).overlap_efficiency
    assert default == 1.0 and shared["overlap_efficiency"] == pytest.approx(default, abs=2e-3)
    assert shared["elementwise_bytes"] == pytest.approx(ELEMENTWISE_BYTES, rel=2e-3)
    assert shared["layer_overhead_s"] == pytest.approx(LAYER_OVERHEAD_S, rel=2e-3)
    assert full_fit.median_abs_error_unfitted is not None and full_fit.median_abs_error_unfitted <= 0.08


def test_bf16_gemms_run_at_the_ceiling_of_the_bf16_peak_not_an_fp8_fit():
    ceiling = GPU_KINDS["h100"].gemm_efficiency
    bf16 = ComputeRates(Performance(gpu="h100", precision="bf16", architecture=ROWS[0].architecture))
    fp8 = ComputeRates(Performance(gpu="h100", precision="fp8", architecture=ROWS[0].architecture))
    assert bf16.gemm_flops_per_s == pytest.approx(ceiling * 989e12)
    assert fp8.gemm_flops_per_s == pytest.approx(ceiling * 1979e12 * (GPU_KINDS["h100"].fp8_gemm_ratio or FP8_GEMM_RATIO))
    assert fp8.gemm_flops_per_s < 2 * bf16.gemm_flops_per_s  # FP8 is not twice as fast
    assert bf16.attention_flops_per_s == fp8.attention_flops_per_s == pytest.approx(ATTENTION_EFFICIENCY * 989e12)  # BF16 in both


# ---------------------------------------------------------------------------------------------
# Cross-validation: no leak of a held-out row's own figure
# ---------------------------------------------------------------------------------------------
def _perturbed(name: str, factor: float) -> list[LadderRow]:
    out = []
    for r in SMALL:
        if r.name == name:
            r = dataclasses.replace(
                r,
                tflops_per_gpu=None if r.tflops_per_gpu is None else r.tflops_per_gpu * factor,
                tokens_per_s_per_gpu=None if r.tokens_per_s_per_gpu is None else r.tokens_per_s_per_gpu * factor,
            )
        out.append(r)
    return out


@pytest.mark.parametrize("name", ["qwen3_30b_h100_fp8_2606", "qwen3_30b_gb300_mxfp8_2608"])
def test_a_held_out_rows_prediction_does_not_move_with_its_published_figure(name):
    # The H100 row is the only H100 row here: its kind has no row left, so it takes the pooled
    # ceiling; the GB300 row shares its configuration with the 26.06 re-run, both held out.
    fit = ("gemm_efficiency", "gemm_half_shape")
    a = cross_validate(_perturbed(name, 1.0), fit, folds=("loco",), only=[name])
    b = cross_validate(_perturbed(name, 2.0), fit, folds=("loco",), only=[name])
    pa = {r.name: r for r in a.loco}[name]
    pb = {r.name: r for r in b.loco}[name]
    assert pa.predicted == pb.predicted  # bit for bit: the held-out figure never enters the fit
    assert pb.published == pytest.approx(2 * pa.published)
    if name.startswith("qwen3_30b_h100"):
        assert pa.ceiling_from == "pooled"
    # The same rows fitted with the row in: its figure does move its own prediction.
    full_a = calibrate([dataclasses.replace(r, fit=True) for r in _perturbed(name, 1.0)], fit)
    full_b = calibrate([dataclasses.replace(r, fit=True) for r in _perturbed(name, 2.0)], fit)
    ra = {r.name: r for r in full_a.results}[name]
    rb = {r.name: r for r in full_b.results}[name]
    assert rb.predicted > ra.predicted * 1.01


def test_an_unidentified_fp8_ratio_takes_the_published_prior_not_one():
    # FP8 rows only: the ratio is not identified.  Transformer Engine's GEMM benchmark on B300:
    # MXFP8 1.44x BF16 with quantization, against a 2x peak ratio.
    assert FP8_RATIO_UNFITTED == pytest.approx(1.44 / 2)
    cal = calibrate(SMALL[:1], ("gemm_efficiency", "fp8_gemm_ratio"))
    assert not any(k.startswith("fp8_gemm_ratio") for k in cal.fitted)
    assert cal.performance.fp8_gemm_ratio == FP8_RATIO_UNFITTED


def test_leave_one_family_out_ignores_the_held_out_family():
    deepseek_small = [r for r in ROWS if r.name in ("b300_mxfp8_ep8_2606", "b200_mxfp8_ep32_260401")]
    rows = SMALL[:3] + deepseek_small
    doubled = [
        dataclasses.replace(r, tflops_per_gpu=(r.tflops_per_gpu or 0) * 2 or None) if r.family == "qwen3_30b_a3b" else r
        for r in rows
    ]
    fit = ("gemm_efficiency",)
    a = cross_validate(rows, fit, folds=("lofo",), only=[SMALL[0].name])
    b = cross_validate(doubled, fit, folds=("lofo",), only=[SMALL[0].name])
    assert [r.family for r in a.lofo] == ["qwen3_30b_a3b"] * 3
    assert [r.predicted for r in a.lofo] == [r.predicted for r in b.lofo]
    assert {r.ceiling_from for r in a.lofo} <= {"sibling b300", "sibling b200", "pooled"}


def test_the_shipped_fit_meets_its_out_of_sample_targets():
    """The default fit on the shipped ladder, validated out of sample (about a minute): leave-one-
    configuration-out median within 8% and leave-one-model-family-out median within 10% for every
    family, with at most two fitted values per GPU kind plus three shared."""
    assert len([f for f in DEFAULT_FIT if f in SHARED_FITTABLE]) <= 3
    cv = cross_validate(ROWS, DEFAULT_FIT)
    assert cv.loco_median <= 0.08
    medians = cv.lofo_median()
    assert set(medians) == {r.family for r in ROWS} and len(medians) >= 3
    assert all(m <= 0.10 for m in medians.values()), medians


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def test_calibrate_cross_validate_prints_both_tables_and_medians(tmp_path, capsys):
    path = _ladder_file(tmp_path, _raw_rows({r.name for r in SMALL}))
    out = tmp_path / "cv.json"
    assert main(["calibrate", path, "--cross-validate", "--fit", "gemm_efficiency,gemm_half_shape", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "leave-one-configuration-out (LOCO)" in text and "leave-one-model-family-out (LOFO)" in text
    assert "LOCO median absolute error over" in text and "LOFO median absolute error, qwen3_30b_a3b" in text
    doc = json.loads(out.read_text())
    assert len(doc["loco"]) == len(SMALL) == len(doc["lofo"])
    assert set(doc["lofo_median_abs_error"]) == {"qwen3_30b_a3b"}


def test_calibrate_command_writes_a_performance_block(tmp_path, capsys):
    path = _ladder_file(tmp_path, _raw_rows({"qwen3_30b_b300_mxfp8_2606", "qwen3_30b_gb300_mxfp8_2606"}))
    out = tmp_path / "perf.json"
    assert main(["calibrate", path, "--fit", "gemm_efficiency", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen3_30b_gb300_mxfp8_2606" in text and "median absolute error on rows not fitted" in text
    doc = json.loads(out.read_text())
    assert doc["performance"]["gpu"] == "b300"
    assert set(doc["gemm_efficiency_per_gpu"]) == {"b300"}
    assert doc["performance"]["architecture"]["mtp_num_layers"] == 0


@pytest.mark.parametrize(
    "mutate,where",
    [
        (lambda r: r.update(tp="1"), "rows[0] (b300_mxfp8_ep8_2606).tp"),
        (lambda r: r.update(gpu="a100"), "rows[0] (b300_mxfp8_ep8_2606).gpu"),
        (lambda r: r.update(dp=31), "rows[0] (b300_mxfp8_ep8_2606).dp"),
        (lambda r: r.update(overlap="1f1b"), "rows[0] (b300_mxfp8_ep8_2606).vpp"),
        (lambda r: r.pop("tflops_per_gpu") and r.pop("tokens_per_s_per_gpu"), "rows[0] (b300_mxfp8_ep8_2606).tflops_per_gpu"),
        (lambda r: r.pop("family"), "rows[0] (b300_mxfp8_ep8_2606).family"),
        (lambda r: r["shape"].pop("hidden_size"), "rows[0] (b300_mxfp8_ep8_2606).shape.hidden_size"),
        (lambda r: r["shape"].update(kv_lora_rank=0), "rows[0] (b300_mxfp8_ep8_2606).shape.kv_lora_rank"),
        (lambda r: r["shape"].update(top_k=300), "rows[0] (b300_mxfp8_ep8_2606).shape.top_k"),
        (lambda r: r["shape"].update(num_experts=260), "rows[0] (b300_mxfp8_ep8_2606).shape.num_groups"),
        (lambda r: r["shape"].update(colour="red"), "rows[0] (b300_mxfp8_ep8_2606).shape"),
        (lambda r: r.update(dispatch_precision="fp8"), "rows[0] (b300_mxfp8_ep8_2606).dispatch_precision"),
    ],
)
def test_calibrate_exits_2_naming_the_malformed_row_and_field(tmp_path, capsys, mutate, where):
    rows = _raw_rows({"b300_mxfp8_ep8_2606"})
    mutate(rows[0])
    path = _ladder_file(tmp_path, rows)
    out = tmp_path / "perf.json"
    for extra in ([], ["--cross-validate"]):
        assert main(["calibrate", path, *extra, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert where in err and path in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_hybridep_rows_dispatch_in_bf16_and_an_fp8_one_is_refused_citing_megatron_core(tmp_path, capsys):
    # Megatron-Core 0.16.1 fused_a2a.py: hybrid_ep_dispatch asserts not fp8_dispatch.
    hybridep = [r for r in ROWS if r.dispatcher == "hybridep"]
    assert len(hybridep) >= 20 and all(r.dispatch_precision == "bf16" for r in hybridep)
    rows = _raw_rows({"qwen3_30b_gb300_mxfp8_2608", "gb300_mxfp8_2608"})
    rows[1]["dispatch_precision"] = "fp8"
    assert main(["calibrate", _ladder_file(tmp_path, rows)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "rows[1] (qwen3_30b_gb300_mxfp8_2608).dispatch_precision" in err and "fused_a2a.py" in err
    rows[1]["dispatcher"] = "deepep"  # DeepEP dispatches in FP8: accepted
    read_ladder(_ladder_file(tmp_path, rows))


def test_fit_refuses_more_than_three_shared_parameters(tmp_path, capsys):
    path = _ladder_file(tmp_path, _raw_rows({"qwen3_30b_b300_mxfp8_2606"}))
    fit = ",".join(("gemm_efficiency",) + SHARED_FITTABLE[:4])
    assert main(["calibrate", path, "--fit", fit]) == 2
    assert "at most 3 shared" in capsys.readouterr().err
    assert len([f for f in DEFAULT_FIT if f in SHARED_FITTABLE]) == MAX_SHARED


def test_deepep_to_hybridep_step_of_nvidias_write_up_has_the_right_sign(full_fit):
    by = {r.name: r for r in full_fit.results}
    deepep, hybridep = by["gb200_writeup_deepep"], by["gb200_writeup_hybridep"]
    assert hybridep.predicted > deepep.predicted and hybridep.published > deepep.published


@pytest.mark.xfail(strict=True, reason="the saving is predicted 1.41x the published one since the compute-by-shape fit "
                   "(1.23x before); the 30% bound is kept, not loosened (docs/performance.md)")
def test_deepep_to_hybridep_saving_within_30_percent_of_the_published_one(full_fit):
    by = {r.name: r for r in full_fit.results}
    deepep, hybridep = by["gb200_writeup_deepep"], by["gb200_writeup_hybridep"]
    saved_predicted_s = 1 / deepep.predicted - 1 / hybridep.predicted
    saved_published_s = 1 / deepep.published - 1 / hybridep.published
    assert abs(saved_predicted_s / saved_published_s - 1) <= 0.30
