"""Signals and deadlines: a stopped solve writes its best placement or nothing, never a partial file.

In-process tests drive the CLI with stand-in solvers (registered for the test only) so that every
path is exercised deterministically; one test blocks the main thread inside CP-SAT, where Python
signal handlers cannot run, to check the wakeup-fd relay; the subprocess tests send real SIGINT /
SIGTERM to ``placement solve`` running the slowest registered solver on dsv3_256.
"""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import placement.api
from placement.api import FINISH_RESERVE_S, Interrupted, SignalStop
from placement.core.checker import check
from placement.cli import EXIT_SIGINT, EXIT_SIGTERM, main
from placement.formats import read_instance, read_placement
from solvers import SOLVERS, SolveOptions, SolveResult
from solvers.base import call_on_stop
from solvers.default import default_placement
from tests.conftest import INSTANCES, ROOT

# Promptness bounds in wall-clock seconds: alone on the machine under pytest-xdist (tests/machine_share.py).
pytestmark = pytest.mark.exclusive

TINY = str(INSTANCES / "tiny.json")
# The subprocess tests use the first of these that is registered: the slowest solvers first.
SLOW_SOLVERS = ("cpsat", "kahypar", "packed", "eplb", "default")


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def polling_solver(on_first_poll):
    """A stand-in solver: calls ``on_first_poll()`` once, then polls should_stop() for 20 s."""

    def solve(instance, options: SolveOptions) -> SolveResult:
        on_first_poll()
        t_end = time.monotonic() + 20.0
        while not options.should_stop():
            if time.monotonic() > t_end:
                raise AssertionError("the stop request never reached the solver")
            time.sleep(0.01)
        return SolveResult(default_placement(instance), "_test", "feasible", 0.0, params={"polls": True})

    return solve


def kill_self(signum: int) -> None:
    os.kill(os.getpid(), signum)


# ---------------------------------------------------------------------------------------------
# SignalStop on its own
# ---------------------------------------------------------------------------------------------
def test_signal_before_arming_raises_and_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Interrupted) as info:
        with SignalStop():
            kill_self(signal.SIGTERM)
            time.sleep(1)  # the handler raises before this returns
    assert info.value.signum == signal.SIGTERM and info.value.exit_code == 143
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was restored too


def test_first_signal_when_armed_only_sets_the_event_second_raises():
    with SignalStop() as stop:
        stop.armed = True
        kill_self(signal.SIGINT)
        assert stop.event.wait(2) and stop.signum == signal.SIGINT and stop.exit_code == 130
        with pytest.raises(Interrupted):
            kill_self(signal.SIGTERM)
            time.sleep(1)


def test_stop_reaches_cpsat_while_the_main_thread_is_inside_it():
    """Python handlers cannot run while CP-SAT's solve blocks the main thread: the wakeup-fd
    watcher sets the event, and call_on_stop relays it to stop_search()."""
    from ortools.sat.python import cp_model

    rng = np.random.default_rng(0)
    n = 40
    model = cp_model.CpModel()
    x = {(i, j): model.new_bool_var(f"x_{i}_{j}") for i in range(n) for j in range(n)}
    for i in range(n):
        model.add_exactly_one(x[i, j] for j in range(n))
        model.add_exactly_one(x[j, i] for j in range(n))
    y = {}  # y[i, j]: row i on column j and row i+1 on column j+1
    for i in range(n - 1):
        for j in range(n):
            y[i, j] = model.new_bool_var(f"y_{i}_{j}")
            model.add_bool_and([x[i, j], x[i + 1, (j + 1) % n]]).only_enforce_if(y[i, j])
    model.maximize(sum(int(rng.integers(1000)) * v for v in y.values()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 20.0
    solver.parameters.num_workers = 1
    solver.parameters.catch_sigint_signal = False  # the caller owns SIGINT
    with SignalStop() as stop:
        stop.armed = True
        options = SolveOptions(time_limit_s=20.0, stop_event=stop.event)
        threading.Timer(0.5, kill_self, (signal.SIGTERM,)).start()
        t0 = time.monotonic()
        with call_on_stop(options, solver.stop_search):
            solver.solve(model)
        elapsed = time.monotonic() - t0
    assert stop.signum == signal.SIGTERM
    assert elapsed < 5.0, f"CP-SAT ran {elapsed:.1f} s after SIGTERM at 0.5 s"


def test_call_on_stop_does_nothing_without_a_request():
    calls = []
    options = SolveOptions(stop_event=threading.Event())
    with call_on_stop(options, lambda: calls.append(1)):
        time.sleep(0.1)
    options.stop_event.set()
    time.sleep(0.1)
    assert calls == []


# ---------------------------------------------------------------------------------------------
# The CLI, in process, with stand-in solvers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_solve_writes_the_best_placement_and_exits_0(tmp_path, monkeypatch, signum):
    monkeypatch.setitem(SOLVERS, "_test", polling_solver(lambda: kill_self(signum)))
    out = tmp_path / "p.json"
    code, stdout, err = run(["solve", TINY, "--solver", "_test", "--time-limit", "60", "-o", str(out)])
    assert code == 0, err
    assert err.count("\n") == 1 and f"interrupted by {signal.Signals(signum).name}" in err
    placement, doc = read_placement(out)
    assert check(read_instance(TINY), placement) == []
    assert doc["solve"]["details"]["interrupted"] is True
    assert os.listdir(tmp_path) == ["p.json"]  # no temporary files left behind


def test_signal_during_solve_without_output_exits_130(monkeypatch):
    monkeypatch.setitem(SOLVERS, "_test", polling_solver(lambda: kill_self(signal.SIGINT)))
    code, stdout, err = run(["solve", TINY, "--solver", "_test", "--time-limit", "60"])
    assert code == EXIT_SIGINT and stdout == ""
    assert err.count("\n") == 1 and "nothing written" in err


def test_second_signal_during_solve_writes_nothing(tmp_path, monkeypatch):
    def twice():
        kill_self(signal.SIGTERM)
        kill_self(signal.SIGTERM)

    monkeypatch.setitem(SOLVERS, "_test", polling_solver(twice))
    code, _, err = run(["solve", TINY, "--solver", "_test", "--time-limit", "60", "-o", str(tmp_path / "p.json")])
    assert code == EXIT_SIGTERM and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_signal_while_loading_writes_nothing(tmp_path, monkeypatch):
    real = placement.api.load_instance

    def load_then_signal(path):
        kill_self(signal.SIGTERM)
        return real(path)

    monkeypatch.setattr(placement.api, "load_instance", load_then_signal)
    code, stdout, err = run(["solve", TINY, "-o", str(tmp_path / "p.json")])
    assert code == EXIT_SIGTERM and stdout == ""
    assert err.count("\n") == 1 and "SIGTERM" in err
    assert os.listdir(tmp_path) == []


def test_time_limit_bounds_the_whole_command(tmp_path, monkeypatch):
    """A solver that uses its whole budget: the command ends within the limit plus the reserve."""
    seen: dict[str, float] = {}

    def sleepy(instance, options: SolveOptions) -> SolveResult:
        seen["deadline"] = options.resolved_deadline()
        while not options.should_stop():
            time.sleep(0.01)
        return SolveResult(default_placement(instance), "_sleepy", "feasible", 0.0)

    monkeypatch.setitem(SOLVERS, "_sleepy", sleepy)
    limit = 2.0
    t0 = time.monotonic()
    code, _, err = run(["solve", TINY, "--solver", "_sleepy", "--time-limit", str(limit), "-o", str(tmp_path / "p.json")])
    wall = time.monotonic() - t0
    assert code == 0, err
    assert seen["deadline"] <= t0 + limit - FINISH_RESERVE_S + 0.05
    assert wall <= limit + 0.5, f"ran {wall:.2f} s for a {limit} s limit"


def test_the_console_script_counts_from_process_start():
    """A fresh process notes the clock as its first statement, sleeps a second, then asks: the
    start it gets lies before that first statement (interpreter start-up counts) and at least the
    second slept before now.  Falling back to "now" fails the second condition."""
    child = (
        "import time; first = time.monotonic(); time.sleep(1.0)\n"
        "from placement.cli import _process_started_at\n"
        "started = _process_started_at(); now = time.monotonic()\n"
        "print(first - started, now - started)\n"
    )
    out = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    before_first_s, age_s = (float(x) for x in out.stdout.split())
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc/self/stat counts the start in clock ticks
    assert before_first_s >= -2 * tick_s, out.stdout  # the start is not after the first statement
    assert age_s >= 1.0, out.stdout  # the second slept is inside the counted time: not "now"
    assert before_first_s < 60.0, out.stdout


# ---------------------------------------------------------------------------------------------
# A real `placement solve` process
# ---------------------------------------------------------------------------------------------
def slowest_solver() -> str:
    return next(name for name in SLOW_SOLVERS if name in SOLVERS)


def interrupt_solve(tmp_path: Path, signum: int, to_group: bool, limit_s: float = 60.0) -> tuple[int, str, float, Path]:
    """Start ``placement solve dsv3_256`` with the slowest solver, signal it once the solve has
    begun (the CLI's progress line), and return (exit code, stderr, seconds from the signal to the
    exit, output path).  ``to_group``: signal the whole process group, as a terminal's Ctrl-C or
    Slurm's scancel do (worker processes get it too), instead of the main process only."""
    solver = slowest_solver()
    out = tmp_path / "out" / "p.json"
    out.parent.mkdir()
    # stderr on a pseudo-terminal, so that the CLI prints its progress line when the solve starts.
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from placement.cli import entry; entry()", "solve", str(INSTANCES / "dsv3_256.json"),
         "--solver", solver, "--time-limit", str(limit_s), "-o", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    os.close(slave)
    err = b""

    def read_some(timeout_s: float) -> bool:
        nonlocal err
        ready, _, _ = select.select([master], [], [], timeout_s)
        if not ready:
            return False
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the process ended and closed the pty
            return False
        err += chunk
        return bool(chunk)

    try:
        while b"solving" not in err:
            assert read_some(60), f"no progress line within 60 s: {err!r}"
        assert proc.poll() is None, f"the solve ended before it could be interrupted: {err!r}"
        time.sleep(1.0)  # let the solver get going
        sent = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        proc.wait(timeout=limit_s + 60)
        stopped_s = time.monotonic() - sent
        while read_some(0.2):
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return proc.returncode, err.decode(errors="replace"), stopped_s, out


def assert_complete_or_absent(code: int, text: str, out: Path, signum: int) -> None:
    assert code in (0, 128 + signum), text
    assert sorted(os.listdir(out.parent)) in ([], ["p.json"]), "a temporary file was left behind"
    assert "Traceback" not in text, text
    if code == 0:
        placement, doc = read_placement(out)  # complete and parseable
        assert check(read_instance(INSTANCES / "dsv3_256.json"), placement) == []
        assert f"interrupted by {signal.Signals(signum).name}" in text
        assert doc["instance"]["name"] == "dsv3_256"
    else:
        assert not out.exists()
        assert text.strip().splitlines()[-1].startswith("placement: interrupted"), text


# Solvers known not to relay a stop request yet (they would run on to their deadline, or fail when
# their worker processes get the signal too): the promptness check is an expected failure for them.
STOP_HOOK_PENDING: dict[str, str] = {}
# With a 60 s limit, a solver that ignores the stop runs ~55 s more; one that honours it stops
# within this: its layers in flight, then checking, scoring and writing the answer, which every
# solve pays (measured on dsv3_256, idle 2-core machine, 2026-12-07: the layers stopped 2.3 s after
# SIGTERM, the file was written 11.1 s after it; 11.1-12.4 s over three runs, 15.3 s in a clean-clone
# CI rehearsal). The bound is what a batch system leaves: Slurm sends SIGKILL KillWait seconds after
# SIGTERM, 30 by default (slurm.conf); 25 s keeps 5 s of it. (It was 15 s, which the rehearsal broke.)
PROMPT_STOP_S = 25.0


def test_sigterm_to_a_solve_process_writes_its_best_placement_promptly(tmp_path):
    code, text, stopped_s, out = interrupt_solve(tmp_path, signal.SIGTERM, to_group=False)
    assert_complete_or_absent(code, text, out, signal.SIGTERM)
    solver = slowest_solver()
    print(f"{solver}: exit {code} {stopped_s:.2f} s after SIGTERM")
    if not (code == 0 and stopped_s < PROMPT_STOP_S):
        if solver in STOP_HOOK_PENDING:
            pytest.xfail(f"{solver}: {STOP_HOOK_PENDING[solver]} (took {stopped_s:.1f} s, exit {code})")
        raise AssertionError(f"{solver} took {stopped_s:.1f} s to stop after SIGTERM (exit {code})")


def test_ctrl_c_to_the_process_group_leaves_a_complete_file_or_none(tmp_path):
    code, text, stopped_s, out = interrupt_solve(tmp_path, signal.SIGINT, to_group=True)
    solver = slowest_solver()
    print(f"{solver}: exit {code} {stopped_s:.2f} s after SIGINT to the group")
    assert_complete_or_absent(code, text, out, signal.SIGINT)
    if solver not in STOP_HOOK_PENDING:  # worker processes ignore it; the main process stops the solve
        assert code == 0 and stopped_s < PROMPT_STOP_S, f"{solver}: exit {code} after {stopped_s:.1f} s"
