"""The step-time model: FLOP count against a hand count, compute by GEMM shape by hand, property
tests at every uncertainty setting (bytes, overlap, the compute-bound limit, GEMM size), Megatron-Core's
overlap rules, and the report keys.  The ladder and ``placement calibrate``: tests/test_calibration.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.cost import evaluate
from placement.predict.report import report
from placement.formats import read_instance
from placement.core.model import InvalidInputError
from placement.core.perfdata import ATTENTION_EFFICIENCY
from placement.predict.performance import (
    DEEPSEEK_V3,
    GPU_KINDS,
    SETTINGS,
    Architecture,
    StepTimeModel,
    attention_core_flops_per_token,
    layer_flops_per_token,
    model_flops_per_token,
    per_microbatch_load,
    performance_settings,
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
# Property tests, at every uncertainty setting
# ---------------------------------------------------------------------------------------------
DSV3 = read_instance(INSTANCES / "dsv3_256.json")  # overlap 1f1b, pp 4, vpp 4: a valid Megatron-Core job
DSV3_RANKS = default_placement(DSV3).rank2gpu
N_MOE = DSV3.model.num_moe_layers
# Per-layer bytes a busy layer puts on its busiest NIC / NVLink port in one step (about what the
# evaluator reports for dsv3_256's default layout, whose racks hold parts of several EP groups).
BYTES = st.lists(st.floats(0.0, 4e10), min_size=N_MOE, max_size=N_MOE)
LOADS = st.lists(st.floats(1.0, 3.0), min_size=N_MOE, max_size=N_MOE)


def _models(overlap: str = "1f1b") -> dict[str, StepTimeModel]:
    perf = dataclasses.replace(DSV3.performance, overlap=overlap)
    return {name: StepTimeModel(DSV3, p) for name, p in performance_settings(perf).items()}


MODELS = {"1f1b": _models("1f1b"), "none": _models("none")}


def _predict(model: StepTimeModel, nic, nvl, load, **kw):
    return model.predict([0.0] * N_MOE, load, DSV3_RANKS, nic_bytes_per_layer=nic, nvlink_bytes_per_layer=nvl, **kw)


@settings(max_examples=40, deadline=None)
@given(nic=BYTES, extra=BYTES, nvl=BYTES, load=LOADS, overlap=st.sampled_from(["none", "1f1b"]))
def test_more_cross_rack_bytes_on_the_same_layout_never_predict_a_faster_step(nic, extra, nvl, load, overlap):
    more = [a + b for a, b in zip(nic, extra)]
    for setting, model in MODELS[overlap].items():
        slow, fast = _predict(model, more, nvl, load), _predict(model, nic, nvl, load)
        assert slow.step_time_s >= fast.step_time_s, setting
        assert slow.tflops_per_gpu <= fast.tflops_per_gpu, setting


@settings(max_examples=40, deadline=None)
@given(nic=BYTES, nvl=BYTES, load=LOADS)
def test_no_overlap_is_never_faster_than_overlap(nic, nvl, load):
    for setting in SETTINGS:
        serial = _predict(MODELS["none"][setting], nic, nvl, load)
        overlapped = _predict(MODELS["1f1b"][setting], nic, nvl, load)
        assert serial.step_time_s >= overlapped.step_time_s * (1 - 1e-12), setting


@settings(max_examples=40, deadline=None)
@given(nic=BYTES, nvl=BYTES, load=LOADS, overlap=st.sampled_from(["none", "1f1b"]))
def test_the_compute_bound_step_is_a_lower_bound_of_every_prediction(nic, nvl, load, overlap):
    for setting, model in MODELS[overlap].items():
        pred = _predict(model, nic, nvl, load)
        bound = _predict(model, nic, nvl, load, communication=False)
        assert bound.step_time_s == pytest.approx(bound.compute_bound_step_time_s, rel=1e-12)
        assert pred.step_time_s >= pred.compute_bound_step_time_s * (1 - 1e-12), setting
        assert pred.compute_bound_step_time_s == pytest.approx(bound.step_time_s, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(nic=BYTES, nvl=BYTES, load=LOADS, overlap=st.sampled_from(["none", "1f1b"]))
def test_settings_are_ordered_low_mid_high(nic, nvl, load, overlap):
    times = [_predict(MODELS[overlap][s], nic, nvl, load).step_time_s for s in SETTINGS]
    assert times[0] >= times[1] * (1 - 1e-12) and times[1] >= times[2] * (1 - 1e-12)


def test_performance_settings_keep_mid_and_spread_the_uncertain_terms():
    perf = DSV3.performance
    s = performance_settings(perf)
    assert list(s) == list(SETTINGS) and s["mid"] is perf
    for field in ("nvlink_dispatch_efficiency", "nvlink_combine_efficiency", "nic_efficiency", "gemm_efficiency"):
        assert getattr(s["low"], field) < getattr(perf, field) <= getattr(s["high"], field), field
    assert s["low"].expert_gemm_efficiency < perf.expert_gemm_efficiency
    assert s["low"].overlap_efficiency < perf.overlap_efficiency


# ---------------------------------------------------------------------------------------------
# The pieces, by hand
# ---------------------------------------------------------------------------------------------
def _s(x: float, x0: float) -> float:
    return x / (x + x0)


def _hand_layer_s(perf, m, par, moe: bool, load: float) -> float:
    """One layer's seconds per micro-batch, every GEMM listed by hand with its (M, N, K)."""
    arch, h, tp, x0 = perf.architecture, m.hidden_size, par.tp, perf.gemm_half_shape
    tokens = par.micro_batch * par.seq_len / (par.tp * par.cp)
    share = perf.fp8_gemm_ratio if perf.precision != "bf16" else 1.0
    rate = perf.peak_flops_per_s * perf.gemm_efficiency * share
    hbm = GPU_KINDS[perf.gpu].hbm_gbps * 1e9

    def gemm(mm: float, n: float, k: float, count: float = 1.0, r: float = rate) -> float:
        return 6 * mm * n * k * count / (r * _s(mm, x0) * _s(n, x0) * _s(k, x0))

    def scaled(flops: float, parts: list[tuple]) -> float:  # Megatron's FLOPs at the parts' rate
        total = sum(6 * p[0] * p[1] * p[2] * (p[3] if len(p) > 3 else 1) for p in parts)
        return sum(gemm(*p) for p in parts) * flops / total if total else 0.0

    n = arch.num_attention_heads
    if arch.attention == "mla":
        dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        attn = [(tokens, arch.q_lora_rank, h), (tokens, n * dq / tp, arch.q_lora_rank),
                (tokens, arch.kv_lora_rank + arch.qk_pos_emb_head_dim, h),
                (tokens, n * (arch.qk_head_dim + arch.v_head_dim) / tp, arch.kv_lora_rank),
                (tokens, h, n * arch.v_head_dim / tp)]
    else:
        q, kv = arch.kv_channels * n, arch.kv_channels * arch.num_query_groups
        attn = [(tokens, (q + 2 * kv) / tp, h), (tokens, h, q / tp)]
    core = attention_core_flops_per_token(arch, par.seq_len)
    d, r = layer_flops_per_token(arch, h, par.seq_len, m.top_k, moe)
    ffn = arch.shared_expert_ffn_hidden_size if moe else arch.ffn_hidden_size
    f = 3 if arch.swiglu else 2
    mlp_flops = 6 * h * ffn * f * tokens
    t = scaled((d - core) * tokens - mlp_flops, attn)
    t += core * tokens / (perf.bf16_peak_flops_per_s * ATTENTION_EFFICIENCY * _s(par.seq_len, x0) ** 2)
    # Non-GEMM bytes per element of the tensors touched: the layer's input and output (2h) and the
    # MLP's intermediates (up/gate output and activation: 3 ffn with SwiGLU, per tensor-parallel rank).
    t += perf.elementwise_bytes * tokens * (2 * h + f * ffn / tp) / hbm
    if ffn:
        t += scaled(mlp_flops, [(tokens, (f - 1) * ffn / tp, h), (tokens, h, ffn / tp)])
    if moe:
        rows = tokens * par.ep * m.top_k / m.num_experts
        local = m.num_experts / par.ep
        up = (f - 1) * arch.moe_ffn_hidden_size
        routed = scaled(r * tokens, [(rows, up, h, local), (rows, h, arch.moe_ffn_hidden_size, local)])
        routed /= perf.expert_gemm_efficiency
        t += (routed + perf.elementwise_bytes * tokens * (2 * h + f * arch.moe_ffn_hidden_size) * m.top_k / hbm) * load
    return t + perf.layer_overhead_s


def test_balanced_load_without_communication_is_the_compute_bound_step():
    perf = dataclasses.replace(
        TINY.performance, expert_load="balanced", grad_reduce_bytes_per_param=0.0, param_gather_bytes_per_param=0.0
    )
    inst = dataclasses.replace(TINY, performance=perf)
    model = StepTimeModel(inst)
    n = inst.model.num_moe_layers
    # communication=False: no pipeline sends either (they are priced whatever the all-to-all).
    pred = model.predict([0.0] * n, [2.5] * n, default_placement(inst).rank2gpu, communication=False)
    # By hand: every GEMM at ceiling x peak x s(M) s(N) s(K), the attention's score/value products
    # at the BF16 peak x s(seq)^2, the non-GEMM bytes at the HBM bandwidth, routed work times one
    # micro-batch's busiest-GPU load (balanced routing: 1 + sqrt(2 ln ep) * sqrt(1 / pairs)),
    # slowest stage, (m + (pp - 1) / vpp) slots.
    arch, m, par = perf.architecture, inst.model, inst.parallel
    tokens = par.micro_batch * par.seq_len / (par.tp * par.cp)
    load = 1 + math.sqrt(2 * math.log(par.ep)) * math.sqrt(1 / (tokens * m.top_k))
    share = perf.fp8_gemm_ratio if perf.precision != "bf16" else 1.0
    rate = perf.peak_flops_per_s * perf.gemm_efficiency * share
    x0 = perf.gemm_half_shape
    stage_s = []
    for si, layers in enumerate(par.stage_layers):
        t = sum(_hand_layer_s(perf, m, par, x in m.moe_layers, load) for x in layers)
        if si == par.pp - 1:
            t += arch.mtp_num_layers * _hand_layer_s(perf, m, par, True, load)
            h = m.hidden_size
            # Each MTP layer's norms and projection (3h + 2h^2 per token) at the (T, h, 2h) GEMM's
            # rate; the output layer of the main and every MTP head at the (T, vocab / tp, h) one.
            t += arch.mtp_num_layers * tokens * 6 * (3 * h + 2 * h * h) / (rate * _s(tokens, x0) * _s(h, x0) * _s(2 * h, x0))
            v = arch.vocab_size / par.tp
            t += tokens * 6 * h * arch.vocab_size * (arch.mtp_num_layers + 1) / (rate * _s(tokens, x0) * _s(v, x0) * _s(h, x0))
        stage_s.append(t)
    want = (par.micro_batches_per_step + (par.pp - 1) / perf.vpp) * max(stage_s)
    assert pred.step_time_s == pytest.approx(want, rel=1e-12)
    assert pred.compute_bound_step_time_s == pytest.approx(want, rel=1e-12)
    assert pred.exposed_alltoall_s_per_step == 0.0


def test_per_microbatch_load_spreads_by_the_sampling_noise_and_capacity_drops_the_rest():
    assert per_microbatch_load(np.array([1.0]), 1e12, 64)[0] == pytest.approx(1.0, rel=1e-5)
    assert per_microbatch_load(np.array([1.2]), 100.0, 1)[0] == 1.2  # no EP: one GPU
    got = per_microbatch_load(np.array([1.0, 2.0]), 400.0, 32)
    assert got == pytest.approx([1 + math.sqrt(2 * math.log(32)) / 20, 2 + math.sqrt(2 * math.log(32)) * math.sqrt(2) / 20])
    # A capacity factor caps the busiest rank's compute: the tokens over it are dropped.
    perf = dataclasses.replace(DSV3.performance, capacity_factor=1.5)
    capped, free = StepTimeModel(DSV3, perf), StepTimeModel(DSV3)
    heavy = [3.0] * N_MOE
    assert capped.predict([0.0] * N_MOE, heavy).step_time_s < free.predict([0.0] * N_MOE, heavy).step_time_s
    at_cap = [1.5 - 0.2] * N_MOE  # under the cap after the spread: the same prediction
    assert capped.predict([0.0] * N_MOE, at_cap).step_time_s == free.predict([0.0] * N_MOE, at_cap).step_time_s


def test_overlap_pairs_each_transfer_with_one_compute_node():
    # One MoE layer, one transfer at a time: a transfer longer than its partner node shows its
    # excess; the four partners are Megatron-Core's (attention for the combines, expert GEMMs for
    # the dispatches), and the SMs the kernels take slow the partner down.
    perf = dataclasses.replace(DSV3.performance, overlap="1f1b")
    model = StepTimeModel(DSV3, perf)
    s = 1  # a middle stage: only MoE layers
    attn = model._dense[s][0] + model._overhead[s][0]
    mlp = model._routed[s][0] * per_microbatch_load(np.array([1.0]), model._pairs_per_gpu, model._ep)[0]
    t = np.zeros((1, 4))
    t[0, 0] = 1.0  # forward dispatch: behind the backward expert GEMMs (2/3 of mlp)
    assert model._pair(t[:, 0], np.array([2 * mlp / 3]))[0] == pytest.approx(1.0)
    sm = dataclasses.replace(perf, comm_sms=32)
    slowed = StepTimeModel(DSV3, sm)
    share = sm.comm_sm_share
    assert share == pytest.approx(32 / GPU_KINDS["gb300"].sm_count)
    small = np.array([1e-6])
    assert slowed._pair(small, np.array([attn]))[0] == pytest.approx(attn + share * 1e-6, rel=1e-12)
    half = dataclasses.replace(perf, overlap_efficiency=0.5)
    want = attn + 0.5e-6 + perf.comm_sm_share * 0.5e-6  # half exposed, half beside attention
    assert StepTimeModel(DSV3, half)._pair(small, np.array([attn]))[0] == pytest.approx(want, rel=1e-12)


def test_data_parallel_groups_use_every_nic_of_the_racks_they_span():
    model = StepTimeModel(DSV3)
    groups = np.array([[[0, 1, 2, 3]]])  # one stage, one group of 4 ranks
    params = np.array([1e9])
    b = model._bytes_per_param * 1e9
    nvl, nic = model._dp_nvl_bps, model._dp_nic_bps
    ranks = np.arange(DSV3.parallel.world_size)
    inside = model._group_time_s(groups, params, ranks)  # ranks 0-3 on GPUs 0-3: one rack
    assert inside[0] == pytest.approx(b * 3 / 4 / nvl)
    g2d = DSV3.cluster.gpu2domain
    other = int(np.flatnonzero(g2d == 1)[0])
    r2g = ranks.copy()
    r2g[[2, 3]] = [other, other + 1]  # two members in each of two racks: hierarchical, 2 NICs each side
    spans = model._group_time_s(groups, params, r2g)
    assert spans[0] == pytest.approx(b * 1 / 2 / nvl + b * (1 / 2) / 2 / nic)
    assert spans[0] > inside[0]


def test_mtp_layer_is_priced_with_its_own_metrics_when_the_instance_carries_it():
    m = DSV3.model
    with_mtp = dataclasses.replace(DSV3, model=dataclasses.replace(m, moe_layers=m.moe_layers + (m.num_layers,)))
    model = StepTimeModel(with_mtp)
    n = m.num_moe_layers
    quiet = model.predict([0.0] * (n + 1), [1.0] * (n + 1))
    busy_mtp = model.predict([0.0] * (n + 1), [1.0] * n + [3.0])
    busy_last = model.predict([0.0] * (n + 1), [1.0] * (n - 1) + [3.0, 1.0])
    assert busy_mtp.step_time_s > quiet.step_time_s
    # Today's instances (no MTP index): the MTP layer takes the last MoE layer's load.
    today = StepTimeModel(DSV3)
    a = today.predict([0.0] * n, [1.0] * (n - 1) + [3.0])
    b = today.predict([0.0] * n, [1.0] * n)
    assert a.step_time_s > b.step_time_s
    assert busy_last.step_time_s > quiet.step_time_s


# ---------------------------------------------------------------------------------------------
# Megatron-Core's overlap rules, read by the instance reader
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,field",
    [
        (dict(vpp=1), "performance.vpp"),
        (dict(overlap_efficiency=1.5), "performance.overlap_efficiency"),
        (dict(dispatcher="nccl"), "performance.dispatcher"),
    ],
)
def test_reader_refuses_what_megatron_core_refuses(tmp_path, change, field):
    doc = json.loads((INSTANCES / "dsv3_256.json").read_text())
    doc["performance"].update(change)
    doc["performance"]["architecture"]["mtp_num_layers"] = 1
    (tmp_path / "x.json").write_text(json.dumps(doc))
    (tmp_path / "x.npz").write_bytes((INSTANCES / "dsv3_256.npz").read_bytes())
    with pytest.raises(InvalidInputError, match=field.replace(".", r"\.")):
        read_instance(tmp_path / "x.json")


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


def test_step_time_model_is_deterministic():
    pl = default_placement(TINY)
    a = StepTimeModel(TINY).predict_metrics(evaluate(TINY, pl), pl.rank2gpu)
    b = StepTimeModel(TINY).predict_metrics(evaluate(TINY, pl), pl.rank2gpu)
    assert a == b and np.isfinite(a.step_time_s)


def test_data_model_imports_neither_the_step_time_model_nor_the_evaluator():
    import ast

    root = Path(__file__).resolve().parent.parent / "placement" / "core"
    for name in ("model.py", "perfdata.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & {"placement.predict.performance", "placement.predict.cost", "placement.predict.calibration"}, name
    assert not {m for m in imported if m.startswith("placement")}  # perfdata: pure data


def test_a_dense_layer_never_costs_more_than_a_balanced_moe_layer_with_as_many_flops():
    # DeepSeek-V3: a dense layer's MLP (18,432) does 9 x 2,048 like the 8 routed experts plus the
    # shared one, so the FLOPs tie; its GEMMs are wider and it moves no routed copies.
    for inst in (DSV3, read_instance(INSTANCES / "dsv3_1024.json")):
        arch, m, par = inst.performance.architecture, inst.model, inst.parallel
        d_dense, _ = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, False)
        d_moe, r_moe = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, True)
        assert d_dense <= (d_moe + r_moe) * (1 + 1e-12)
        model = StepTimeModel(inst)
        assert model.dense_layer_s <= model.moe_layer_s


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 1 << 16), n=st.integers(1, 1 << 16), k=st.integers(1, 1 << 16), grow=st.integers(1, 1 << 12)
)
def test_a_larger_gemm_never_runs_at_a_lower_rate(m, n, k, grow):
    from placement.predict.compute import ComputeRates, Gemm

    rates = ComputeRates(TINY.performance)
    rate = lambda g: g.flops / rates.gemm_s([g])  # noqa: E731
    base = Gemm(m, n, k)
    for bigger in (Gemm(m + grow, n, k), Gemm(m, n + grow, k), Gemm(m, n, k + grow)):
        assert rate(bigger) >= rate(base) * (1 - 1e-12)
    assert rate(base) <= rates.gemm_flops_per_s
