"""The step-time model: FLOP count against a hand count, monotonicity, the compute-bound limit,
the calibration against published runs, and the report keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.calibration import (
    FITTED_POINT,
    POINTS,
    PUBLISHED_RETENTION_1024,
    fit_gemm_efficiency,
    point_instance,
    predict_point,
)
from placement.cost import evaluate, report
from placement.formats import read_instance
from placement.performance import (
    CALIBRATED_GEMM_EFFICIENCY,
    DEEPSEEK_V3,
    Architecture,
    StepTimeModel,
    model_flops_per_token,
    prediction_keys,
)
from solvers.default import default_placement
from tests.conftest import INSTANCES

TINY = read_instance(INSTANCES / "tiny.json")


# ---------------------------------------------------------------------------------------------
# FLOPs: a slow hand count, GEMM by GEMM
# ---------------------------------------------------------------------------------------------
def _gemm(m: int, k: int, n: int) -> float:
    """Forward FLOPs of (m, k) @ (k, n); training runs it three times (forward, dgrad, wgrad)."""
    return 2.0 * m * k * n


def _hand_flops(arch: Architecture, h: int, s: int, layers: list[bool], top_k: int) -> float:
    """Training FLOPs of one sequence of ``s`` tokens, listing every GEMM (causal: half the scores)."""
    total = 0.0
    f = 3 if arch.swiglu else 2

    def attention() -> float:
        n = arch.num_attention_heads
        if arch.attention == "mla":
            dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
            out = _gemm(s, h, arch.q_lora_rank) + _gemm(s, arch.q_lora_rank, n * dq)  # q down, up
            out += 2 * s * arch.q_lora_rank  # q norm, counted by Megatron as one FMA per element
            out += _gemm(s, h, arch.kv_lora_rank + arch.qk_pos_emb_head_dim)  # kv down + k rope
            out += _gemm(s, arch.kv_lora_rank, n * (arch.qk_head_dim + arch.v_head_dim))  # kv up
            out += 2 * s * arch.kv_lora_rank  # kv norm
            for _ in range(n):
                out += _gemm(s, dq, s) / 2 + _gemm(s, s, arch.v_head_dim) / 2  # scores, values
            out += _gemm(s, n * arch.v_head_dim, h)  # o proj
            return out
        d, g = arch.kv_channels, arch.num_query_groups
        out = _gemm(s, h, n * d) + 2 * _gemm(s, h, g * d)  # q, k, v
        for _ in range(n):
            out += _gemm(s, d, s) / 2 + _gemm(s, s, d) / 2
        return out + _gemm(s, n * d, h)

    def mlp(width: int) -> float:
        return (f - 1) * _gemm(s, h, width) + _gemm(s, width, h)  # gate+up (SwiGLU), down

    mtp_moe = layers[-1]
    for moe in layers + [mtp_moe] * arch.mtp_num_layers:
        total += attention()
        if moe:
            for _ in range(top_k):  # every token through top_k experts
                total += mlp(arch.moe_ffn_hidden_size)
            if arch.shared_expert_ffn_hidden_size:
                total += mlp(arch.shared_expert_ffn_hidden_size)
        else:
            total += mlp(arch.ffn_hidden_size)
    for _ in range(arch.mtp_num_layers):
        total += _gemm(s, 2 * h, h) + 2 * s * 3 * h  # eh proj, three norms
    total += (arch.mtp_num_layers + 1) * _gemm(s, h, arch.vocab_size)
    return 3 * total


@pytest.mark.parametrize(
    "arch",
    [
        DEEPSEEK_V3,
        dataclasses.replace(DEEPSEEK_V3, mtp_num_layers=0, shared_expert_ffn_hidden_size=0),
        TINY.performance.architecture,  # type: ignore[union-attr]
        dataclasses.replace(TINY.performance.architecture, swiglu=False, mtp_num_layers=2),  # type: ignore[union-attr]
    ],
    ids=["dsv3", "dsv3-no-mtp-no-shared", "tiny-gqa", "tiny-gelu-2mtp"],
)
def test_flops_match_a_hand_count(arch):
    # A small model (4 layers, 1 dense) with the architecture's shapes scaled into its hidden size.
    inst = dataclasses.replace(TINY, performance=dataclasses.replace(TINY.performance, architecture=arch))
    m, s = inst.model, inst.parallel.seq_len
    layers = [i in m.moe_layers for i in range(m.num_layers)]
    want = _hand_flops(arch, m.hidden_size, s, layers, m.top_k) / s
    assert model_flops_per_token(inst) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Monotonicity and the compute-bound limit
# ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.floats(0, 2e-3), min_size=3, max_size=3),
    extra=st.lists(st.floats(0, 2e-3), min_size=3, max_size=3),
    load=st.lists(st.floats(1, 3), min_size=3, max_size=3),
    overlap=st.sampled_from(["none", "1f1b"]),
)
def test_more_alltoall_never_predicts_a_faster_step(base, extra, load, overlap):
    inst = dataclasses.replace(TINY, performance=dataclasses.replace(TINY.performance, overlap=overlap))
    model = StepTimeModel(inst)
    rank2gpu = default_placement(inst).rank2gpu
    more = [a + b for a, b in zip(base, extra)]
    slow = model.predict(more, load, rank2gpu)
    fast = model.predict(base, load, rank2gpu)
    assert slow.step_time_s >= fast.step_time_s
    assert slow.tflops_per_gpu <= fast.tflops_per_gpu


def test_more_cross_domain_bytes_on_the_same_layout_never_predict_faster():
    # Same layout, expert maps with more cross-domain bytes (evaluator's numbers end to end): a
    # slower NIC raises every cross-domain layer's time and never the prediction's speed.
    dsv3 = read_instance(INSTANCES / "dsv3_256.json")
    pl = default_placement(dsv3)
    model = StepTimeModel(dsv3)
    base = model.predict_metrics(evaluate(dsv3, pl), pl.rank2gpu)
    for factor in (2.0, 4.0, 16.0):
        cl = dataclasses.replace(dsv3.cluster, scaleout_gbps=dsv3.cluster.scaleout_gbps / factor)
        slow_inst = dataclasses.replace(dsv3, cluster=cl)
        slow = StepTimeModel(slow_inst).predict_metrics(evaluate(slow_inst, pl), pl.rank2gpu)
        assert slow.step_time_s >= base.step_time_s
        base = slow


def test_balanced_load_without_communication_is_the_compute_bound_step():
    perf = dataclasses.replace(
        TINY.performance, expert_load="balanced", grad_reduce_bytes_per_param=0.0, param_gather_bytes_per_param=0.0
    )
    inst = dataclasses.replace(TINY, performance=perf)
    model = StepTimeModel(inst)
    n = inst.model.num_moe_layers
    pred = model.predict([0.0] * n, [2.5] * n, default_placement(inst).rank2gpu)
    # By hand: every layer's FLOPs per GPU and micro-batch at the achieved rate, slowest stage,
    # (m + (pp - 1) / vpp) micro-batch slots.
    arch, m, par = perf.architecture, inst.model, inst.parallel
    rate = perf.peak_flops_per_s * perf.gemm_efficiency
    from placement.performance import layer_flops_per_token

    stage_s = []
    for si, layers in enumerate(par.stage_layers):
        t = sum(sum(layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, x in m.moe_layers)) for x in layers)
        if si == par.pp - 1:
            t += arch.mtp_num_layers * sum(layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, True))
            h = m.hidden_size
            t += 6 * (arch.mtp_num_layers * (3 * h + 2 * h * h) + h * arch.vocab_size * (arch.mtp_num_layers + 1))
        stage_s.append(t * par.micro_batch * par.seq_len / rate)
    want = (par.micro_batches_per_step + (par.pp - 1) / perf.vpp) * max(stage_s)
    assert pred.step_time_s == pytest.approx(want, rel=1e-12)
    assert pred.compute_bound_step_time_s == pytest.approx(want, rel=1e-12)
    assert pred.exposed_alltoall_s_per_step == 0.0


def test_imbalance_costs_time():
    model = StepTimeModel(TINY)
    n = TINY.model.num_moe_layers
    assert model.predict([0.0] * n, [2.0] * n).step_time_s > model.predict([0.0] * n, [1.0] * n).step_time_s


def test_overlap_hides_alltoall_up_to_the_compute():
    n = TINY.model.num_moe_layers
    serial = StepTimeModel(dataclasses.replace(TINY, performance=dataclasses.replace(TINY.performance, overlap="none")))
    overlapped = StepTimeModel(TINY)
    a2a = [1e-4] * n
    assert overlapped.predict(a2a, [1.0] * n).step_time_s < serial.predict(a2a, [1.0] * n).step_time_s
    # Far more communication than compute: overlap can hide at most the compute's length.
    huge = [10.0] * n
    s, o = serial.predict(huge, [1.0] * n), overlapped.predict(huge, [1.0] * n)
    assert o.step_time_s >= s.step_time_s - s.compute_bound_step_time_s - 1e-9


# ---------------------------------------------------------------------------------------------
# Report keys
# ---------------------------------------------------------------------------------------------
def test_report_carries_predictions_with_heldout_twins():
    rep = report(TINY, default_placement(TINY))
    for key in prediction_keys():
        assert key in rep and f"heldout_{key}" in rep
    assert rep["predicted_step_time_s"] > 0
    assert rep["predicted_tflops_per_gpu"] == pytest.approx(
        model_flops_per_token(TINY) * TINY.parallel.global_batch * TINY.parallel.seq_len
        / rep["predicted_step_time_s"] / TINY.parallel.world_size / 1e12
    )


def test_no_performance_block_no_predictions():
    rep = report(dataclasses.replace(TINY, performance=None), default_placement(TINY))
    assert not any("predicted" in k for k in rep)


# ---------------------------------------------------------------------------------------------
# Calibration (the README's table): one number fitted on one point, the rest predicted
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted() -> float:
    return fit_gemm_efficiency()


def test_calibrated_constant_is_the_fit(fitted):
    assert fitted == pytest.approx(CALIBRATED_GEMM_EFFICIENCY, abs=5e-4)


def test_flop_count_matches_the_published_ratio():
    # Not fitted: TFLOP/s over tokens/s of the published point is Megatron's FLOPs per token.
    point = POINTS[FITTED_POINT]
    ours = model_flops_per_token(point_instance(point, 0.5, tokens_per_source=1))
    assert ours == pytest.approx(point.tflops_per_gpu * 1e12 / point.tokens_per_s_per_gpu, rel=1e-3)


def test_calibration_points_as_the_readme_states(fitted):
    fit = predict_point(POINTS[FITTED_POINT], fitted)
    assert fit["cross_domain_bytes_per_step"] == 0.0  # every EP group inside one rack
    assert fit["tokens_per_s_per_gpu"] == pytest.approx(6288, rel=1e-4)
    assert fit["tflops_per_gpu"] == pytest.approx(1635, rel=2e-3)
    gb200 = predict_point(POINTS["gb200_mxfp8_256"], fitted)
    assert gb200["cross_domain_bytes_per_step"] == 0.0
    # README: GB200 predicted 6,354 tokens/s (+29.4%) and 1,652 TFLOP/s (+29.5%).
    assert gb200["tokens_per_s_per_gpu"] / 4912 - 1 == pytest.approx(0.294, abs=0.01)
    assert gb200["tflops_per_gpu"] / 1276 - 1 == pytest.approx(0.295, abs=0.01)
    big = predict_point(POINTS["gb300_mxfp8_1024"], fitted)
    retention = big["tflops_per_gpu"] / fit["tflops_per_gpu"]
    # README: 98.9% predicted against 98.5% published.
    assert retention == pytest.approx(0.989, abs=0.002)
    assert retention - PUBLISHED_RETENTION_1024 == pytest.approx(0.004, abs=0.002)


def test_step_time_model_is_deterministic():
    pl = default_placement(TINY)
    a = StepTimeModel(TINY).predict_metrics(evaluate(TINY, pl), pl.rank2gpu)
    b = StepTimeModel(TINY).predict_metrics(evaluate(TINY, pl), pl.rank2gpu)
    assert a == b and np.isfinite(a.step_time_s)


def test_in_rack_balanced_job_is_compute_bound_up_to_the_bubble():
    # Every EP group inside one rack (no cross-domain byte), forced-balanced routing, no DP bytes:
    # the NVLink all-to-all hides behind compute in the steady state; only the warm-up/cool-down
    # bubble, which has no partner micro-batch, shows it.
    inst = point_instance(POINTS[FITTED_POINT], CALIBRATED_GEMM_EFFICIENCY, tokens_per_source=2)
    perf = dataclasses.replace(inst.performance, grad_reduce_bytes_per_param=0.0, param_gather_bytes_per_param=0.0)
    inst = dataclasses.replace(inst, performance=perf)
    pl = default_placement(inst)
    m = evaluate(inst, pl)
    assert m.cross_domain_bytes_per_step == 0.0
    pred = StepTimeModel(inst).predict_metrics(m, pl.rank2gpu)
    assert pred.step_time_s >= pred.compute_bound_step_time_s
    assert pred.step_time_s == pytest.approx(pred.compute_bound_step_time_s, rel=1e-3)
