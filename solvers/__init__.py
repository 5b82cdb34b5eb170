"""Placement algorithms behind one interface (:mod:`solvers.base`), registered by name.

Importing this package registers every solver; ``SOLVERS`` maps names to solve functions.
"""

from solvers import default as _default  # noqa: F401  (registers "default")
from solvers import cpsat as _cpsat  # noqa: F401  (registers "cpsat")
from solvers import eplb as _eplb  # noqa: F401  (registers "eplb", a peer)
from solvers import kahypar as _kahypar  # noqa: F401  (registers "kahypar", a peer; mtkahypar imported lazily)
from solvers import packed as _packed  # noqa: F401  (registers "packed", a peer)
from solvers.base import CONSUMERS, LAYOUT_MODES, OBJECTIVES, SolveOptions, SolveResult
from solvers.registry import SOLVERS, get_solver, register

__all__ = ["SOLVERS", "get_solver", "register", "SolveOptions", "SolveResult", "CONSUMERS", "OBJECTIVES", "LAYOUT_MODES"]
