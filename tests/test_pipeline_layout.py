"""Megatron-Core's pipeline layout: parse/render against Megatron's own parser, the step model's
stage composition and pipeline sends, the split search, and the layout in files and exports."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.cost import evaluate
from placement.predict.report import report
from placement.formats import read_instance
from placement.core.model import Cluster, InvalidInputError, Placement
from placement.predict.performance import StepTimeModel, p2p_bytes_per_boundary, stage_items
from placement.core.pipeline_layout import (
    chunk_decoder_layers,
    legacy_chunks,
    parse_layout,
    render_layout,
    split_into_virtual_stages,
    stage_decoder_layers,
    validate_chunks,
    with_layout,
)
from placement.predict.pipeline_split import best_bottleneck_split, choose_layout, improve_split
from solvers.default import default_rank2gpu
from tests.conftest import INSTANCES

megatron_layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
PipelineParallelLayerLayout = megatron_layout.PipelineParallelLayerLayout
_CHAR = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}

DSV3_RECIPE = "Ett|(tt|)*14,t|(tt|)*15,mL"


def _megatron_chunks(text: str, pp: int) -> tuple[str, ...]:
    """Megatron-Core 0.16.1's own parse, back in our chunk order (chunk i = vpp i // pp, rank i % pp)."""
    lay = PipelineParallelLayerLayout(text, pp)
    vpp = lay.virtual_pipeline_model_parallel_size
    return tuple("".join(_CHAR[x.name] for x in lay.layout[i % pp][i // pp]) for i in range(pp * vpp))


@contextlib.contextmanager
def _megatron_vpp(vpp: int):
    """Megatron's layer ids read the virtual pipeline size from parallel_state (None: no vpp)."""
    from megatron.core import parallel_state

    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _identity(inst) -> Placement:
    m = inst.model
    return Placement(default_rank2gpu(inst), np.tile(np.arange(m.num_experts), (m.num_moe_layers, 1)))


@pytest.fixture(scope="module")
def tiny():
    return read_instance(INSTANCES / "tiny.json")


@pytest.fixture(scope="module")
def dsv3():
    return read_instance(INSTANCES / "dsv3_1024.json")


# ---------------------------------------------------------------------------------------------
# Parse, render, validate: Megatron-Core's own parser is the reference
# ---------------------------------------------------------------------------------------------
def test_the_recipe_layout_is_bridges_pp16_split_over_two_virtual_stages_as_megatron_reads_it(dsv3):
    chunks = parse_layout(DSV3_RECIPE)
    assert chunks == _megatron_chunks(DSV3_RECIPE, 16)
    # Per rank, Bridge's PP16 contents [E+4] | [4]x14 | [1+mtp+loss]: counted by hand.
    per_rank = ["".join(chunks[r::16]) for r in range(16)]
    assert per_rank[0] == "Etttt" and per_rank[15] == "tmL" and all(x == "tttt" for x in per_rank[1:15])
    assert dsv3.parallel.pipeline_layout == chunks
    assert dsv3.parallel.stage_layers[0] == (0, 1, 31, 32)  # layers numbered in chunk order
    assert dsv3.parallel.stage_layers[15] == (30,)
    assert dsv3.parallel.item_stage("m") == 15 and dsv3.parallel.item_stage("L") == 15
    lay = PipelineParallelLayerLayout(DSV3_RECIPE, 16)
    assert lay.validate_layer_layout(num_layers=61, mtp_num_layers=1) is False  # MTP with the loss
    with _megatron_vpp(2):
        for r in range(16):
            for v in range(2):
                assert tuple(lay.get_layer_id_list(vp_stage=v, pp_rank=r)) == chunk_decoder_layers(chunks)[v * 16 + r]


_chunk = st.text(alphabet="tt", min_size=0, max_size=4)


@st.composite
def _layouts(draw):
    pp = draw(st.integers(1, 4))
    vpp = draw(st.integers(1, 3))
    body = [draw(_chunk) for _ in range(pp * vpp)]
    body[0] = "E" + body[0]
    mtp = draw(st.integers(0, 1))
    if mtp:
        k = draw(st.integers((vpp - 1) * pp, pp * vpp - 1))
        # MTP after every decoder layer: move the later chunks' layers before it.
        later = sum(c.count("t") for c in body[k + 1:])
        for i in range(k + 1, len(body)):
            body[i] = body[i].replace("t", "")
        body[k] = body[k] + "t" * later + "m"
    body[-1] = body[-1] + "L"
    return pp, tuple(body), mtp


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_every_rendered_layout_parses_to_the_same_stages_in_megatron(case):
    pp, chunks, mtp = case
    text = render_layout(chunks)
    assert parse_layout(text) == chunks
    assert _megatron_chunks(text, pp) == chunks
    n = "".join(chunks).count("t")
    vpp = validate_chunks(chunks, pp, n, mtp)
    PipelineParallelLayerLayout(text, pp).validate_layer_layout(num_layers=n, mtp_num_layers=mtp)
    assert vpp == len(chunks) // pp
    # Each rank's decoder layers are exactly Megatron's layer ids over its virtual stages.
    lay = PipelineParallelLayerLayout(text, pp)
    with _megatron_vpp(vpp):
        for r in range(pp):
            ids = sorted(i for v in range(vpp) for i in lay.get_layer_id_list(vp_stage=v, pp_rank=r))
            assert tuple(ids) == stage_decoder_layers(chunks, pp)[r]


@pytest.mark.parametrize(
    "text, pp, layers, mtp, words",
    [
        ("Ett|ttmL|", 2, 4, 1, "multiple of pp"),
        ("tEt|ttmL", 2, 4, 1, "first layer"),
        ("Ett|tLtm", 2, 4, 1, "last layer"),
        ("Ett|tmL", 2, 4, 1, "decoder layers"),
        ("Ett|ttL", 2, 4, 1, "MTP layers"),
        ("Ettm|ttL", 2, 4, 1, "before the MTP"),
        ("Etttt|m|L|", 2, 4, 1, "last virtual stage"),
        ("Ett|tmx|L", 1, 3, 1, "invalid layer character"),
    ],
)
def test_megatron_refuses_what_we_refuse(text, pp, layers, mtp, words):
    with pytest.raises(InvalidInputError, match=words):
        validate_chunks(parse_layout(text), pp, layers, mtp)
    with pytest.raises((AssertionError, KeyError)):
        PipelineParallelLayerLayout(text, pp).validate_layer_layout(num_layers=layers, mtp_num_layers=mtp)


def test_a_repetition_that_unrolls_past_the_limit_is_an_input_error():
    with pytest.raises(InvalidInputError, match="unrolls past"):
        parse_layout("E(t|)*99999999,L")


def test_splitting_a_vpp1_recipe_keeps_every_ranks_contents():
    recipe = parse_layout("Et*4|(t*4|)*14,tmL")
    chunks = split_into_virtual_stages(recipe, 2)
    assert render_layout(chunks) == DSV3_RECIPE
    for r in range(16):
        assert sorted("".join(chunks[r::16])) == sorted(recipe[r])


# ---------------------------------------------------------------------------------------------
# The step model: a stage holds what the layout puts there
# ---------------------------------------------------------------------------------------------
def test_a_legacy_instance_prices_the_same_as_its_equivalent_layout(tiny):
    pl = _identity(tiny)
    chunks = legacy_chunks(tiny.parallel.stage_layers, tiny.model.num_layers, tiny.performance.architecture.mtp_num_layers)
    a = report(tiny, pl)
    b = report(with_layout(tiny, chunks), pl)
    for key in ("predicted_step_time_s", "heldout_predicted_step_time_s", "predicted_tflops_per_gpu_low"):
        assert a[key] == pytest.approx(b[key], rel=1e-12)


def test_mtp_and_loss_are_priced_on_the_stages_that_hold_them(tiny):
    """The loss by hand (6 h V (1 + mtp) FLOPs per token at the output GEMM's rate) lands on the stage that
    holds L; the step without communication is (M + (pp - 1)/vpp) x the slowest stage's sum."""
    pl = _identity(tiny)
    perf = dataclasses.replace(tiny.performance, overlap="none")
    base = dataclasses.replace(tiny, performance=perf)
    par, arch, h = tiny.parallel, perf.architecture, tiny.model.hidden_size
    tokens = par.micro_batch * par.seq_len / (par.tp * par.cp)
    # The output GEMM (tokens, vocab / tp, h) at ceiling x peak x FP8 share x s(M) s(N) s(K),
    # s(x) = x / (x + gemm_half_shape) (placement.predict.compute).
    share = perf.fp8_gemm_ratio if perf.precision != "bf16" else 1.0
    s = [x / (x + perf.gemm_half_shape) for x in (tokens, arch.vocab_size / par.tp, h)]
    rate = perf.peak_flops_per_s * perf.gemm_efficiency * share * s[0] * s[1] * s[2]
    loss_by_hand = tokens * 6 * h * arch.vocab_size * (1 + arch.mtp_num_layers) / rate
    m = evaluate(with_layout(base, parse_layout("Ettt|tmL")), pl, window="sampled")
    per_item = {}
    for text in ("Ettt|tmL", "Etttt|mL", "Ettttm|L"):
        inst = with_layout(base, parse_layout(text))
        mdl = StepTimeModel(inst)
        _, _, c, _ = mdl.item_times_s(m.alltoall_time_s_per_layer, m.expert_load_max_over_mean_per_layer,
                                      communication=False)
        held = stage_items(inst, 1)
        sums, k = [], 0
        for items in held:
            sums.append(float(c[k:k + len(items)].sum()))
            for it, x in zip(items, c[k:k + len(items)]):
                per_item[text, it] = float(x)
            k += len(items)
        assert per_item[text, ("L", 0)] == pytest.approx(loss_by_hand, rel=1e-12)
        assert per_item[text, ("E", 0)] == 0.0
        pred = mdl.predict(m.alltoall_time_s_per_layer, m.expert_load_max_over_mean_per_layer, communication=False)
        want = (par.micro_batches_per_step + (par.pp - 1) / perf.vpp) * max(sums)
        assert pred.step_time_s == pytest.approx(want, rel=1e-12)
        if text == "Ettttm|L":
            assert sums[1] == pytest.approx(loss_by_hand, rel=1e-12)  # stage 1 holds the loss alone
            assert inst.moe_layer2stage[-1] == 0  # decoder MoE layer 3 moved to stage 0 with it
    # MTP costs the same wherever it sits (the same metrics stand in for its MoE part).
    assert per_item["Etttt|mL", ("m", 0)] == pytest.approx(per_item["Ettttm|L", ("m", 0)], rel=1e-12)


def test_pipeline_sends_are_priced_on_the_link_they_cross(tiny, dsv3):
    """Hand count: bytes per boundary = mb * seq / cp * hidden * 2 / tp; a stage sends forward on
    its outgoing boundaries and backward on its incoming ones, at NVLink or NIC speed."""
    par, cl, perf = dsv3.parallel, dsv3.cluster, dsv3.performance
    nbytes = par.micro_batch * par.seq_len * dsv3.model.hidden_size * 2
    assert p2p_bytes_per_boundary(dsv3) == nbytes == 58_720_256  # the "about 59 MB"
    mdl = StepTimeModel(dsv3)
    nic = cl.scaleout_gbps * 1e9 * perf.nic_efficiency
    all_cross = mdl.p2p_time_s(None)
    # 32 chunks, 31 boundaries; rank 0 sends forward on chunks 0, 16 and backward into 16 (from 15):
    # 3 sends; ranks 1..14: 4; rank 15: forward from 15, backward into 15 and 31: 3.  The boundary
    # after "mL" does not exist; none is after MTP here, so every boundary carries one tensor.
    want = np.array([3] + [4] * 14 + [3]) * nbytes / nic
    np.testing.assert_allclose(all_cross, want, rtol=1e-12)
    # With the default rank layout: order tp-cp-ep-dp-pp with tp = cp = 1 puts rank k of stage s at
    # global rank 64 s + k, so a boundary a -> b crosses racks when any of those pairs does.
    r2g = default_rank2gpu(dsv3)
    doms = cl.gpu2domain[r2g].reshape(par.pp, par.dp)
    want = np.zeros(par.pp)
    for i in range(31):
        a, b = i % 16, (i + 1) % 16
        t = nbytes / (nic if (doms[a] != doms[b]).any() else cl.nvlink_gbps * 1e9)
        want[a] += t
        want[b] += t
    np.testing.assert_allclose(mdl.p2p_time_s(r2g), want, rtol=1e-12)
    # (every boundary of the default layout crosses racks, as the issue says).  One rack for all of
    # tiny's 16 ranks: every send at the NVLink spec.
    tiny = read_instance(INSTANCES / "tiny.json")
    one = Cluster(num_domains=1, trays_per_domain=4, gpus_per_tray=4, available=np.ones(16, dtype=bool),
                  nvlink_gbps=900.0, scaleout_gbps=100.0)
    inst = dataclasses.replace(tiny, cluster=one)
    b = p2p_bytes_per_boundary(inst)
    np.testing.assert_allclose(StepTimeModel(inst).p2p_time_s(np.arange(16)), [b / 900e9, b / 900e9], rtol=1e-12)


def test_the_mtp_stage_sends_main_and_mtp_hidden_states_to_a_separate_loss_stage(tiny):
    inst = with_layout(tiny, parse_layout("Ettttm|L"))
    b = p2p_bytes_per_boundary(inst)
    got = StepTimeModel(inst).p2p_time_s(None)
    nic = inst.cluster.scaleout_gbps * 1e9 * inst.performance.nic_efficiency
    np.testing.assert_allclose(got, [2 * b / nic, 2 * b / nic], rtol=1e-12)  # (1 + mtp) x the tensor
    got1 = StepTimeModel(with_layout(tiny, parse_layout("Ettt|tmL"))).p2p_time_s(None)
    np.testing.assert_allclose(got1, [b / nic, b / nic], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# The split search
# ---------------------------------------------------------------------------------------------
def _brute_bottleneck(weight, chunks, m0, mtp, first):
    n = len(weight)
    best = None
    for cut in itertools.combinations(range(1, n), chunks - 1):
        b = (0,) + cut + (n,)
        ok = True
        for k in range(chunks):
            i, j = b[k], b[k + 1]
            if m0 < i < m0 + mtp or m0 < j < m0 + mtp:
                ok = False
            if mtp and i < m0 + mtp and j > m0 and k < first:
                ok = False
        if ok:
            v = max(sum(weight[b[k]:b[k + 1]]) for k in range(chunks))
            best = v if best is None else min(best, v)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=4, max_size=9), st.integers(2, 4), st.integers(0, 1))
def test_the_dynamic_programme_finds_the_brute_force_bottleneck(ws, chunks, mtp):
    weight = np.array(ws, dtype=float)
    n = len(weight)
    if chunks > n:
        return
    m0 = n - 1 - mtp  # items: E t.. m L
    first = chunks // 2
    got = best_bottleneck_split(weight, chunks, m0, mtp, first)
    want = _brute_bottleneck(weight, chunks, m0, mtp, first)
    if want is None:
        assert got is None
        return
    assert got is not None and got[0] == 0 and got[-1] == n
    assert max(weight[a:b].sum() for a, b in zip(got[:-1], got[1:])) == pytest.approx(want)


def test_local_search_never_worsens_and_keeps_megatrons_rules():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n_layers, pp, vpp = 9, 2, 2
        tau = rng.uniform(0.5, 2.0, n_layers + 3)
        sigma = tau * 1.1
        start = best_bottleneck_split(tau, pp * vpp, n_layers + 1, 1, (vpp - 1) * pp)
        out = improve_split(start, tau, sigma, pp, 8, vpp, n_layers + 1, 1)
        seq = "E" + "t" * n_layers + "mL"
        chunks = tuple(seq[a:b] for a, b in zip(out[:-1], out[1:]))
        validate_chunks(chunks, pp, n_layers, 1)

        def obj(b):
            ct = np.add.reduceat(tau, b[:-1]).reshape(-1, pp).sum(axis=0)
            cs = np.add.reduceat(sigma, b[:-1]).reshape(-1, pp).sum(axis=0)
            return 7 * ct.max() + (1 + (pp - 1) / vpp) * cs.max()

        assert obj(out) <= obj(start) * (1 + 1e-12)


def test_the_chosen_split_is_never_slower_than_the_instances_and_megatron_accepts_it(dsv3):
    pl = _identity(dsv3)
    choice = choose_layout(dsv3, pl)
    assert choice.step_time_s[choice.name] <= choice.step_time_s["instance"]
    text = choice.to_dict()["chosen"]
    assert _megatron_chunks(text, 16) == choice.chunks
    PipelineParallelLayerLayout(text, 16).validate_layer_layout(num_layers=61, mtp_num_layers=1)
    # The recipe's split beats the old one (E+3 .. 2+MTP+L) on this placement, as the issue reports.
    old = with_layout(dsv3, parse_layout("Et|(tt|)*30,mL"))
    t_old = StepTimeModel(old).predict_metrics(evaluate(old, pl, window="sampled"), pl.rank2gpu).step_time_s
    assert choice.step_time_s["instance"] < t_old


# ---------------------------------------------------------------------------------------------
# Files and exports
# ---------------------------------------------------------------------------------------------
def test_instance_layout_errors_name_the_field(tmp_path):
    doc = json.loads((INSTANCES / "tiny.json").read_text())
    doc["routing"]["file"] = str(INSTANCES / "tiny.npz")
    for layout, field in (("Ett|tmL|", "pipeline_model_parallel_layout"), ("Ett|ttmL", "vpp")):
        d = json.loads(json.dumps(doc))
        d["parallel"]["pipeline_model_parallel_layout"] = layout
        d["parallel"].pop("stage_layers")
        if field == "vpp":
            d["parallel"]["pipeline_model_parallel_layout"] = "Et|t|t|tmL"
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(d))
        with pytest.raises(InvalidInputError, match=field):
            read_instance(p)
    d = json.loads(json.dumps(doc))
    d["parallel"]["pipeline_model_parallel_layout"] = "Et|tttmL"  # stage_layers say 2 + 2
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(InvalidInputError, match="parallel.stage_layers"):
        read_instance(p)


def test_solve_records_the_chosen_layout_and_exports_it(tmp_path, tiny):
    from placement.api import save_result, solve, verify_placement
    from placement.consumers.export import export_file
    from placement.consumers.launch import megatron_args, torchtitan_args, torchtitan_module_fqns

    res = solve(tiny, time_limit_s=8, seed=0, num_workers=1)
    chosen = res.details["pipeline_layout"]["chosen"]
    cands = res.details["pipeline_layout"]["candidates"]
    assert min(c["predicted_step_time_s"] for c in cands.values()) == pytest.approx(
        cands[res.details["pipeline_layout"]["candidate"]]["predicted_step_time_s"])
    out = tmp_path / "p.json"
    save_result(tiny, res, out)
    doc = json.loads(out.read_text())
    assert doc["pipeline_model_parallel_layout"] == chosen
    assert verify_placement(INSTANCES / "tiny.json", out).valid
    inst = with_layout(tiny, parse_layout(chosen))
    assert doc["metrics"]["predicted_step_time_s"] == pytest.approx(report(inst, res.placement)["predicted_step_time_s"], rel=1e-12)
    files = export_file("slurm", out, tmp_path / "job.hosts", INSTANCES / "tiny.json")
    script = next(t for p, t in files.items() if p.name.endswith(".launch.sh"))
    assert "--pipeline-model-parallel-layout " + "|".join(parse_layout(chosen)) in script
    args, _ = megatron_args(inst)
    text = args[args.index("--pipeline-model-parallel-layout") + 1]
    assert _megatron_chunks(text, 2) == parse_layout(chosen)
    # TorchTitan: MTP refuses pipeline parallelism; without MTP the module names per stage.
    assert torchtitan_args(inst)[0] is None and "MTP" in torchtitan_args(inst)[1]
    no_mtp = dataclasses.replace(inst, parallel=dataclasses.replace(inst.parallel, pipeline_layout=("Ett", "t", "t", "tL")))
    fqns, _ = torchtitan_module_fqns(no_mtp)
    assert fqns == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["layers.4", "norm", "lm_head"]]


def test_keep_pipeline_layout_keeps_the_instances_split(tmp_path, tiny):
    from placement.cli import main

    out = tmp_path / "keep.json"
    assert main(["solve", str(INSTANCES / "tiny.json"), "--time-limit", "8", "--keep-pipeline-layout", "-q",
                 "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "pipeline_model_parallel_layout" not in doc and "pipeline_layout" not in doc["solve"]["details"]
    pl = Placement(np.array(doc["rank2gpu"]), np.array(doc["phy2log"]))
    assert doc["metrics"]["predicted_step_time_s"] == pytest.approx(report(tiny, pl)["predicted_step_time_s"], rel=1e-12)
