"""The machine-sharing plugin (tests/machine_share.py): under pytest-xdist an ``exclusive`` test
runs while no other test runs, and the other tests do run side by side.

An inner pytest run on two workers: each test records the monotonic interval it ran in (the clock
is system-wide on Linux, so intervals of different processes compare).
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

pytest.importorskip("xdist")
pytestmark = pytest.mark.skipif(os.name != "posix", reason="the lock is flock(2)")

pytest_plugins = ("pytester",)

INNER = '''
import json, os, time
from pathlib import Path

import pytest

LOG = Path(os.environ["SHARE_LOG"])


def _record(name):
    t0 = time.monotonic()
    time.sleep(0.4)
    (LOG / f"{name}.json").write_text(json.dumps([t0, time.monotonic(), os.environ["PYTEST_XDIST_WORKER"]]))


@pytest.mark.parametrize("i", range(8))
def test_shared(i):
    _record(f"shared{i}")


@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    _record(f"alone{i}")
'''


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_an_exclusive_test_runs_alone_and_the_others_side_by_side(pytester, tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SHARE_LOG", str(tmp_path))
    pytester.makeconftest('pytest_plugins = ("tests.machine_share",)\n')
    pytester.makepyfile(test_inner=INNER)
    # --dist load hands tests out one by one, so the exclusive ones land between shared ones
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "load", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=11)
    runs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(runs) == 11 and {w for _, _, w in runs.values()} == {"gw0", "gw1"}, runs
    alone = [n for n in runs if n.startswith("alone")]
    for a in alone:
        clash = [n for n in runs if n != a and _overlap(runs[a], runs[n])]
        assert not clash, f"{a} ran beside {clash}"
    # and the plugin does not serialise everything: two shared tests did run at the same time
    shared = [n for n in runs if n.startswith("shared")]
    assert any(_overlap(runs[a], runs[b]) for a, b in itertools.combinations(shared, 2)), runs


def test_without_xdist_the_plugin_stays_out_of_the_way(pytester, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest('pytest_plugins = ("tests.machine_share",)\n')
    pytester.makepyfile(test_inner="import pytest\n\n@pytest.mark.exclusive\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--strict-markers")
    result.assert_outcomes(passed=1)
