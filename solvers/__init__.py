"""Placement algorithms behind one interface (:mod:`solvers.base`), registered by name.

Importing this package registers every solver; ``SOLVERS`` maps names to solve functions.
"""

from solvers import default as _default  # noqa: F401  (registers "default")
from solvers.base import CONSUMERS, LAYOUT_MODES, OBJECTIVES, SolveOptions, SolveResult
from solvers.registry import SOLVERS, get_solver, register

__all__ = ["SOLVERS", "get_solver", "register", "SolveOptions", "SolveResult", "CONSUMERS", "OBJECTIVES", "LAYOUT_MODES"]
