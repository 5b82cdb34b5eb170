"""Embedding ``placement`` in a job scheduler: an answer by a deadline, never a half-written file.

The function ``place`` below is the README's "Embedding in a scheduler" example, verbatim (a test
checks that the two agree and runs this file on ``instances/tiny.json``).

Usage::

    python examples/scheduler.py INSTANCE OUTPUT [--budget-s SECONDS]

Prints one JSON line on success; on failure one line on stderr and the exit code the ``placement``
CLI would use (2 invalid input, 3 infeasible, 1 anything else).
"""

from __future__ import annotations

import argparse
import json
import sys

# --- README example: begin ---
import time

import placement


def place(instance_path: str, output_path: str, budget_s: float) -> dict:
    """Place one job within budget_s seconds; raises placement.PlacementError on failure."""
    started_at = time.monotonic()  # the budget counts loading and scoring too
    instance = placement.load_instance(instance_path)  # InvalidInputError: reject the request
    with placement.SignalStop() as stop:  # SIGINT/SIGTERM: stop, keep the best placement so far
        stop.armed = True
        result = placement.solve(  # InfeasibleError: too few GPUs or slots for this layout
            instance, time_limit_s=budget_s, seed=0, started_at=started_at, stop_event=stop.event
        )
        placement.save_result(instance, result, output_path)  # atomic: a complete file or none
    return {
        "status": result.status,
        "interrupted": stop.signum is not None,
        "heldout_cross_domain_bytes_per_step": result.metrics["heldout_cross_domain_bytes_per_step"],
        "wall_s": round(result.wall_s, 3),
    }
# --- README example: end ---


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("instance")
    parser.add_argument("output")
    parser.add_argument("--budget-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        summary = place(args.instance, args.output, args.budget_s)
    except placement.PlacementError as exc:
        print(f"scheduler: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exc.exit_code
    except placement.Interrupted as exc:  # a signal before the solve started: nothing written
        return exc.exit_code
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
