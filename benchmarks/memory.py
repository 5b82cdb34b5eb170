"""Peak memory and wall time of ``placement solve``, beside a baseline measured in the same run.

Every measurement runs the real command in its own child process and reports

- ``peak RSS``: the child's peak resident set size (``ru_maxrss`` from ``os.wait4``: the largest
  of the child and the processes it waited for; solver threads share the child's memory);
- ``peak tree PSS``: the largest total proportional set size of the child and all its
  descendants at once (solver worker processes), sampled every 50 ms from ``/proc``;
- ``over limit``: wall time less ``--time-limit`` (the command's whole run, interpreter start-up
  included), for solves.

Measured, in order:

- ``imports``: the interpreter importing ``placement`` and every solver (the floor);
- ``load+evaluate``: ``placement evaluate INSTANCE`` (load, then score the default layout on both
  windows): the baseline every solve pays;
- ``solve SOLVER``: ``placement solve INSTANCE --solver SOLVER --time-limit S -o TMP``, for each
  solver asked for, with its ratio to the baseline.

Usage::

    python benchmarks/memory.py [--instance FILE ...] [--solver NAME ...] [--time-limit S ...] [--json]

(default: instances/dsv3_1024.json, every registered solver, 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from placement.cli import entry; entry()"]


@dataclass(frozen=True)
class Peak:
    """One child process: what ran, its exit code, wall time (s) and memory peaks (bytes)."""

    instance: str
    label: str
    time_limit_s: float | None
    exit_code: int
    wall_s: float
    peak_rss_bytes: int
    peak_tree_pss_bytes: int

    @property
    def over_limit_s(self) -> float | None:
        return None if self.time_limit_s is None else self.wall_s - self.time_limit_s


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def measure(instance: str, label: str, argv: list[str], time_limit_s: float | None = None) -> Peak:
    """Run ``argv`` as a child; its own peak RSS (``ru_maxrss``, KiB on Linux) and the tree's PSS."""
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        tree_peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal tree_peak
            while not done.wait(0.05):
                tree_peak = max(tree_peak, sum(_pss_bytes(p) for p in _descendants(proc.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall_s = time.monotonic() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
        if proc.returncode != 0:
            err.seek(0)
            sys.stderr.write(f"{label}: exit {proc.returncode}: {err.read().decode(errors='replace')}")
    return Peak(instance, label, time_limit_s, proc.returncode, wall_s, usage.ru_maxrss * 1024, tree_peak)


def run(instances: list[str], solvers: list[str], time_limits_s: list[float]) -> list[Peak]:
    peaks = [measure("-", "imports", [sys.executable, "-c", "import placement, solvers"])]
    with tempfile.TemporaryDirectory() as tmp:
        for instance in instances:
            peaks.append(measure(instance, "load+evaluate", CLI + ["evaluate", instance]))
            for name in solvers:
                for limit in time_limits_s:
                    out = str(Path(tmp) / f"{name}.json")
                    argv = CLI + ["solve", instance, "--solver", name, "--time-limit", str(limit), "-o", out]
                    peaks.append(measure(instance, f"solve {name}", argv, limit))
    return peaks


def main(argv: list[str] | None = None) -> int:
    from solvers import SOLVERS

    parser = argparse.ArgumentParser(description="Peak memory of placement solve, against load+evaluate.")
    parser.add_argument("--instance", action="append", help="instance file (repeatable; default dsv3_1024)")
    parser.add_argument("--solver", action="append", choices=sorted(SOLVERS),
                        help="solver to measure (repeatable; default: every registered solver)")
    parser.add_argument("--time-limit", type=float, action="append", metavar="S",
                        help="--time-limit of each solve (repeatable; default 30)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    instances = args.instance or ["instances/dsv3_1024.json"]
    peaks = run(instances, args.solver or sorted(SOLVERS), args.time_limit or [30.0])
    if args.json:
        print(json.dumps([{**asdict(p), "over_limit_s": p.over_limit_s} for p in peaks], indent=1))
        return 0 if all(p.exit_code == 0 for p in peaks) else 1
    print(f"peak memory and wall time per child process, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"  {'instance':<28}{'process':<18}{'limit s':>8}{'exit':>5}{'wall s':>8}{'over s':>8}"
          f"{'peak RSS':>11}{'tree PSS':>11}{'RSS/base':>9}")
    base = 0
    for p in peaks:
        if p.label == "load+evaluate":
            base = p.peak_rss_bytes
        limit = "" if p.time_limit_s is None else f"{p.time_limit_s:g}"
        over = "" if p.over_limit_s is None else f"{p.over_limit_s:+.2f}"
        ratio = f"{p.peak_rss_bytes / base:.2f}x" if base else ""
        print(f"  {Path(p.instance).stem:<28}{p.label:<18}{limit:>8}{p.exit_code:>5}{p.wall_s:>8.2f}{over:>8}"
              f"{p.peak_rss_bytes / 1e6:>8.0f} MB{p.peak_tree_pss_bytes / 1e6:>8.0f} MB{ratio:>9}")
    return 0 if all(p.exit_code == 0 for p in peaks) else 1


if __name__ == "__main__":
    sys.exit(main())
