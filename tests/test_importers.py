"""Importers of recorded routing: Megatron JSONL traces, SGLang per_token dumps, vLLM captures.

Traces are written here by hand from known routing (an implementation of the format independent of
the importers), so every imported id can be checked against what was "recorded".  The real stacks'
own code runs in tests/test_importers_stacks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement.cli import main
from placement.formats import read_instance
from placement.sources.importers import ImportOptions, build_routing, import_instance
from placement.core.model import InvalidInputError

E, K = 8, 2
MODEL = {
    "name": "toy", "num_layers": 4, "moe_layers": [1, 2, 3], "num_experts": E, "top_k": K, "num_groups": 1,
    "groups_per_token": 1, "hidden_size": 128, "dispatch_bytes_per_token": 132, "combine_bytes_per_token": 256,
}
# tp1 cp1 dp2 pp2, order tp-cp-ep-dp-pp: rank = dp + 2 * pp; stage 0 holds layers 0 (dense), 1.
PARALLEL = {
    "tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 2, "order": "tp-cp-ep-dp-pp", "stage_layers": [[0, 1], [2, 3]],
    "seq_len": 16, "micro_batch": 1, "global_batch": 4,
}
CLUSTER = {"num_domains": 2, "trays_per_domain": 1, "gpus_per_tray": 2, "nvlink_gbps": 900.0, "scaleout_gbps": 100.0}


def _sections(tmp_path: Path, model: dict = MODEL, parallel: dict = PARALLEL) -> dict[str, str]:
    out = {}
    for key, doc in (("model", model), ("parallel", parallel), ("cluster", CLUSTER)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(doc))
        out[key] = str(path)
    return out


def _solves(inst) -> None:
    import placement

    result = placement.solve(inst, time_limit_s=20, seed=0, num_workers=1)
    assert placement.check_placement(inst, result.placement) == []


def _routing(rng: np.random.Generator, steps: int, micro: int, tokens: int, dp: int = 2, layers: int = 3) -> np.ndarray:
    """(steps, micro, layers, dp, tokens, K) distinct expert ids."""
    return np.sort(rng.random((steps, micro, layers, dp, tokens, E)).argsort(axis=-1)[..., :K], axis=-1)


def _write_megatron(folder: Path, ids: np.ndarray, parallel: dict = PARALLEL, model: dict = MODEL) -> list[str]:
    """Megatron-LM router_trace_rank{r}.jsonl files of ``ids`` (steps, micro, moe layers, dp, T, K)."""
    steps, micro, _, dp, _, _ = ids.shape
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for pp, layers in enumerate(parallel["stage_layers"]):
        for d in range(dp):
            rank = d + dp * pp
            lines = []
            for s in range(steps):
                for mb in range(micro):
                    for local, layer in enumerate(layers):
                        if layer not in model["moe_layers"]:
                            continue
                        top = ids[s, mb, model["moe_layers"].index(layer), d]
                        lines.append(json.dumps({
                            "step": s, "stage": "pre_dispatch", "block": "decoder", "layer": local, "rank": rank,
                            "num_tokens": int(top.shape[0]), "topk": K, "top_indices": top.tolist(),
                        }))
                if s == 0:  # an MTP head's record, skipped by the reader
                    lines.append(json.dumps({"step": s, "stage": "pre_dispatch", "block": "mtp", "mtp_idx": 0,
                                             "layer": 0, "rank": rank, "num_tokens": 1, "topk": K,
                                             "top_indices": [[0, 1]]}))
            path = folder / f"router_trace_rank{rank}.jsonl"
            path.write_text("\n".join(lines) + "\n")
            paths.append(str(path))
    return paths


def _expected(ids: np.ndarray, steps: list[int]) -> np.ndarray:
    """(layers, dp, tokens, K): the recorded stream of ``steps``, micro-batches in order."""
    sel = ids[steps]  # (s, micro, L, dp, T, K)
    s, m, L, dp, T, k = sel.shape
    return sel.transpose(2, 3, 0, 1, 4, 5).reshape(L, dp, s * m * T, k)


def test_megatron_traces_import_exactly(tmp_path):
    ids = _routing(np.random.default_rng(1), steps=4, micro=2, tokens=5)
    paths = _write_megatron(tmp_path / "traces", ids)
    inst = import_instance("megatron", paths, **_sections(tmp_path), name="toy-import")
    assert inst.routing.topk.shape == (3, 2, 3 * 2 * 5, K)
    np.testing.assert_array_equal(inst.routing.topk, _expected(ids, [0, 1, 2]))
    np.testing.assert_array_equal(inst.routing.heldout_topk, _expected(ids, [3]))
    gen = inst.extra["generator"]
    assert gen["windows"]["fit"]["steps"] == [0, 1, 2] and gen["windows"]["heldout"]["steps"] == [3]
    assert gen["importer"] == "megatron" and len(gen["files"]) == 4


def test_megatron_cap_keeps_even_positions_and_token_identity(tmp_path):
    ids = _routing(np.random.default_rng(2), steps=4, micro=1, tokens=8)
    paths = _write_megatron(tmp_path / "traces", ids)
    inst = import_instance("megatron", paths, **_sections(tmp_path), heldout_steps=2, max_tokens_per_source=5)
    full = _expected(ids, [0, 1])  # 16 tokens per source
    pos = (np.arange(5) * 16) // 5
    np.testing.assert_array_equal(inst.routing.topk, full[:, :, pos])
    np.testing.assert_array_equal(inst.routing.heldout_topk, _expected(ids, [2, 3])[:, :, pos])


def test_sources_are_equalised_to_the_smallest(tmp_path):
    ids = _routing(np.random.default_rng(3), steps=2, micro=1, tokens=6)
    paths = _write_megatron(tmp_path / "traces", ids)
    # rank 1 (dp 1, stage 0) and rank 3 (dp 1, stage 1): drop the last 2 tokens of step 0 everywhere
    for rank in (1, 3):
        p = tmp_path / "traces" / f"router_trace_rank{rank}.jsonl"
        recs = [json.loads(x) for x in p.read_text().splitlines()]
        for r in recs:
            if r["step"] == 0 and r["block"] == "decoder":
                r["top_indices"] = r["top_indices"][:4]
                r["num_tokens"] = 4
        p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    inst = import_instance("megatron", paths, **_sections(tmp_path))
    assert inst.routing.topk.shape[2] == 4
    # source 0 recorded 6 tokens: 4 evenly spaced ones are kept; source 1 keeps its 4
    np.testing.assert_array_equal(inst.routing.topk[:, 0], _expected(ids, [0])[:, 0, [0, 1, 3, 4]])
    np.testing.assert_array_equal(inst.routing.topk[:, 1], _expected(ids, [0])[:, 1, :4])
    assert inst.extra["generator"]["windows"]["fit"]["tokens_recorded_per_source"] == [6, 4]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), steps=st.integers(2, 5), micro=st.integers(1, 3), tokens=st.integers(1, 4))
def test_roundtrip_property(tmp_path_factory, seed, steps, micro, tokens):
    tmp = tmp_path_factory.mktemp("rt")
    ids = _routing(np.random.default_rng(seed), steps=steps, micro=micro, tokens=tokens)
    inst = import_instance("megatron", _write_megatron(tmp / "t", ids), **_sections(tmp), max_tokens_per_source=10**6)
    held = max(1, steps // 4)
    np.testing.assert_array_equal(inst.routing.topk, _expected(ids, list(range(steps - held))))
    np.testing.assert_array_equal(inst.routing.heldout_topk, _expected(ids, list(range(steps - held, steps))))


def test_tensor_parallel_duplicates_are_dropped_and_order_string_is_used(tmp_path):
    # tp2 dp2 pp1, order dp-tp-cp-ep-pp (dp fastest): rank = dp + 2 * tp; tp-1 ranks duplicate tokens.
    par = dict(PARALLEL, tp=2, pp=1, ep=2, order="dp-tp-cp-ep-pp", stage_layers=[[0, 1, 2, 3]], global_batch=4)
    ids = _routing(np.random.default_rng(4), steps=2, micro=1, tokens=3)
    folder = tmp_path / "t"
    folder.mkdir()
    paths = []
    for rank in range(4):
        d, tp = rank % 2, rank // 2
        rows = ids if tp == 0 else (ids + 1) % E  # tp-1 records differ: they must not be used
        recs = [json.dumps({"step": s, "layer": layer, "rank": rank, "top_indices": rows[s, 0, i, d].tolist()})
                for s in range(2) for i, layer in enumerate(MODEL["moe_layers"])]
        p = folder / f"router_trace_rank{rank}.jsonl"
        p.write_text("\n".join(recs) + "\n")
        paths.append(str(p))
    inst = import_instance("megatron", paths, **_sections(tmp_path, parallel=par))
    np.testing.assert_array_equal(inst.routing.topk, _expected(ids, [0]))
    assert inst.extra["generator"]["router_calls_skipped_tensor_parallel_duplicates"] == 2 * 3 * 2


def test_cli_import_then_solve_and_stats(tmp_path, capsys):
    ids = _routing(np.random.default_rng(5), steps=4, micro=2, tokens=6)
    paths = _write_megatron(tmp_path / "traces", ids)
    sec = _sections(tmp_path)
    out = tmp_path / "imported.json"
    rc = main(["import", "--from", "megatron", *paths, "--model", sec["model"], "--parallel", sec["parallel"],
               "--cluster", sec["cluster"], "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    inst = read_instance(out)
    np.testing.assert_array_equal(inst.routing.topk, _expected(ids, [0, 1, 2]))
    # a second import gives byte-identical files
    first = (out.read_bytes(), out.with_suffix(".npz").read_bytes())
    assert main(["import", "--from", "megatron", *reversed(paths), "--model", sec["model"], "--parallel",
                 sec["parallel"], "--cluster", sec["cluster"], "-o", str(out)]) == 0
    assert (out.read_bytes(), out.with_suffix(".npz").read_bytes()) == first
    capsys.readouterr()
    assert main(["solve", str(out), "--time-limit", "20", "-o", str(tmp_path / "p.json"), "--workers", "1"]) == 0
    assert main(["verify", str(out), str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokens_per_source"] == {"fit": 36, "heldout": 12}
    assert main(["stats", str(out)]) == 0
    assert "source difference" in capsys.readouterr().out


def test_stats_against_another_instance_is_the_drift(capsys):
    from placement import stats

    root = Path(__file__).resolve().parent.parent / "instances"
    a, b = read_instance(root / "real_ep64.json"), read_instance(root / "real_ep64_c10.json")
    assert main(["stats", str(root / "real_ep64.json"), "--against", str(root / "real_ep64_c10.json"), "--json"]) == 0
    drift = json.loads(capsys.readouterr().out)["drift"]
    E = a.model.num_experts
    assert drift["load_tv"] == pytest.approx(stats.load_tv(a.routing.topk, b.routing.topk, E).tolist())
    assert drift["partner_overlap"] == pytest.approx(stats.partner_overlap(a.routing.topk, b.routing.topk, E).tolist())
    self_drift = stats.routing_drift(a, a)["summary"]
    assert self_drift == {"load_tv": 0.0, "partner_overlap": 1.0}
    # another shape: one line naming the file, exit 2
    assert main(["stats", str(root / "real_ep64.json"), "--against", str(root / "tiny.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tiny.json" in err and "\n" not in err


def test_base_instance_gives_the_sections(tmp_path):
    root = Path(__file__).resolve().parent.parent
    base = json.loads((root / "instances" / "tiny.json").read_text())
    m, p = base["model"], base["parallel"]
    rng = np.random.default_rng(6)
    folder = tmp_path / "t"
    folder.mkdir()
    paths = []
    world = p["tp"] * p["cp"] * p["dp"] * p["pp"]
    E_, K_, G = m["num_experts"], m["top_k"], m["num_groups"]
    per = E_ // G
    for rank in range(world):
        d, pp = rank % p["dp"], rank // p["dp"]
        recs = []
        for s in range(3):
            for local, layer in enumerate(p["stage_layers"][pp]):
                if layer not in m["moe_layers"]:
                    continue
                groups = np.sort(rng.random((4, G)).argsort(axis=1)[:, :2], axis=1)  # 2 groups per token
                top = (groups[:, :, None] * per + np.arange(per)[None, None, :]).reshape(4, -1)[:, :K_]
                recs.append(json.dumps({"step": s, "layer": local, "rank": rank, "top_indices": top.tolist()}))
        path = folder / f"router_trace_rank{rank}.jsonl"
        path.write_text("\n".join(recs) + "\n")
        paths.append(str(path))
    out = tmp_path / "x.json"
    assert main(["import", "--from", "torchtitan", *paths, "--base", str(root / "instances" / "tiny.json"),
                 "--name", "tiny-real", "-o", str(out)]) == 0
    inst = read_instance(out)
    assert inst.name == "tiny-real" and inst.parallel.stage_layers == ((0, 1), (2, 3))
    assert inst.routing.topk.shape == (3, 8, 8, 4) and inst.routing.heldout_topk.shape == (3, 8, 4, 4)


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the file and record, nothing written.
# ---------------------------------------------------------------------------------------------
def _bad_case(tmp_path: Path, name: str) -> tuple[list[str], str]:
    ids = _routing(np.random.default_rng(7), steps=3, micro=1, tokens=3)
    paths = _write_megatron(tmp_path / "traces", ids)
    target = Path(paths[0])  # rank 0
    lines = target.read_text().splitlines()
    if name == "truncated":
        text = target.read_text()
        target.write_text(text[: len(text) - 15])
        return paths, f"{target}: record {len(lines)}"
    rec = json.loads(lines[0])
    if name == "malformed":
        lines[0] = lines[0].replace(",", ";", 1)
    elif name == "id_out_of_range":
        rec["top_indices"][0][0] = E + 3
        lines[0] = json.dumps(rec)
    elif name == "negative_id":
        rec["top_indices"][0][0] = -1
        lines[0] = json.dumps(rec)
    elif name == "repeated_expert":
        rec["top_indices"][0] = [3, 3]
        lines[0] = json.dumps(rec)
    elif name == "rank_outside_layout":
        rec["rank"] = 9
        lines[0] = json.dumps(rec)
        p9 = target.with_name("router_trace_rank9.jsonl")
        p9.write_text(lines[0] + "\n")
        del lines[0]
        target.write_text("\n".join(lines) + "\n")
        return paths + [str(p9)], f"{p9}: record 1"
    elif name == "layer_not_in_stage":
        rec["layer"] = 5
        lines[0] = json.dumps(rec)
    elif name == "dense_layer":
        rec["layer"] = 0  # stage 0's layer 0 is dense
        lines[0] = json.dumps(rec)
    elif name == "mixed_layer_sets":
        # step 1 of rank 0 loses its only MoE layer record: stage 0's layer 1 is missing there
        lines = [x for x in lines if not (json.loads(x)["step"] == 1 and json.loads(x)["block"] == "decoder")]
        target.write_text("\n".join(lines) + "\n")
        return paths, "step 1 of data-parallel rank 0 has records of 2 of the 3 MoE layers, none of layer 1 (expected from rank 0, stage 0)"
    elif name == "token_count_mismatch":
        rec["top_indices"] = rec["top_indices"][:2]
        rec["num_tokens"] = 2
        lines[0] = json.dumps(rec)
    elif name == "num_tokens_disagrees":
        rec["num_tokens"] = 7
        lines[0] = json.dumps(rec)
    elif name == "wrong_top_k":
        rec["top_indices"] = [r + [7] for r in rec["top_indices"]]
        lines[0] = json.dumps(rec)
    elif name == "rank_not_the_file_name":
        rec["rank"] = 2
        lines[0] = json.dumps(rec)
    target.write_text("\n".join(lines) + "\n")
    return paths, f"{target}: record"


BAD = ["truncated", "malformed", "id_out_of_range", "negative_id", "repeated_expert", "rank_outside_layout",
       "layer_not_in_stage", "dense_layer", "mixed_layer_sets", "token_count_mismatch", "num_tokens_disagrees",
       "wrong_top_k", "rank_not_the_file_name"]


@pytest.mark.parametrize("case", BAD)
def test_bad_traces_exit_2_naming_file_and_record(tmp_path, capsys, case):
    paths, where = _bad_case(tmp_path, case)
    sec = _sections(tmp_path)
    out = tmp_path / "out.json"
    rc = main(["import", "--from", "megatron", *paths, "--model", sec["model"], "--parallel", sec["parallel"],
               "--cluster", sec["cluster"], "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("placement: error: ")
    assert where in err, err
    assert not out.exists() and not out.with_suffix(".npz").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))] == []


def test_bad_sections_name_their_file(tmp_path, capsys):
    ids = _routing(np.random.default_rng(8), steps=2, micro=1, tokens=2)
    paths = _write_megatron(tmp_path / "t", ids)
    sec = _sections(tmp_path, parallel=dict(PARALLEL, dp="two"))
    rc = main(["import", "--from", "megatron", *paths, "--model", sec["model"], "--parallel", sec["parallel"],
               "--cluster", sec["cluster"], "-o", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{sec['parallel']}: parallel.dp" in err
    rc = main(["import", "--from", "megatron", *paths, "--model", sec["model"], "-o", str(tmp_path / "o.json")])
    assert rc == 2 and "--parallel: required" in capsys.readouterr().err


def test_one_step_is_refused(tmp_path):
    ids = _routing(np.random.default_rng(9), steps=1, micro=1, tokens=2)
    with pytest.raises(InvalidInputError, match="at least 2 are needed"):
        import_instance("megatron", _write_megatron(tmp_path / "t", ids), **_sections(tmp_path))


def test_missing_source_is_refused(tmp_path):
    ids = _routing(np.random.default_rng(10), steps=2, micro=1, tokens=2)
    paths = [p for p in _write_megatron(tmp_path / "t", ids) if not p.endswith(("rank1.jsonl", "rank3.jsonl"))]
    with pytest.raises(InvalidInputError, match="no records from data-parallel ranks 1"):
        import_instance("megatron", paths, **_sections(tmp_path))


def test_counts_only_inputs_are_refused(tmp_path, capsys):
    sec = _sections(tmp_path)
    counts = tmp_path / "tokens_per_expert.pt"
    counts.write_bytes(b"\0")
    rc = main(["import", "--from", "torchtitan", str(counts), "--model", sec["model"], "--parallel", sec["parallel"],
               "--cluster", sec["cluster"], "-o", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "per-token ids" in err and "tokens_per_expert" in err
    load = tmp_path / "eplb.npz"
    np.savez(load, expert_load_window=np.zeros((4, 3, E)))
    rc = main(["import", "--from", "vllm", str(load), "--model", sec["model"], "--parallel", sec["parallel"],
               "--cluster", sec["cluster"], "-o", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "per-token ids" in err and str(load) in err


# ---------------------------------------------------------------------------------------------
# vLLM captures (the format vLLM's CompletionOutput.routed_experts gives, saved by our writer)
# ---------------------------------------------------------------------------------------------
class _Completion:
    """Stands in for vllm.outputs.CompletionOutput: routed_experts is [seq_len, layer_num, topk]."""

    def __init__(self, routed: np.ndarray) -> None:
        self.routed_experts = routed


class _RequestOutput:
    def __init__(self, routed: np.ndarray) -> None:
        self.outputs = [_Completion(routed)]


def test_vllm_captures_import(tmp_path):
    from placement.sources.importers.vllm import save_routed_experts

    rng = np.random.default_rng(11)
    par = dict(PARALLEL, pp=1, stage_layers=[[0, 1, 2, 3]], ep=2)
    paths, recorded = [], {}
    for d, n_requests in ((0, 4), (1, 5)):  # DP ranks serve different numbers of requests
        reqs = []
        for r in range(n_requests):
            tokens = int(rng.integers(2, 5))
            a = np.zeros((tokens, MODEL["num_layers"], K), dtype=np.int32)  # dense layer 0 stays 0
            a[:, 1:] = np.sort(rng.random((tokens, 3, E)).argsort(axis=-1)[..., :K], axis=-1)
            reqs.append(a)
        recorded[d] = reqs
        path = tmp_path / f"vllm_dp{d}.npz"
        assert save_routed_experts(path, d, [_RequestOutput(a) for a in reqs]) == n_requests
        paths.append(str(path))
    inst = import_instance("vllm", paths, **_sections(tmp_path, parallel=par), max_tokens_per_source=10**6)
    windows = inst.extra["generator"]["windows"]
    assert windows["heldout"]["steps"] == [[3], [4]]
    for d in (0, 1):
        fit = np.concatenate(recorded[d][: len(recorded[d]) - 1])[:, 1:]  # (tokens, 3 layers, K)
        n = inst.routing.topk.shape[2]
        pos = (np.arange(n) * fit.shape[0]) // n
        np.testing.assert_array_equal(inst.routing.topk[:, d], fit[pos].transpose(1, 0, 2))
    _solves(inst)


def test_vllm_physical_map_and_padding(tmp_path):
    par = dict(PARALLEL, pp=1, dp=1, ep=1, stage_layers=[[0, 1, 2, 3]], global_batch=2)
    phys = np.array([[[0, 9], [3, 4], [1, 2], [5, 6]]] * 3, dtype=np.int64)  # (req tokens, layers, K)
    a = np.zeros((3, 4, K), dtype=np.int64)
    a[:, 1:] = [[0, 9], [3, 4], [1, 2]]
    a[1, 2] = [-1, -1]  # padding token: dropped at every layer
    p2l = np.tile(np.arange(10) % E, (4, 1))  # 10 physical experts, 2 redundant
    path = tmp_path / "cap.npz"
    np.savez(path, dp_rank=np.array(0), request_000000=a, request_000001=a, physical_to_logical_map=p2l)
    inst = import_instance("vllm", [str(path)], **_sections(tmp_path, parallel=par))
    assert inst.routing.topk.shape == (3, 1, 2, K)
    np.testing.assert_array_equal(inst.routing.topk[:, 0, 0], [[0, 1], [3, 4], [1, 2]])
    _ = phys


# ---------------------------------------------------------------------------------------------
# SGLang per_token dumps (fixtures with the schema of sglang/srt/eplb/expert_distribution.py)
# ---------------------------------------------------------------------------------------------
def _sglang_dump(path: Path, records: list[dict], p2l: np.ndarray) -> None:
    """What _DetailAccumulator.dump writes: torch.save({"records", "last_physical_to_logical_map"})."""
    torch = pytest.importorskip("torch")
    out = []
    for r in records:
        n = r["ids"].shape[1]
        out.append({
            "forward_pass_id": r["fp"], "rank": r["rank"], "gatherer_key": "primary",
            "input_ids": list(range(n)), "positions": list(range(n)), "extend_seq_lens": [n], "forward_mode": 1,
            "topk_ids_of_layer": torch.tensor(r["ids"], dtype=torch.int32), "misc_objects": [],
            "global_physical_count": torch.zeros((r["ids"].shape[0], p2l.shape[1]), dtype=torch.int32),
        })
    torch.save({"records": out, "last_physical_to_logical_map": torch.tensor(p2l)}, str(path))


def test_sglang_per_token_dump_imports(tmp_path):
    pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    num_physical = 10  # 2 redundant physical experts
    p2l = np.stack([rng.permutation(np.r_[np.arange(E), rng.integers(0, E, 2)]) for _ in range(4)])
    par = dict(PARALLEL, pp=1, stage_layers=[[0, 1, 2, 3]], order="tp-cp-ep-dp-pp")
    expected: dict[int, list[np.ndarray]] = {0: [], 1: []}
    paths = []
    for rank in (0, 1):  # dp attention: each rank is a data-parallel source
        recs = []
        for fp in range(4):
            n = 3
            ids = -np.ones((4, n, 8), dtype=np.int64)  # 8 columns, -1 beyond top_k and in dense layer 0
            logical = np.empty((n, 3, K), dtype=np.int64)
            for j, layer in enumerate((1, 2, 3)):
                for t in range(n):
                    # pick K physical slots holding distinct logical experts
                    order = rng.permutation(num_physical)
                    chosen, seen = [], set()
                    for ph in order:
                        if p2l[layer, ph] not in seen:
                            chosen.append(ph)
                            seen.add(int(p2l[layer, ph]))
                        if len(chosen) == K:
                            break
                    ids[layer, t, :K] = chosen
                    logical[t, j] = p2l[layer, chosen]
            if fp == 1:
                ids[2, 0, :K] = -1  # a padding token at one MoE layer: dropped everywhere
                logical = logical[1:]
            expected[rank].append(logical)
            recs.append({"fp": fp, "rank": rank, "ids": ids})
        path = tmp_path / f"expert_distribution_recorder_1700000000.0_{rank}.pt"
        _sglang_dump(path, recs, p2l)
        paths.append(str(path))
    inst = import_instance("sglang", paths, **_sections(tmp_path, parallel=par), max_tokens_per_source=10**6)
    assert inst.routing.topk.shape == (3, 2, 8, K)
    for rank in (0, 1):
        np.testing.assert_array_equal(inst.routing.topk[:, rank], np.concatenate(expected[rank][:3]).transpose(1, 0, 2))
        np.testing.assert_array_equal(inst.routing.heldout_topk[:, rank], expected[rank][3].transpose(1, 0, 2))
    _solves(inst)


def test_sglang_stat_dump_and_bad_ids_refused(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    par = dict(PARALLEL, pp=1, stage_layers=[[0, 1, 2, 3]])
    sec = _sections(tmp_path, parallel=par)
    stat = tmp_path / "expert_distribution_recorder_1.0.pt"
    torch.save({"rank": 0, "logical_count": torch.zeros((5, 4, E))}, str(stat))
    argv = ["--model", sec["model"], "--parallel", sec["parallel"], "--cluster", sec["cluster"], "-o", str(tmp_path / "o.json")]
    assert main(["import", "--from", "sglang", str(stat), *argv]) == 2
    assert "per_token" in capsys.readouterr().err
    ids = -np.ones((4, 2, 8), dtype=np.int64)
    ids[1:, :, :K] = [[0, 1], [2, 3]]
    ids[2, 1, 0] = 12  # physical id beyond the map's 10 columns
    bad = tmp_path / "expert_distribution_recorder_2.0_0.pt"
    _sglang_dump(bad, [{"fp": 0, "rank": 0, "ids": ids}], np.tile(np.arange(10) % E, (4, 1)))
    assert main(["import", "--from", "sglang", str(bad), *argv]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: record 1" in err and "physical expert id 12" in err
    trunc = tmp_path / "expert_distribution_recorder_3.0_0.pt"
    trunc.write_bytes(bad.read_bytes()[:100])
    assert main(["import", "--from", "sglang", str(trunc), *argv]) == 2
    assert f"{trunc}: not a readable torch dump" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_build_routing_refuses_nothing():
    from placement.formats import read_instance as _ri

    inst = _ri(Path(__file__).resolve().parent.parent / "instances" / "tiny.json")
    with pytest.raises(InvalidInputError, match="no router records"):
        build_routing([], inst.model, inst.parallel, ImportOptions())


# ---------------------------------------------------------------------------------------------
# placement stats: against plain loops on a small random instance
# ---------------------------------------------------------------------------------------------
def test_routing_stats_against_brute_force():
    from placement import stats
    from placement.core.stats import routing_stats
    from tests.conftest import random_instance

    inst = random_instance(np.random.default_rng(13), num_experts=8, top_k=2, dp=3, tokens=7, moe_layers=3)
    st_ = routing_stats(inst)
    fit, held = inst.routing.topk, inst.routing.heldout_topk
    L, S, T, k = fit.shape
    for layer in range(L):
        counts = np.zeros(E)
        per = np.zeros((S, E))
        for s in range(S):
            for t in range(T):
                for e in fit[layer, s, t]:
                    counts[e] += 1
                    per[s, e] += 1
        assert st_["load_max_over_mean"][layer] == pytest.approx(counts.max() / counts.mean())
        assert st_["source_load_max_over_mean"][layer] == pytest.approx(np.mean(per.max(1) / per.mean(1)))
        tv = [0.5 * np.abs(per[a] / per[a].sum() - per[b] / per[b].sum()).sum() for a in range(S) for b in range(a + 1, S)]
        assert st_["source_tv"][layer] == pytest.approx(np.mean(tv))
        hc = np.bincount(held[layer].reshape(-1), minlength=E)
        assert st_["window_tv"][layer] == pytest.approx(0.5 * np.abs(counts / counts.sum() - hc / hc.sum()).sum())
    assert st_["window_partner_overlap"] == pytest.approx(stats.partner_overlap(fit, held, E).tolist())
    for layer in range(L - 1):
        pair = np.zeros((E, E))
        for s in range(S):
            for t in range(T):
                for a in fit[layer, s, t]:
                    for b in fit[layer + 1, s, t]:
                        pair[a, b] += 1
        top = max(1, E // 8)
        assert st_["coactivation"][layer] == pytest.approx(np.sort(pair, axis=1)[:, E - top:].sum() / pair.sum())
    assert st_["tokens_per_source"] == {"fit": T, "heldout": held.shape[2]}


# the per-array statistics of placement.core.stats (python -m placement.sources.realroute --stats)
def test_array_stats_against_brute_force():
    from placement import stats

    rng = np.random.default_rng(5)
    n_exp, top = 10, 3
    a = np.stack([[rng.permutation(n_exp)[:3] for _ in range(40)] for _ in range(2 * 3)]).reshape(2, 3, 40, 3)
    b = np.stack([[rng.permutation(n_exp)[:3] for _ in range(40)] for _ in range(2 * 3)]).reshape(2, 3, 40, 3)

    def cosel(layer):
        co = np.zeros((n_exp, n_exp))
        for tok in layer.reshape(-1, 3):
            for x in tok:
                for y in tok:
                    if x != y:
                        co[x, y] += 1
        return co

    for layer in range(2):
        co = cosel(a[layer])
        want = np.mean([sum(sorted(row, reverse=True)[:top]) / row.sum() for row in co if row.sum() > 0])
        assert stats.partner_share(a, n_exp, top=top)[layer] == pytest.approx(want)
        ca = np.bincount(a[layer].reshape(-1), minlength=n_exp)
        cb = np.bincount(b[layer].reshape(-1), minlength=n_exp)
        assert stats.load_max_mean(a, n_exp)[layer] == pytest.approx(ca.max() / ca.mean())
        assert stats.load_tv(a, b, n_exp)[layer] == pytest.approx(0.5 * np.abs(ca / ca.sum() - cb / cb.sum()).sum())
        cob = cosel(b[layer])
        keep = []
        for e in range(n_exp):
            pa = set(sorted(range(n_exp), key=lambda j: (-co[e, j], j))[:top])
            pb = set(sorted(range(n_exp), key=lambda j: (-cob[e, j], j))[:top])
            keep.append(len(pa & pb) / top)
        assert stats.partner_overlap(a, b, n_exp, top=top)[layer] == pytest.approx(np.mean(keep))
    # the null keeps the loads (refitted) and is deterministic under its seed
    null = stats.partner_share(a, n_exp, top=top, null=True)
    assert np.array_equal(null, stats.partner_share(a, n_exp, top=top, null=True))


def test_stats_on_constructed_routing():
    from placement import stats

    E = 16
    same = np.tile(np.array([0, 1, 2, 3]), (1, 2, 50, 1))  # every token picks experts 0..3
    assert stats.partner_share(same, E, top=3)[0] == pytest.approx(1.0)
    assert stats.source_tv(same, E)[0] == pytest.approx(0.0)
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permutation(E)[:4] for _ in range(4000)]).reshape(1, 2, 2000, 4)
    assert stats.load_max_mean(uniform, E)[0] < 1.15
    # Independent routing: the observed and the null statistic agree.
    share, null = stats.partner_share(uniform, E, top=3)[0], stats.partner_share(uniform, E, top=3, null=True)[0]
    assert abs(share - null) < 0.02
    # Two disjoint halves of the experts per source: TV 1; the shuffled null is far lower.
    split = np.stack([np.tile(np.arange(4), (100, 1)), np.tile(np.arange(8, 12), (100, 1))])[None]
    assert stats.source_tv(split, E)[0] == pytest.approx(1.0)
    assert stats.source_tv(split, E, null=True)[0] < 0.3
    assert stats.load_tv(split, split, E)[0] == 0.0
    assert stats.partner_overlap(same, same, E, top=3)[0] == 1.0


def test_vllm_bad_captures(tmp_path, capsys):
    par = dict(PARALLEL, pp=1, dp=1, ep=1, stage_layers=[[0, 1, 2, 3]], global_batch=2)
    sec = _sections(tmp_path, parallel=par)
    argv = ["--model", sec["model"], "--parallel", sec["parallel"], "--cluster", sec["cluster"], "-o", str(tmp_path / "o.json")]
    good = np.zeros((2, 4, K), dtype=np.int64)
    good[:, 1:] = [0, 1]
    cases = {
        "out_of_range": dict(dp_rank=np.array(0), request_000000=np.where(good == 1, E, good), request_000001=good),
        "wrong_shape": dict(dp_rank=np.array(0), request_000000=good[:, :3], request_000001=good),
        "dp_outside": dict(dp_rank=np.array(4), request_000000=good, request_000001=good),
    }
    for name, arrays in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        assert main(["import", "--from", "vllm", str(path), *argv]) == 2, name
        err = capsys.readouterr().err
        assert f"{path}: " in err and err.count("\n") == 1, err
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes((tmp_path / "wrong_shape.npz").read_bytes()[:200])
    assert main(["import", "--from", "vllm", str(trunc), *argv]) == 2
    assert f"{trunc}: not a readable .npz" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                               st.builds(json.dumps, st.dictionaries(st.sampled_from(["step", "layer", "rank", "top_indices", "block"]),
                                                                     st.one_of(st.integers(-3, 12), st.text(max_size=3),
                                                                               st.lists(st.lists(st.integers(-2, 10), max_size=3), max_size=3))))),
                     min_size=1, max_size=4))
def test_megatron_reader_fuzz_only_input_errors(tmp_path_factory, junk):
    tmp = tmp_path_factory.mktemp("fz")
    ids = _routing(np.random.default_rng(14), steps=2, micro=1, tokens=2)
    paths = _write_megatron(tmp / "t", ids)
    with open(paths[0], "a", encoding="utf-8", errors="surrogateescape") as fh:
        fh.write("\n".join(junk) + "\n")
    try:
        import_instance("megatron", paths, **_sections(tmp))
    except InvalidInputError as exc:
        assert "\n" not in str(exc)


def test_token_cap_beyond_the_instance_limit_is_refused(tmp_path, monkeypatch):
    import placement.sources.importers.core as core_mod

    monkeypatch.setattr(core_mod, "MAX_ROUTING_IDS", 100)
    ids = _routing(np.random.default_rng(15), steps=2, micro=1, tokens=20)
    with pytest.raises(InvalidInputError, match="use at most 8"):  # 100 // (3 layers * 2 sources * top-2)
        import_instance("megatron", _write_megatron(tmp_path / "t", ids), **_sections(tmp_path))
