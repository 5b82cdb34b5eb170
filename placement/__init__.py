"""placement: topology-aware expert placement for Mixture-of-Experts training.

The public API (see :mod:`placement.api`): :func:`load_instance`, :func:`solve`,
:func:`evaluate_placement`, :func:`save_result`; the model in :mod:`placement.model`; the cost
model in :mod:`placement.cost`.
"""

from placement.api import (
    DEFAULT_SOLVER,
    evaluate_placement,
    load_instance,
    load_placement,
    result_document,
    save_result,
    solve,
)
from placement.model import (
    InfeasibleError,
    Instance,
    InvalidInputError,
    Placement,
    PlacementError,
    SolverError,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOLVER",
    "load_instance",
    "load_placement",
    "solve",
    "evaluate_placement",
    "save_result",
    "result_document",
    "Instance",
    "Placement",
    "PlacementError",
    "InvalidInputError",
    "InfeasibleError",
    "SolverError",
]
