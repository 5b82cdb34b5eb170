"""``placement.api.solve`` as named steps over one :class:`~placement.api.SolveRequest`: the options
object and the keywords are the same call, every option is typed, documented and shown by
``inspect``, unknown keywords are refused as Python refuses them, and each step does its one thing
alone (placement/api/solving.py)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import threading

import numpy as np
import pytest

import placement
from placement.api import SolveRequest, answer_reserve_s, default_layout_report, result_document
from placement.api.request import OPTION_NAMES, solve_request
from placement.api.solving import (ANSWER_STEPS, ConsumerChoice, SolvePlan, add_moves, add_replicas, check_answer,
                                   choose_consumer, choose_pipeline_split, mark_interrupted, record_params, score,
                                   solver_options)
from placement.predict.report import report
from solvers import SOLVERS, SolveOptions, SolveResult
from solvers.default import default_placement
from tests.conftest import INSTANCES, ROOT

TINY = INSTANCES / "tiny.json"


@pytest.fixture(scope="module")
def tiny():
    return placement.load_instance(TINY)


def _spy(seen: list):
    def spy(instance, options):
        seen.append(options)
        return SolveResult(default_placement(instance), "_spy", "heuristic", 0.0, params={"own": 1})

    return spy


def _plan(tiny, request: SolveRequest, consumer: ConsumerChoice | None = None) -> SolvePlan:
    consumer = consumer or ConsumerChoice("none", defaulted=False)
    options = solver_options(tiny, request, consumer, "runtime", None, 0.0)
    return SolvePlan(request, 0.0, consumer, "runtime", None, options)


def test_every_option_is_a_keyword_of_solve_with_its_default_and_a_doc_entry():
    params = inspect.signature(placement.solve).parameters
    assert list(params)[:2] == ["instance", "options"]
    doc = SolveRequest.__doc__ or ""
    for f in dataclasses.fields(SolveRequest):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[f.name].default == f.default, f.name
        assert f"\n    {f.name} : " in doc, f"SolveRequest's docstring does not describe {f.name}"
    assert OPTION_NAMES == tuple(list(params)[2:])
    # the 24 options solve took as keywords before it took an options object, and the replicas' memory budget
    assert len(OPTION_NAMES) == 25 and params["objective"].default == "step_time"


def test_the_options_object_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SolveRequest().seed = 3


def test_an_unknown_keyword_is_a_type_error_naming_it(tiny):
    with pytest.raises(TypeError, match="unexpected keyword argument 'time_limit'"):
        placement.solve(tiny, time_limit=5)
    with pytest.raises(TypeError, match="expected a SolveRequest, found dict"):
        solve_request({"seed": 1}, {})


def test_keywords_replace_the_fields_of_the_options_object():
    base = SolveRequest(seed=5, objective="total")
    assert solve_request(base, {}) is base
    assert solve_request(base, {"seed": 7}) == SolveRequest(seed=7, objective="total")
    assert solve_request(None, {"seed": 7}) == SolveRequest(seed=7)
    assert base.seed == 5  # not changed in place


def test_options_object_and_keywords_are_the_same_call(tiny, monkeypatch):
    seen: list = []
    monkeypatch.setitem(SOLVERS, "_spy", _spy(seen))
    kw = dict(solver="_spy", time_limit_s=12.0, seed=9, num_workers=1, objective="total", started_at=100.0,
              finish_reserve_s=1.0, pipeline_split=False)
    a = placement.solve(tiny, **kw)
    b = placement.solve(tiny, SolveRequest(**kw))
    c = placement.solve(tiny, SolveRequest(seed=1, objective="bottleneck"), **kw)
    for other in (b, c):
        assert np.array_equal(other.placement.rank2gpu, a.placement.rank2gpu)
        assert other.params == a.params and other.details == a.details and other.metrics == a.metrics
    assert seen[0] == seen[1] == seen[2]
    assert seen[0].seed == 9 and seen[0].objective == "total" and seen[0].deadline == pytest.approx(100.0 + 12.0 - 1.0)
    assert a.params == {"own": 1, "seed": 9, "time_limit_s": 12.0}


def test_a_bad_option_in_the_object_is_refused_like_a_bad_keyword(tiny):
    for request, field in ((SolveRequest(seed=-1), "seed"), (SolveRequest(fit="worst"), "fit"),
                           (SolveRequest(wall_limit_s=0.0), "wall_limit_s"), (SolveRequest(layout="x"), "layout")):
        with pytest.raises(placement.InvalidInputError, match=f"^{field}: "):
            placement.solve(tiny, request)


def test_choose_consumer_follows_the_dispatcher_and_drops_hybridep_when_the_layout_is_kept(tiny):
    assert tiny.performance is not None and tiny.performance.dispatcher == "hybridep"
    assert choose_consumer(tiny, SolveRequest(consumer="deepep")) == ConsumerChoice("deepep", defaulted=False)
    assert choose_consumer(tiny, SolveRequest()) == ConsumerChoice("hybridep", defaulted=True)
    kept = choose_consumer(tiny, SolveRequest(layout="fixed"))
    assert kept.consumer == "none" and kept.defaulted and "the rank layout is kept" in (kept.fallback or "")
    prev = choose_consumer(tiny, SolveRequest(previous=default_placement(tiny)))
    assert prev.fallback == kept.fallback


def test_record_params_writes_the_fallback_and_the_seed(tiny):
    plan = _plan(tiny, SolveRequest(seed=4, time_limit_s=7.0), ConsumerChoice("none", True, "why"))
    result = SolveResult(default_placement(tiny), "x", "heuristic", 0.0, params={"a": 1})
    out = record_params(tiny, plan, result)
    assert out.params == {"a": 1, "seed": 4, "time_limit_s": 7.0, "consumer_fallback": "why"}
    assert result.params == {"a": 1}  # steps return new results, never change their input


def test_mark_interrupted_only_when_the_stop_event_is_set(tiny):
    event = threading.Event()
    plan = _plan(tiny, SolveRequest(stop_event=event))
    result = SolveResult(default_placement(tiny), "x", "heuristic", 0.0)
    assert mark_interrupted(tiny, plan, result) is result
    event.set()
    assert mark_interrupted(tiny, plan, result).details == {"interrupted": True}


def test_steps_that_do_not_apply_return_the_result_unchanged(tiny):
    result = SolveResult(default_placement(tiny), "x", "heuristic", 0.0)
    plan = _plan(tiny, SolveRequest())
    assert add_replicas(tiny, plan, result) is result and add_moves(tiny, plan, result) is result
    assert check_answer(tiny, plan, result) is result
    assert choose_pipeline_split(tiny, _plan(tiny, SolveRequest(pipeline_split=False)), result) is result
    assert choose_pipeline_split(tiny, _plan(tiny, SolveRequest(objective="total")), result) is result


def test_the_pipeline_split_step_chooses_a_layout_and_score_prices_it(tiny):
    from placement.predict.pipeline_split import choose_layout

    assert tiny.parallel.pp > 1
    result = SolveResult(default_placement(tiny), "x", "heuristic", 0.0)
    split = choose_pipeline_split(tiny, _plan(tiny, SolveRequest()), result)
    choice = choose_layout(tiny, result.placement)
    assert split.details == {"pipeline_layout": choice.to_dict()} and split.placement.pipeline_layout == choice.chunks
    assert np.array_equal(split.placement.phy2log, result.placement.phy2log)
    scored = score(tiny, _plan(tiny, SolveRequest()), split)
    assert scored.metrics == report(tiny, split.placement)


def test_the_answer_steps_check_before_they_score():
    names = [s.__name__ for s in ANSWER_STEPS]
    assert names[0] == "check_answer" and names.index("choose_pipeline_split") < names.index("score")
    assert names.index("score") < names.index("add_moves")  # the move report reads the metrics


def test_the_default_layout_report_and_the_answer_reserve(tiny):
    d = default_layout_report(tiny)
    assert d.metrics == report(tiny, default_placement(tiny)) and d.scoring_s >= 0.0
    assert answer_reserve_s(2.0) == pytest.approx(placement.FINISH_RESERVE_S + 3.0)


def test_the_result_document_records_an_allocation(tiny, monkeypatch):
    monkeypatch.setitem(SOLVERS, "_spy", _spy([]))
    hosts = list(tiny.cluster.host_index)
    inst = placement.allocate(tiny, hosts)
    result = placement.solve(inst, solver="_spy", consumer="none", layout="fixed", pipeline_split=False)
    plain = result_document(inst, result)
    doc = result_document(inst, result, allocation=",".join(hosts))
    assert "allocation" not in plain["solve"]["details"]
    assert doc["solve"]["details"]["allocation"] == {"hosts": ",".join(hosts),
                                                     "gpus": int(tiny.cluster.available.sum())}
    doc["solve"]["details"].pop("allocation")
    assert doc == plain


def test_importing_the_cli_runs_nothing_and_python_m_runs_it():
    quiet = subprocess.run([sys.executable, "-c", "import placement.cli, placement.cli.__main__"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    run = subprocess.run([sys.executable, "-m", "placement.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: placement")


def test_solver_options_keep_the_rank_layout_of_a_replacement(tiny):
    from placement.api.request import move_request

    request = SolveRequest(previous=default_placement(tiny), move_cost=0.1, consumer="none")
    moves = move_request(tiny, request, "runtime")
    assert moves is not None
    options = solver_options(tiny, request, ConsumerChoice("none", False), "runtime", moves, 0.0)
    assert isinstance(options, SolveOptions) and options.layout == "fixed" and options.moves is moves
    assert move_request(tiny, SolveRequest(), "runtime") is None
