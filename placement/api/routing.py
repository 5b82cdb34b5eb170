"""Recorded routing statistics (``placement import`` / ``placement stats``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from placement.core.model import Instance, InvalidInputError

__all__ = ["import_routing", "save_instance", "routing_stats", "routing_drift"]


def import_routing(
    source: str,
    traces: Sequence[str | os.PathLike[str]],
    *,
    base: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
    parallel: str | os.PathLike[str] | None = None,
    cluster: str | os.PathLike[str] | None = None,
    name: str | None = None,
    cost_mode: str | None = None,
    heldout_steps: int | None = None,
    max_tokens_per_source: int | None = None,
    windows: int = 1,
    on_progress: Callable[[int, int], None] | None = None,
) -> Instance:
    """An instance whose routing windows come from a stack's recorded traces.

    Parameters
    ----------
    source : ``megatron``, ``torchtitan``, ``sglang`` or ``vllm`` (README: "Bring your own
        routing statistics").
    traces : every rank's trace files, in any order.
    base : an instance JSON whose ``model``, ``parallel`` and ``cluster`` sections are used (its
        routing file is not read); ``model``, ``parallel``, ``cluster`` override one section each
        (a JSON of that section, or an instance file).
    name, cost_mode : default: the base's, else ``imported`` and ``per_domain``.
    heldout_steps : the last steps (forward passes, requests) that form the held-out window;
        default a quarter of them, at least one.
    max_tokens_per_source : cap on the tokens kept per source and window
        (default :data:`placement.sources.importers.DEFAULT_MAX_TOKENS_PER_SOURCE`).
    windows : cut the fit steps into this many time-ordered sampled windows
        (``routing.window_tokens``, what ``solve(fit=...)`` weighs); 1 = one sampled window.
    on_progress : called with ``(bytes of trace files read, bytes of all trace files)`` as they are
        scanned (a :data:`placement.core.progress.ProgressCallback`); it only observes.

    Returns
    -------
    Instance, ready for :func:`solve` and :func:`save_instance`.

    Raises
    ------
    InvalidInputError
        One line naming the file and record or field at fault (malformed or truncated traces, ids
        outside the experts, ranks outside the layout, steps with different layer sets, counts-only
        inputs).
    """
    from placement.sources.importers import DEFAULT_MAX_TOKENS_PER_SOURCE, import_instance

    return import_instance(
        source,
        traces,
        base=base,
        model=model,
        parallel=parallel,
        cluster=cluster,
        name=name,
        cost_mode=cost_mode,
        heldout_steps=heldout_steps,
        max_tokens_per_source=DEFAULT_MAX_TOKENS_PER_SOURCE if max_tokens_per_source is None else max_tokens_per_source,
        windows=windows,
        on_progress=on_progress,
    )


def save_instance(instance: Instance, path: str | os.PathLike[str]) -> None:
    """Write an instance as ``path`` (JSON) and ``path`` with suffix ``.npz``, each atomically."""
    from placement.formats import write_instance

    write_instance(instance, path)


def routing_stats(instance: Instance, *, distance: int = 1) -> dict[str, Any]:
    """The routing statistics ``placement stats`` prints (see :func:`placement.core.stats.routing_stats`)."""
    from placement.core.stats import routing_stats as _stats

    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 1:
        raise InvalidInputError(f"distance: expected a positive integer, found {distance!r}")
    return _stats(instance, distance=distance)


def routing_drift(instance: Instance, other: Instance, *, where: str | None = None) -> dict[str, Any]:
    """How the routing of ``other`` differs from ``instance``'s on their fit windows (load TV, top-8
    partners kept; :func:`placement.core.stats.routing_drift`).

    Raises
    ------
    InvalidInputError
        The two instances do not have the same MoE layers and experts; the message starts with
        ``where`` (default: ``other``'s name).
    """
    from placement.core.stats import routing_drift as _drift

    try:
        return _drift(instance, other)
    except ValueError as exc:
        raise InvalidInputError(f"{other.name if where is None else where}: {exc}") from None
