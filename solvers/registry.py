"""The solver registry: names -> solve functions (the choices of ``placement.solve(solver=...)``)."""

from __future__ import annotations

from typing import Callable

from solvers.base import Solver

__all__ = ["SOLVERS", "register", "get_solver"]

SOLVERS: dict[str, Solver] = {}


def register(name: str) -> Callable[[Solver], Solver]:
    def deco(fn: Solver) -> Solver:
        if name in SOLVERS:
            raise ValueError(f"solver {name!r} registered twice")
        SOLVERS[name] = fn
        return fn

    return deco


def get_solver(name: str) -> Solver:
    from placement.core.model import InvalidInputError

    try:
        return SOLVERS[name]
    except KeyError:
        raise InvalidInputError(f"solver: unknown solver {name!r} (choose from {', '.join(sorted(SOLVERS))})") from None
