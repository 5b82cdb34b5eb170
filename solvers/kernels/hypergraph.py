"""The hypergraph partitioner (Mt-KaHyPar) as a kernel: its runtime, its context, and KM1.

Shared by the peer baseline :mod:`solvers.kahypar` and the expert search's partitioner start
(:func:`solvers.experts.coarsen.kahypar_start`), so that neither imports the other.  ``mtkahypar``
is an optional extra (``pip install -e '.[peers]'``); it is imported only when a partition runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from placement.core.model import InvalidInputError, SolverError
from placement.predict.cost import remote_domains_per_token

__all__ = ["RUNTIME", "km1", "repair_capacities", "partition_context"]


def _mtkahypar() -> Any:
    try:
        import mtkahypar
    except ImportError as exc:
        raise SolverError(
            "solver 'kahypar' needs Mt-KaHyPar, an optional extra: pip install -e '.[peers]'"
        ) from exc
    if not all(hasattr(mtkahypar, name) for name in ("initialize", "set_seed", "PresetType", "Objective")):
        version = getattr(mtkahypar, "__version__", "unknown")
        raise SolverError(
            f"solver 'kahypar' needs Mt-KaHyPar's Python API with initialize()/context_from_preset() "
            f"(tested with 1.7), found mtkahypar {version}: pip install -U mtkahypar"
        )
    return mtkahypar


class _MtKaHyParRuntime:
    """Mt-KaHyPar's per-process state: ``mtkahypar.initialize`` starts a thread pool once per
    process, so its initializer is kept per thread count for the life of the process."""

    def __init__(self) -> None:
        self._by_threads: dict[int, Any] = {}

    def initializer(self, num_threads: int) -> Any:
        if num_threads not in self._by_threads:
            self._by_threads[num_threads] = _mtkahypar().initialize(num_threads, False)
        return self._by_threads[num_threads]


RUNTIME = _MtKaHyParRuntime()


def km1(nets: np.ndarray, weights: np.ndarray, vertex2block: np.ndarray) -> int:
    """Weighted connectivity-minus-one of a partition.

    Parameters
    ----------
    nets : (num_nets, pins) vertex ids (equal-size nets; a repeated pin counts once).
    weights : (num_nets,) net weights.
    vertex2block : (num_vertices,) block of each vertex.

    Examples
    --------
    >>> km1(np.array([[0, 1, 2], [0, 0, 1]]), np.array([3, 1]), np.array([0, 1, 1]))
    4
    """
    blocks = np.asarray(vertex2block)[np.asarray(nets)]
    if blocks.shape[1] < 2:
        return 0
    # distinct blocks - 1 = the blocks other than the first pin's (the evaluator's remote-domain count)
    return int((remote_domains_per_token(blocks[:, 1:], blocks[:, 0]) * np.asarray(weights)).sum())


def repair_capacities(
    nets: np.ndarray, weights: np.ndarray, vertex2block: np.ndarray, movable: np.ndarray, capacities: np.ndarray
) -> np.ndarray:
    """Move movable vertices out of over-full blocks, each time the move with the least KM1 increase.

    Parameters
    ----------
    nets, weights : as from :func:`layer_nets`.
    vertex2block : (num_vertices,) block of each vertex.
    movable : (num_movable,) ids of the unit-weight vertices that may move (the experts).
    capacities : (k,) how many movable vertices each block may hold; ``sum >= len(movable)``.

    Returns
    -------
    (num_vertices,) int64 block of each vertex, every block within its capacity.
    """
    v2b = np.array(vertex2block, dtype=np.int64)
    cap = np.asarray(capacities, dtype=np.int64)
    k = len(cap)
    if int(cap.sum()) < len(movable):
        raise InvalidInputError(f"repair_capacities: {len(movable)} vertices do not fit capacities {cap.tolist()}")
    count = np.bincount(v2b[movable], minlength=k)
    if (count <= cap).all():
        return v2b
    num_nets = len(nets)
    # pins[n, b]: pins of net n in block b (a repeated vertex counts once).
    uniq = [np.unique(row) for row in nets]
    pins = np.zeros((num_nets, k), dtype=np.int64)
    incident: dict[int, list[int]] = {int(v): [] for v in movable}
    for n, row in enumerate(uniq):
        for v in row:
            pins[n, v2b[v]] += 1
            if int(v) in incident:
                incident[int(v)].append(n)
    inc = {v: np.array(ns, dtype=np.int64) for v, ns in incident.items()}
    while (count > cap).any():
        best: tuple[int, int, int, int] | None = None  # (delta, vertex, from, to)
        for a in np.flatnonzero(count > cap):
            for v in movable[v2b[movable] == a]:
                ns = inc[int(v)]
                w = weights[ns]
                leave = int((w * (pins[ns, a] == 1)).sum())
                for b in np.flatnonzero(count < cap):
                    delta = int((w * (pins[ns, b] == 0)).sum()) - leave
                    if best is None or delta < best[0]:
                        best = (delta, int(v), int(a), int(b))
        assert best is not None  # some block has room: sum(cap) >= len(movable)
        _, mv, src, dst = best
        ns = inc[mv]
        pins[ns, src] -= 1
        pins[ns, dst] += 1
        v2b[mv] = dst
        count[src] -= 1
        count[dst] += 1
    return v2b


def partition_context(mtk_module: Any, init: Any, k: int, capacities: np.ndarray) -> Any:
    presets = mtk_module.PresetType
    preset = getattr(presets, "DETERMINISTIC_QUALITY", presets.DETERMINISTIC)
    ctx = init.context_from_preset(preset)
    ctx.set_partitioning_parameters(k, 0.0, mtk_module.Objective.KM1)
    ctx.set_individual_target_block_weights([int(c) for c in capacities])
    ctx.logging = False
    return ctx
