"""What every command shares: exit codes, one-line errors, output paths, progress messages."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Callable

from placement.core.model import InvalidInputError
from placement.core.progress import Progress


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_INFEASIBLE = 3
EXIT_SIGINT = 128 + signal.SIGINT  # 130: interrupted, nothing written
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: terminated, nothing written


def _progress_printer(bar: Progress) -> Callable[[str], None] | None:
    """One-line messages above ``bar`` when it is drawn (a terminal, no ``--quiet``), else None."""
    if not bar.active:
        return None

    def show(msg: str) -> None:
        bar.write(f"[placement] {msg}")

    return show


_QUIET_HELP = "no progress bar or messages on stderr (they appear only on a terminal; output files never change)"


def _check_output_path(path: str) -> None:
    """Refuse an output path that cannot be written before spending the time limit on a solve."""
    out = Path(path)
    if out.is_dir():
        raise InvalidInputError(f"--output: {out} is a directory")
    folder = out.parent
    if not folder.is_dir():
        raise InvalidInputError(f"--output: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInputError(f"--output: folder {folder} is not writable")


def _allocation(args: argparse.Namespace) -> str | None:
    """The host list of ``--allocation``: as given, or ``SLURM_JOB_NODELIST`` for ``slurm``."""
    if args.allocation is None:
        return None
    if args.allocation == "slurm":
        value = os.environ.get("SLURM_JOB_NODELIST", "").strip()
        if not value:
            raise InvalidInputError("--allocation slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm job?)")
        return value
    return str(args.allocation)


_ALLOCATION_HELP = (
    "only these hosts: a Slurm host list like 'gb[001-018,025]' (e.g. \"$SLURM_JOB_NODELIST\"), or 'slurm' for "
    "SLURM_JOB_NODELIST; host names are the cluster's (cluster.hosts from placement cluster). Never implicit"
)


def _one_line(message: str) -> str:
    """Escape newlines and other unprintable characters so that an error stays one line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)
