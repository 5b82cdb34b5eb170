"""A pytest plugin: how the test processes share the machine under pytest-xdist.

The suite runs on two workers (``python -m pytest -n 2``, docs/development.md) on a 2-core machine.
A test marked ``exclusive`` measures wall-clock time (a promptness bound, a wall-clock safety net
that must not fire) or loads the machine on purpose (a CPU hog beside solves): it runs while the
other workers wait between two of their tests, so its machine is the quiet one its bounds were set
for.  Every other test runs beside whatever the other worker runs.

The mechanism is a reader-writer lock on two files in the run's shared temporary folder.  Every
test holds the lock shared from its setup to its teardown; an exclusive test holds it alone.  The
gate gives the exclusive test precedence: once it holds the gate, no new test starts elsewhere, and
it starts as soon as the tests already running end.  Without pytest-xdist (or off POSIX) it does
nothing.  ``tests/test_machine_share.py`` checks it with an inner pytest run on two workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "exclusive: measures wall-clock time or loads the machine on purpose; under pytest-xdist it "
        "runs while the other workers wait (tests/machine_share.py)",
    )


def run_folder(config: pytest.Config) -> Path | None:
    """The temporary folder every worker of this run shares, or None when not under pytest-xdist."""
    basetemp = getattr(config.option, "basetemp", None)
    if not hasattr(config, "workerinput") or not basetemp:
        return None
    return Path(basetemp).parent  # xdist gives each worker <run folder>/popen-gwN


@contextlib.contextmanager
def machine_share(folder: Path, exclusive: bool) -> Iterator[None]:
    """Hold the machine shared, or alone when ``exclusive``, for the length of the block."""
    import fcntl

    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(folder / "machine.gate", "a+b") as gate, open(folder / "machine.lock", "a+b") as lock:
        fcntl.flock(gate, mode)
        fcntl.flock(lock, mode)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)  # held only to pass: an exclusive test queued first goes first
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = run_folder(item.config)
    if folder is None or os.name != "posix":
        return (yield)
    with machine_share(folder, item.get_closest_marker("exclusive") is not None):
        return (yield)
