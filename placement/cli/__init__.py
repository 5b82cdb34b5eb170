"""The command line: a thin layer over :mod:`placement.api`.

``main(argv) -> int`` is the only place that prints or exits.  Exit codes: 0 success, 2 invalid
input, 3 infeasible, 1 anything else; errors are one line on stderr, never a traceback.

``placement solve`` and signals: ``--time-limit`` bounds the whole command from process start
(interpreter start-up, loading and scoring included) within the margin measured in the README.
A SIGINT or SIGTERM during the solve makes the solver return the best placement found so far; it
is checked, scored and written atomically to ``-o`` and the command exits 0 (with one line on
stderr saying it was interrupted).  Without ``-o``, or when the signal arrives before the solve
(while loading) or a second time, nothing is written and the command exits 130 (SIGINT) or 143
(SIGTERM).  So exit 0 always means: the output file is complete and valid.

Modules: :mod:`~placement.cli.run` ``main`` and ``entry`` (errors, exit codes, the dispatch to a
command); :mod:`~placement.cli.parser` every command's arguments; one module per group of commands
(:mod:`~placement.cli.solve`; :mod:`~placement.cli.placements` evaluate, export, verify, show;
:mod:`~placement.cli.plan` plan, cluster; :mod:`~placement.cli.routing` import, stats,
calibrate); :mod:`~placement.cli.printing` the shared tables; :mod:`~placement.cli.common` exit
codes, output paths, progress messages.  ``python -m placement.cli`` runs ``entry``
(:mod:`placement.cli.__main__`); importing the package runs nothing.
"""

from placement.cli.common import EXIT_ERROR, EXIT_INFEASIBLE, EXIT_INVALID, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM
from placement.cli.parser import build_parser
from placement.cli.run import _process_started_at, entry, main  # _process_started_at: for tests

__all__ = [
    "main",
    "entry",
    "build_parser",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_INVALID",
    "EXIT_INFEASIBLE",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
]
