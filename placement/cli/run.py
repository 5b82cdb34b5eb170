"""``main(argv) -> int``: the only place that prints an error or chooses the exit code."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Sequence

from placement.api import SignalStop
from placement.cli.common import EXIT_ERROR, _one_line
from placement.cli.parser import build_parser
from placement.cli.placements import _cmd_evaluate, _cmd_export, _cmd_show, _cmd_verify
from placement.cli.plan import _cmd_cluster, _cmd_plan
from placement.cli.routing import _cmd_calibrate, _cmd_import, _cmd_stats
from placement.cli.solve import _cmd_solve
from placement.core.model import InvalidInputError, PlacementError

__all__ = ["main", "entry"]


def _process_started_at() -> float:
    """The ``time.monotonic()`` instant this process started (Linux), else now.

    So that ``--time-limit`` also covers interpreter start-up and imports.
    """
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # fields from the 3rd (state) on
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # the 22nd: start, ticks since boot
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age_s if 0.0 <= age_s < 60.0 else now


def main(argv: Sequence[str] | None = None, *, started_at: float | None = None) -> int:
    """Run the command line; returns the exit code.

    ``started_at``: the ``time.monotonic()`` instant the time limit counts from (default: now;
    the console script passes the process start).
    """
    started_at = time.monotonic() if started_at is None else started_at
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "evaluate":
            return _cmd_evaluate(args)
        if args.command == "solve":
            if args.seed < 0:
                raise InvalidInputError(f"--seed: expected a non-negative integer, found {args.seed}")
            if args.workers is not None and args.workers < 1:
                raise InvalidInputError(f"--workers: expected a positive integer, found {args.workers}")
            if not (math.isfinite(args.time_limit) and args.time_limit > 0):
                raise InvalidInputError(f"--time-limit: expected a positive number of seconds, found {args.time_limit}")
            with SignalStop() as stop:
                return _cmd_solve(args, started_at, stop)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "show":
            return _cmd_show(args)
        if args.command == "plan":
            return _cmd_plan(args, started_at)
        if args.command == "cluster":
            return _cmd_cluster(args)
        if args.command == "import":
            if args.heldout_steps is not None and args.heldout_steps < 1:
                raise InvalidInputError(f"--heldout-steps: expected a positive integer, found {args.heldout_steps}")
            return _cmd_import(args)
        if args.command == "calibrate":
            return _cmd_calibrate(args)
        if args.command == "stats":
            if args.distance < 1:
                raise InvalidInputError(f"--distance: expected a positive integer, found {args.distance}")
            return _cmd_stats(args)
        raise InvalidInputError(f"unknown command {args.command!r}")  # pragma: no cover
    except PlacementError as exc:
        print(f"placement: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # SIGINT outside a solve, or Interrupted from SignalStop
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"placement: interrupted by {signal.Signals(signum).name}, nothing written", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        return EXIT_ERROR
    except MemoryError:
        print("placement: error: out of memory", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback
        print(f"placement: error: internal: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR


def entry() -> None:
    sys.exit(main(started_at=_process_started_at()))
