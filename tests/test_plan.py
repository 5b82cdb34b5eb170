"""placement plan: memory model, enumeration, stage split, bounds, pruning, determinism, exit codes."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

import placement
from placement.cli import main
from placement.core.executor import LocalExecutor, make_executor
from placement.formats import dumps
from placement.core.model import InfeasibleError, InvalidInputError
from placement.predict.performance import Architecture, StepTimeModel
from placement.core.pipeline_layout import parse_layout
from placement.plan.bounds import compute_bound_step_s, load_lower_bound, tokens_per_s_bound
from placement.plan.candidates import CandidateSpace, enumerate_candidates, parse_candidates, stage_split
from placement.plan.evaluate import regroup, segment_rank2gpu
from placement.formats.job import Training, read_cluster, read_job
from placement.plan.memory import activation_bytes_per_token, memory_estimate
from placement.plan.planner import plan
from placement.plan.report import plan_document
from placement.plan.skeleton import stage_model

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = ROOT / "instances"
TINY = json.loads((INSTANCES / "tiny.json").read_text())
# A small candidate set on the tiny cluster: a few items, each solve a second or two.
SMALL = CandidateSpace(tp=(1,), cp=(1,), pp=(1, 2), vpp=(1,), ep=(4, 8), dp=(4, 8), micro_batch=(1,))


def _job_doc(**over) -> dict:
    doc = {
        "schema_version": 1,
        "kind": "job",
        "name": "tiny_job",
        "model": TINY["model"],
        "performance": {k: v for k, v in TINY["performance"].items() if k != "vpp"},
        "batch": {"global_batch": 32, "seq_len": 512, "micro_batch": [1]},
        "routing": {"instance": str(INSTANCES / "tiny.json")},
    }
    doc.update(over)
    return copy.deepcopy(doc)


def _cluster_doc(**over) -> dict:
    doc = {"schema_version": 1, "kind": "cluster", "name": "tiny_cluster", **TINY["cluster"], "gpu_hbm_gb": 1.0,
           "hbm_reserve_gb": 0.0}
    doc.update(over)
    return copy.deepcopy(doc)


def _write(tmp_path: Path, name: str, doc: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture
def files(tmp_path):
    return _write(tmp_path, "job.json", _job_doc()), _write(tmp_path, "cluster.json", _cluster_doc())


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def test_memory_by_hand_on_a_tiny_model(files):
    """Every term of the estimate for tiny (h=256, 4 layers, 16 experts) recomputed by hand."""
    job = read_job(files[0])
    split = ((0, 1), (2, 3))
    tp, cp, ep, dp, pp, vpp, mb = 1, 1, 8, 8, 2, 1, 1
    sm = stage_model(job, tp, cp, ep, pp, mb, split, vpp)
    est = memory_estimate(job, sm, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp, micro_batch=mb)
    h, V, heads, qg, d = 256, 1024, 4, 2, 64
    attn = h * d * (heads + 2 * qg) + heads * d * h  # GQA: q, k, v and the output projection
    dense_mlp = 3 * h * 512  # SwiGLU, ffn 512
    moe_dense = attn + 3 * h * 128 + h * 16  # attention, shared expert, router
    expert = 3 * h * 128  # one routed expert
    # stage 0: layer 0 dense, layer 1 MoE, the embedding; 2 experts per GPU (16 / ep 8)
    p0_dense = attn + dense_mlp + moe_dense + V * h
    p0_expert = 2 * expert
    # stage 1: layers 2, 3 MoE, output layer, one MTP layer (MoE: the last layer is MoE) + its projection 2h^2
    # (+ V * h: Megatron-Core builds an embedding on the MTP stage, gpt_model.py "pre_process or mtp_process")
    p1_dense = 2 * moe_dense + V * h + (moe_dense + 2 * h * h) + V * h
    p1_expert = 2 * 2 * expert + 2 * expert
    assert sm.dense_params_per_gpu[0] == p0_dense and sm.expert_params_per_gpu[0] == p0_expert
    assert sm.dense_params_per_gpu[1] == p1_dense and sm.expert_params_per_gpu[1] == p1_expert
    edp = tp * cp * dp // ep  # 1
    m = 32 // (dp * mb)  # 4 micro-batches
    tokens = 512
    act_dense = 18 * h + 6 * 512
    act_moe = 18 * h + 6 * (128 + 4 * 128) + 4 * 4 * h
    totals = []
    for s, (pd, pe, acts_tok, extra) in enumerate([
        (p0_dense, p0_expert, act_dense + act_moe, 0.0),
        (p1_dense, p1_expert, 2 * act_moe + act_moe, 0.0),
    ]):
        in_flight = min(m, pp - s)
        acts = acts_tok * tokens * in_flight
        if s == 0:
            acts += (8 + h) * tokens * in_flight
        else:
            acts += 4 * (h + V) * tokens * 2  # main head and the MTP head
        total = 6 * (pd + pe) + 12 * (pd / dp + pe / edp) + acts
        totals.append(total)
    assert est.stage == int(np.argmax(totals))
    assert est.total_bytes == pytest.approx(max(totals), rel=1e-12)


def test_memory_matches_megatrons_published_bytes_per_parameter(files):
    """Megatron-Core's distributed-optimizer guide: BF16 params + FP32 grads = 18 B/param without
    the distributed optimizer and 6 + 12/d with it; zero activations isolate the term."""
    job = read_job(files[0])
    split = ((0, 1, 2, 3),)
    for dist, dp in ((True, 8), (True, 16), (True, 32), (False, 8)):
        j = dataclasses.replace(job, training=Training(distributed_optimizer=dist))
        sm = stage_model(j, 1, 1, 8, 1, 1, split, 1)  # two experts per GPU, expert-DP = dp / 8
        est = memory_estimate(j, sm, tp=1, cp=1, ep=8, dp=dp, pp=1, vpp=1, micro_batch=1)
        pd, pe = float(sm.dense_params_per_gpu[0]), float(sm.expert_params_per_gpu[0])
        got = est.weights_bytes + est.grads_bytes + est.optimizer_bytes
        want = pd * (6 + 12 / dp) + pe * (6 + 12 / (dp // 8)) if dist else 18 * (pd + pe)
        assert got == pytest.approx(want, rel=1e-12)


def test_activation_per_layer_is_korthikantis_34_sbh_for_a_gelu_gpt():
    """Korthikanti et al. 2022, Table 2 (sequence parallel + selective recompute): 34 s b h / t for a
    GPT layer with a 4h GELU MLP; per token and GPU that is 34 h bytes."""

    class J:
        pass

    j = J()
    j.model = placement.core.model.MoEModel("gpt", 2, (1,), 8, 2, 1, 1, 1024, 1, 1)  # type: ignore[attr-defined]
    j.performance = placement.predict.performance.Performance(  # type: ignore[attr-defined]
        "gb200", "bf16", Architecture("gqa", 16, 4096, 512, 0, 1024, swiglu=False, num_query_groups=16, kv_channels=64))
    assert activation_bytes_per_token(j, moe=False) == 34 * 1024


# ---------------------------------------------------------------------------------------------
# Stage split and enumeration against brute force
# ---------------------------------------------------------------------------------------------
def _split_brute(job, pp, vpp):
    from placement.plan.candidates import _layer_costs

    costs, extra = _layer_costs(job)
    L = len(costs)
    mtp = job.performance.architecture.mtp_num_layers
    best = None
    for cuts in itertools.combinations(range(1, L), pp - 1):
        b = (0,) + cuts + (L,)
        sizes = [b[i + 1] - b[i] for i in range(pp)]
        slots = list(sizes)
        slots[0] += 1
        slots[-1] += mtp + 1
        if any(s % vpp for s in slots):
            continue
        st = [float(costs[b[i]:b[i + 1]].sum()) + (extra if i == pp - 1 else 0.0) for i in range(pp)]
        key = max(st)
        if best is None or key < best[0] * (1 - 1e-12):
            best = (key, [b])
        elif key <= best[0] * (1 + 1e-12):
            best[1].append(b)
    if best is None:
        return None
    cap = best[0]
    sq = min(sum((float(costs[b[i]:b[i + 1]].sum()) + (extra if i == pp - 1 else 0.0)) ** 2 / cap**2 for i in range(pp))
             for b in best[1])
    return cap, sq


@pytest.mark.parametrize("num_layers", [4, 7, 9])
def test_stage_split_is_the_brute_force_optimum(files, num_layers):
    job = read_job(files[0])
    m = dataclasses.replace(job.model, num_layers=num_layers, moe_layers=tuple(range(1, num_layers)))
    job = dataclasses.replace(job, model=m)
    from placement.plan.candidates import _layer_costs

    costs, extra = _layer_costs(job)
    for pp in range(1, num_layers + 1):
        for vpp in (1, 2, 3):
            got = stage_split(job, pp, vpp)
            want = _split_brute(job, pp, vpp)
            assert (got is None) == (want is None), (pp, vpp)
            if got is None:
                continue
            assert [x for s in got for x in s] == list(range(num_layers))
            st = [float(costs[list(s)].sum()) + (extra if i == pp - 1 else 0.0) for i, s in enumerate(got)]
            assert max(st) == pytest.approx(want[0], rel=1e-9)
            assert sum(x**2 for x in st) / want[0] ** 2 == pytest.approx(want[1], rel=1e-9)


def test_dsv3_pp16_split_is_the_committed_instances():
    job = read_job(INSTANCES / "dsv3_job.json")
    doc = json.loads((INSTANCES / "dsv3_1024.json").read_text())
    # The committed instance overlaps the all-to-all, so it runs a virtual pipeline (Megatron-Core
    # needs vpp > 1 with pp > 1).  Its layout is Megatron-Bridge's DeepSeek-V3 PP16 recipe
    # ([E+4] | [4]x14 | [1+mtp+loss] per rank, docs/pipeline_layout.md), not the plan's FLOPs-only
    # split, which still gives every stage layer slots that vpp divides.
    vpp = doc["performance"]["vpp"]
    assert vpp == 2
    chunks = parse_layout(doc["parallel"]["pipeline_model_parallel_layout"])
    assert ["".join(chunks[r::16]) for r in range(16)] == ["Etttt"] + ["tttt"] * 14 + ["tmL"]
    split = stage_split(job, 16, vpp)
    assert sorted(x for s in split for x in s) == list(range(61))
    slots = [len(s) for s in split]
    slots[0] += 1
    slots[-1] += 2
    assert all(n % vpp == 0 for n in slots)


def test_enumeration_against_brute_force(files):
    job, cluster = read_job(files[0]), read_cluster(files[1])
    space = CandidateSpace(tp=(1, 2, 4), cp=(1, 2), pp=(1, 2, 3, 5), vpp=(1, 2), ep=None, dp=None, micro_batch=(1, 2))
    enum, memory = enumerate_candidates(job, cluster.free_gpus, cluster.usable_bytes_per_gpu, space, min_tokens=256)
    arch, m = job.performance.architecture, job.model
    want = set()
    count = 0
    for mb, tp, cp, pp, vpp in itertools.product((1, 2), (1, 2, 4), (1, 2), (1, 2, 3, 5), (1, 2)):
        for ep in range(1, 17):
            if m.num_experts % ep:
                continue
            for dp in range(1, cluster.free_gpus + 1):
                if tp * cp * dp * pp > cluster.free_gpus:
                    continue
                count += 1
                if arch.num_attention_heads % tp or arch.num_query_groups % tp or 512 % tp or 512 % (2 * cp):
                    continue
                if (tp * cp * dp) % ep or 32 % (dp * mb) or pp > 4 or dp > 256:
                    continue
                if vpp > 1 and pp == 1:
                    continue
                split = _split_brute(job, pp, vpp)
                if split is None:
                    continue
                sm = stage_model(job, tp, cp, ep, pp, mb, stage_split(job, pp, vpp), vpp)
                est = memory_estimate(job, sm, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp, micro_batch=mb)
                if est.total_bytes <= cluster.usable_bytes_per_gpu:
                    want.add((tp, cp, pp, vpp, ep, dp, mb))
    got = {(c.tp, c.cp, c.pp, c.vpp, c.ep, c.dp, c.micro_batch) for c in enum.feasible}
    assert got == want
    # every enumerated candidate either is feasible or is counted under one reason
    assert enum.enumerated == len(enum.feasible) + sum(enum.infeasible.values())
    assert sum(1 for _ in range(0)) == 0 and count >= enum.enumerated


def test_parse_candidates():
    s = parse_candidates("pp=8,16 ep=32,64;mb=1")
    assert s.pp == (8, 16) and s.ep == (32, 64) and s.micro_batch == (1,) and s.tp == (1,)
    for bad in ("pp", "pq=1", "pp=a", "pp=0", "pp=1 pp=2"):
        with pytest.raises(InvalidInputError, match="--candidates"):
            parse_candidates(bad)


def test_regroup_keeps_tokens_in_order():
    a = np.arange(2 * 4 * 6 * 3).reshape(2, 4, 6, 3)
    assert regroup(a, 4) is a
    for dp in (1, 2, 3, 8, 24):
        r = regroup(a, dp)
        per = 24 // dp
        assert r.shape == (2, dp, per, 3)
        assert np.array_equal(r.reshape(2, -1, 3), a.reshape(2, -1, 3)[:, : dp * per])


# ---------------------------------------------------------------------------------------------
# Plans on the tiny cluster
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    jobp, clp = _write(tmp, "job.json", _job_doc()), _write(tmp, "cluster.json", _cluster_doc())
    job, cluster = read_job(jobp), read_cluster(clp)
    out = {}
    with LocalExecutor(1) as ex1:
        out["w1"] = plan(job, cluster, candidates=SMALL, time_limit_s=120, executor=ex1)
        out["noprune"] = plan(job, cluster, candidates=SMALL, time_limit_s=400, executor=ex1, prune=False)
    with LocalExecutor(2) as ex2:
        out["w2"] = plan(job, cluster, candidates=SMALL, time_limit_s=120, executor=ex2)
    out["job"], out["cluster"] = job, cluster
    return out


def test_plan_is_identical_with_one_and_two_workers(tiny_plans):
    assert dumps(plan_document(tiny_plans["w1"])) == dumps(plan_document(tiny_plans["w2"]))


def test_a_plan_cut_by_the_wall_clock_says_so(tiny_plans):
    from placement.plan import plan_table

    r = tiny_plans["w1"]
    assert r.counts["wall_clock_cut"] == 0 and not r.deadline_hit
    assert all("wall_clock_cut" not in row.details for row in r.rows)
    assert "may depend on the machine's load" not in plan_table(r)
    cut = dataclasses.replace(r, counts={**r.counts, "wall_clock_cut": 2})
    assert "the wall-clock safety net cut 2 solves short: the plan may depend on the machine's load" in plan_table(cut)
    late = dataclasses.replace(r, deadline_hit=True)
    assert "the wall-clock deadline ended the plan early" in plan_table(late)


def test_pruning_never_drops_the_winner(tiny_plans):
    a, b = tiny_plans["w1"], tiny_plans["noprune"]
    assert b.counts["pruned"] == 0 and b.counts["unsolved_budget"] == 0
    assert (a.recommendation.key, a.recommendation.variant) == (b.recommendation.key, b.recommendation.variant)
    assert a.recommendation.figures == b.recommendation.figures
    # and every pruned item's bound is below the best the unpruned plan found
    assert a.counts["solved"] <= b.counts["solved"]


def test_bounds_hold_for_every_solved_row(tiny_plans):
    for row in tiny_plans["noprune"].rows:
        assert row.job_tokens_per_s <= row.bound_tokens_per_s * (1 + 1e-9)


def test_plan_beats_or_matches_the_segment_rule_and_the_default(tiny_plans):
    r = tiny_plans["noprune"]
    rec = r.recommendation.job_tokens_per_s
    assert r.segment is not None and r.best("default") is not None
    assert rec >= r.segment.job_tokens_per_s and rec >= r.best("default").job_tokens_per_s
    assert r.rows == tuple(sorted(r.rows, key=lambda x: -x.job_tokens_per_s))


def test_segment_rule_puts_every_ep_group_in_one_rack(tiny_plans):
    r = tiny_plans["noprune"]
    job, cluster = tiny_plans["job"], tiny_plans["cluster"]
    for row in r.rows:
        if not row.variant.startswith("segment"):
            continue
        from placement.plan.evaluate import build_instance
        from placement.plan.planner import base_routing

        fit, held, _ = base_routing(job)
        inst = build_instance(job, cluster.cluster, row.candidate, fit, held)
        r2g = segment_rank2gpu(inst)
        doms = inst.cluster.gpu2domain[r2g][inst.parallel.stage_ep_groups]
        assert (doms.min(axis=-1) == doms.max(axis=-1)).all()


def test_load_lower_bound_against_brute_force_and_the_evaluator(tiny):
    """The bound is at most the best balanced assignment (brute force over every map of 6 experts
    to 3 ranks x 2 slots) and at most the evaluator's load of random maps on tiny."""
    from placement.predict.cost import evaluate
    from placement.core.model import Placement

    rng = np.random.default_rng(3)
    for _ in range(20):
        counts = rng.integers(0, 50, size=6)
        topk = np.repeat(np.arange(6), counts).reshape(1, 1, -1, 1).astype(np.uint16)
        lb = load_lower_bound(topk, 6, 3)[0]
        best = min(max(counts[list(p[2 * r: 2 * r + 2])].sum() for r in range(3))
                   for p in itertools.permutations(range(6)))
        assert lb <= best * 3 / counts.sum() + 1e-12
    lb = load_lower_bound(tiny.routing.topk, tiny.model.num_experts, tiny.parallel.ep)
    for _ in range(30):
        phy2log = np.stack([rng.permutation(16) for _ in range(tiny.model.num_moe_layers)])
        m = evaluate(tiny, Placement(np.flatnonzero(tiny.cluster.available)[: tiny.parallel.world_size], phy2log))
        assert all(a <= b + 1e-12 for a, b in zip(lb, m.expert_load_max_over_mean_per_layer))


def test_bound_is_the_compute_bound_step(files):
    job = read_job(files[0])
    c = enumerate_candidates(job, 18, 1e12, SMALL, min_tokens=256)[0].feasible[0]
    from placement.plan.evaluate import build_instance
    from placement.plan.planner import base_routing

    fit, held, _ = base_routing(job)
    inst = build_instance(job, read_cluster(files[1]).cluster, c, fit, held)
    L = job.model.num_moe_layers
    pred = StepTimeModel(inst).predict(np.zeros(L), np.ones(L), None, communication=False)
    assert compute_bound_step_s(job, c) == pytest.approx(pred.compute_bound_step_time_s, rel=1e-12)
    assert tokens_per_s_bound(job, c) == pytest.approx(job.tokens_per_step / pred.compute_bound_step_time_s, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# CLI: files, exit codes
# ---------------------------------------------------------------------------------------------
def test_cli_writes_plan_placement_and_picture(files, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["plan", str(files[0]), "--cluster", str(files[1]), "--candidates", "tp=1 pp=1,2 vpp=1 ep=4,8 dp=4,8 mb=1",
               "--time-limit", "60", "--workers", "1", "-o", str(out), "--export", f"slurm={tmp_path / 'job.hosts'}"])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "recommendation:" in text
    doc = json.loads(out.read_text())
    assert doc["kind"] == "plan" and doc["recommendation"]["key"] in text
    inst = tmp_path / "p.instance.json"
    pl = tmp_path / "p.placement.json"
    assert inst.exists() and pl.exists() and (tmp_path / "job.hosts").exists()
    assert main(["verify", str(inst), str(pl)]) == 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_json_has_stable_keys(files, capsys):
    rc = main(["plan", str(files[0]), "--cluster", str(files[1]), "--candidates", "tp=1 pp=1 vpp=1 ep=8 dp=8 mb=1",
               "--time-limit", "30", "--workers", "1", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == sorted(doc)
    assert {"counts", "recommendation", "peers", "rows", "ranking_by_job_tokens_per_s", "ranking_by_tokens_per_s_per_gpu"} <= set(doc)


@pytest.mark.parametrize("what,edit,field", [
    ("job", lambda d: d.pop("batch"), "batch"),
    ("job", lambda d: d["batch"].update(micro_batch=[]), "batch.micro_batch"),
    ("job", lambda d: d["model"].update(num_groups=3), "model.num_groups"),
    ("job", lambda d: d.update(routing={}), "routing"),
    ("job", lambda d: d.update(routing={"generator": {"seed": 1, "num_sources": 2}}), "routing.generator.tokens_per_source"),
    ("job", lambda d: d.update(routing={"generator": {"seed": 1, "num_sources": 2, "tokens_per_source": 8,
                                                      "topic_strength": -1}}), "routing.generator.topic_strength"),
    ("job", lambda d: d["training"].update(recompute="most") if "training" in d else d.update(training={"recompute": "most"}), "training.recompute"),
    ("cluster", lambda d: d.pop("gpu_hbm_gb"), "gpu_hbm_gb"),
    ("cluster", lambda d: d.update(unavailable_trays=[[9, 0]]), "unavailable_trays[0]"),
    ("cluster", lambda d: d.update(hbm_reserve_gb=2.0), "hbm_reserve_gb"),
])
def test_malformed_files_exit_2_naming_the_field(tmp_path, capsys, what, edit, field):
    job, cl = _job_doc(), _cluster_doc()
    edit(job if what == "job" else cl)
    jp, cp = _write(tmp_path, "job.json", job), _write(tmp_path, "cluster.json", cl)
    rc = main(["plan", str(jp), "--cluster", str(cp), "--time-limit", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and field in err and (str(jp) if what == "job" else str(cp)) in err


def test_too_few_gpus_exits_3(tmp_path, capsys):
    trays = [[d, t] for d in range(5) for t in range(2) if (d, t) not in ((0, 0),)]
    cp = _write(tmp_path, "cluster.json", _cluster_doc(unavailable_trays=trays))  # 2 GPUs free
    jp = _write(tmp_path, "job.json", _job_doc())
    rc = main(["plan", str(jp), "--cluster", str(cp), "--candidates", "ep=4,8,16 tp=1 cp=1 pp=1,2", "--time-limit", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "fewer than the smallest layout" in err and "needs 4" in err and len(err.splitlines()) == 1


def test_model_that_fits_no_memory_exits_3(tmp_path, capsys):
    cp = _write(tmp_path, "cluster.json", _cluster_doc(gpu_hbm_gb=0.001))
    jp = _write(tmp_path, "job.json", _job_doc())
    rc = main(["plan", str(jp), "--cluster", str(cp), "--time-limit", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "fits no candidate's memory" in err and len(err.splitlines()) == 1


def test_plan_api_errors(files):
    job, cluster = read_job(files[0]), read_cluster(files[1])
    for kw in ({"time_limit_s": 0}, {"time_limit_s": math.inf}, {"seed": -1}, {"lanes": 0}):
        with pytest.raises(InvalidInputError):
            plan(job, cluster, candidates=SMALL, **kw)
    with pytest.raises(InfeasibleError):
        plan(job, dataclasses.replace(cluster, gpu_hbm_gb=1e-4, hbm_reserve_gb=0.0), candidates=SMALL)


def test_committed_job_and_cluster_read():
    job = read_job(INSTANCES / "dsv3_job.json")
    cl = read_cluster(INSTANCES / "dsv3_1024_cluster.json")
    inst = placement.load_instance(INSTANCES / "dsv3_1024.json")
    assert cl.free_gpus == 1024 and np.array_equal(cl.cluster.available, inst.cluster.available)
    assert job.model == inst.model and job.global_batch == 8192 and job.seq_len == 4096
    assert job.performance == dataclasses.replace(inst.performance, vpp=1)
    assert job.routing.params["seed"] == inst.extra["generator"]["seed"]


# ---------------------------------------------------------------------------------------------
# Executors
# ---------------------------------------------------------------------------------------------
def _square(x: int) -> int:
    return x * x


def test_local_executor_keeps_order():
    for w in (1, 2):
        with LocalExecutor(w) as ex:
            assert ex.map(_square, list(range(7))) == [x * x for x in range(7)]
            assert ex.map(_square, []) == []


def test_make_executor_errors():
    with pytest.raises(InvalidInputError, match="executor"):
        make_executor("dask")
    with pytest.raises(InvalidInputError, match="workers"):
        make_executor("local", workers=0)
    with pytest.raises(InvalidInputError, match="address"):
        make_executor("local", address="ray://x:1")
    ex = make_executor("local", workers=1)
    assert isinstance(ex, LocalExecutor)
    ex.close()


@pytest.mark.parametrize("trays_down", [[[0, 1], [2, 0]], [[1, 0], [1, 1], [4, 1]]])
def test_pruning_never_drops_the_winner_on_other_cluster_states(tmp_path, trays_down):
    """Brute force on two more tiny cluster states: the plan with pruning = the plan without."""
    job = read_job(_write(tmp_path, "job.json", _job_doc()))
    cluster = read_cluster(_write(tmp_path, "cluster.json", _cluster_doc(unavailable_trays=trays_down)))
    space = CandidateSpace(tp=(1,), cp=(1,), pp=(1, 2), vpp=(1, 2), ep=(2, 4, 8), dp=(2, 4, 8), micro_batch=(1,))
    with LocalExecutor(1) as ex:
        a = plan(job, cluster, candidates=space, time_limit_s=300, executor=ex)
        b = plan(job, cluster, candidates=space, time_limit_s=3000, executor=ex, prune=False)
    assert b.counts["pruned"] == 0 and b.counts["unsolved_budget"] == 0
    assert (a.recommendation.key, a.recommendation.variant) == (b.recommendation.key, b.recommendation.variant)
    assert a.recommendation.figures == b.recommendation.figures


def test_ray_executor_is_optional():
    """Without the ray extra (or h2's placement.core.ray_executor), ``ray`` is a one-line input error."""
    try:
        import placement.core.ray_executor  # noqa: F401
    except ImportError:
        with pytest.raises(InvalidInputError, match="ray"):
            make_executor("ray", workers=1)
    else:
        pytest.skip("placement.core.ray_executor is installed: its own tests cover it")


def test_plan_from_an_in_memory_instance(tiny, tiny_plans):
    """What a notebook does: job and cluster from an instance, its routing passed as arrays."""
    from placement.formats.job import cluster_from_instance, job_from_instance

    job = dataclasses.replace(job_from_instance(tiny), name="tiny_job")
    cluster = dataclasses.replace(cluster_from_instance(tiny, gpu_hbm_gb=1.0, hbm_reserve_gb=0.0), name="tiny_cluster")
    with LocalExecutor(1) as ex:
        r = plan(job, cluster, candidates=SMALL, time_limit_s=120, executor=ex,
                 routing=(tiny.routing.topk, tiny.routing.heldout_topk))
    want = tiny_plans["w1"]
    assert (r.recommendation.key, r.recommendation.variant) == (want.recommendation.key, want.recommendation.variant)
    assert r.recommendation.figures == want.recommendation.figures


def test_a_job_may_ask_for_the_generator_fitted_to_trained_routing(tmp_path):
    """``routing.generator`` takes every ``generate_routing`` argument, ``TRAINED_MODEL_PARAMS``'
    ``topic_strength`` included, and the plan's routing is that generator's output."""
    from placement.sources.generator import TRAINED_MODEL_PARAMS, generate_routing

    gen = {"seed": 3, "num_sources": 4, "tokens_per_source": 8, **TRAINED_MODEL_PARAMS}
    job = read_job(_write(tmp_path, "job.json", _job_doc(routing={"generator": gen})))
    assert job.routing.kind == "generator" and job.routing.params["topic_strength"] == TRAINED_MODEL_PARAMS["topic_strength"]
    w = generate_routing(**job.routing.params)
    assert not np.array_equal(w, generate_routing(**{**job.routing.params, "topic_strength": 2.5}))
