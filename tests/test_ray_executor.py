"""RayExecutor on a local Ray instance (``ray.init(num_cpus=2)``): the executor protocol, results in
the items' order, solves identical to in-process ones, task errors with their index; and the
one-line hint when Ray is missing.

The Ray tests are skipped only where the ``ray`` extra is absent.  One Ray instance serves the
whole module (starting one took 24-29 s on the loaded 2-core build machine).
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from typing import Callable, Protocol, Sequence, TypeVar, runtime_checkable

import pytest

from placement.api import load_instance, result_document, solve
from placement.formats import dumps
from placement.core.model import InvalidInputError, SolverError
from placement.core.ray_executor import RAY_MISSING, RayExecutor
from tests.conftest import INSTANCES

T = TypeVar("T")
R = TypeVar("R")

# Ray starts some of its processes with a pre-exec hook (a fork followed by exec); with JAX already
# imported by other test modules, JAX's at-fork hook warns about forking a multithreaded process,
# which the suite's warnings-as-errors would turn into an error of whichever test starts Ray.
pytestmark = pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")


@runtime_checkable
class ExecutorProtocol(Protocol):
    """The executor protocol as ``placement.core.executor`` states it (checked here on its own)."""

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]: ...

    def close(self) -> None: ...


# Task bodies: module-level functions.
def square_after_a_pause(n: int) -> int:
    time.sleep(0.02 * (5 - n % 5))  # later items tend to finish first: order must not follow completion
    return n * n


def fail_on_three(n: int) -> int:
    if n == 3:
        raise InvalidInputError(f"item {n} is bad")
    return n


def tiny_document(seed: int) -> str:
    """The placement-file text of ``cpsat`` on tiny (deterministic budget, one worker)."""
    inst = load_instance(INSTANCES / "tiny.json")
    result = solve(inst, solver="cpsat", time_limit_s=20, seed=seed, num_workers=1)
    return dumps(result_document(inst, result))


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")  # skipped only where the ray extra is absent
    # Ray pickles functions by reference to their module, which the workers import; this test
    # module is not installed (pytest imports it from tests/), so it travels by value instead.
    # Real callers pass functions of the installed package.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray


@pytest.fixture(scope="module")
def executor(ray):
    started = ray.is_initialized()
    ex = RayExecutor(num_cpus=2)
    yield ex
    ex.close()
    assert ray.is_initialized() == started  # shut down only what it started


def test_implements_the_executor_protocol(executor):
    assert isinstance(executor, ExecutorProtocol)
    assert list(inspect.signature(RayExecutor.map).parameters) == ["self", "fn", "items"]
    assert list(inspect.signature(RayExecutor).parameters) == ["address", "num_cpus"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in inspect.signature(RayExecutor).parameters.values())


def test_map_returns_the_plain_maps_list_in_the_items_order(executor):
    items = list(range(12))
    assert executor.map(square_after_a_pause, items) == list(map(square_after_a_pause, items))
    assert executor.map(square_after_a_pause, []) == []


def test_solves_as_ray_tasks_write_the_same_bytes_as_in_process(executor):
    seeds = [0, 1]
    local = [tiny_document(seed) for seed in seeds]
    assert executor.map(tiny_document, seeds) == local
    assert [json.loads(text)["seed"] for text in local] == seeds


def test_an_error_in_one_task_surfaces_with_its_index_and_class(executor):
    with pytest.raises(InvalidInputError, match=r"^task 3: item 3 is bad$") as info:
        executor.map(fail_on_three, list(range(6)))
    assert info.value.task_index == 3
    assert "in the Ray task" in str(info.value.__cause__) and "fail_on_three" in str(info.value.__cause__)
    assert executor.map(fail_on_three, [0, 1, 2]) == [0, 1, 2]  # the executor still works


def test_reuses_a_running_ray_and_leaves_it_running(ray, executor):
    other = RayExecutor(num_cpus=2)  # Ray is up (the fixture's): joined, not restarted
    assert other.map(square_after_a_pause, [2, 3]) == [4, 9]
    other.close()
    assert ray.is_initialized()
    with pytest.raises(SolverError, match="after close"):
        other.map(square_after_a_pause, [1])


def test_ray_missing_is_a_one_line_invalid_input(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(InvalidInputError) as info:
        RayExecutor()
    assert str(info.value) == RAY_MISSING and "\n" not in RAY_MISSING
    assert "pip install 'placement[ray]'" in RAY_MISSING


def test_plan_is_the_same_document_with_ray_and_local_executors(ray, executor, tmp_path):
    """Issue 15 item 4: a plan does not depend on which executor runs its solves (the tiny job and
    cluster, a few candidates; ``make_executor("ray")`` joins the module's Ray instance)."""
    from placement.core.executor import make_executor
    from placement.plan import CandidateSpace, plan, plan_document, read_cluster, read_job
    from tests.test_plan import _cluster_doc, _job_doc, _write

    job = read_job(_write(tmp_path, "job.json", _job_doc()))
    cluster = read_cluster(_write(tmp_path, "cluster.json", _cluster_doc()))
    space = CandidateSpace(tp=(1,), cp=(1,), pp=(1, 2), vpp=(1,), ep=(4, 8), dp=(4, 8), micro_batch=(1,))
    documents = {}
    for name in ("local", "ray"):
        ex = make_executor(name, workers=2)
        try:
            result = plan(job, cluster, candidates=space, time_limit_s=60, seed=0, executor=ex)
        finally:
            ex.close()
        assert not result.deadline_hit  # a round cut by the wall clock would make the comparison moot
        documents[name] = dumps(plan_document(result))
    assert ray.is_initialized()  # make_executor("ray") joined the fixture's Ray and left it running
    assert json.loads(documents["local"])["counts"]["solved"] >= 2
    assert documents["ray"] == documents["local"]
