"""Run independent tasks (candidate solves of ``placement plan``) as Ray tasks.

:class:`RayExecutor` implements the executor protocol of :mod:`placement.core.executor`:
``map(fn, items)`` runs ``fn(item)`` for every item as one Ray task each and returns the results in
the items' order; ``close()`` ends what the executor started.  ``make_executor("ray", workers=N,
address=ADDR)`` (the CLI's ``--executor ray [--ray-address ADDR]``) builds it.

- Cluster: ``address`` given: ``ray.init(address=address)`` joins that cluster (``"auto"``: the
  one this machine belongs to); else a local Ray instance with ``num_cpus`` CPUs (``None``: Ray
  counts them).  If Ray is already initialised in this process, that session is used as it is.
  ``close()`` shuts Ray down only if this executor started it.  Workers' output is not streamed to
  this process (``log_to_driver=False``; it stays in Ray's session logs), so the caller's stdout
  (``--json``) carries only its own output; a task's error comes back as an exception (below).
- Tasks: ``fn`` must be importable by the workers (a module-level function of an installed
  module: every node needs ``placement`` installed at the same version) and the items picklable.
  Each task asks Ray for one CPU; results are identical to a local run when ``fn`` is
  deterministic (solves with the same seed and a deterministic work budget).
- Errors: an exception raised by ``fn`` in a task is re-raised in the caller, its class kept (so
  the CLI's exit codes hold), its message prefixed with ``task I:`` and ``task_index`` set on it;
  the remaining tasks are cancelled.  A task Ray itself loses (a worker killed, a node gone) raises
  :class:`~placement.core.model.SolverError` naming the task.
- Ray is an optional extra: ``pip install 'placement[ray]'``; without it constructing the executor
  raises :class:`~placement.core.model.InvalidInputError` with that hint (exit code 2 in the CLI).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence, TypeVar

from placement.core.model import InvalidInputError, SolverError

__all__ = ["RAY_MISSING", "RayExecutor"]

T = TypeVar("T")
R = TypeVar("R")

RAY_MISSING = "--executor ray needs the ray extra: pip install 'placement[ray]'"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise InvalidInputError(RAY_MISSING) from exc
    return ray


def _run_task(fn: Callable[[Any], Any], item: Any) -> tuple[bool, Any, str]:
    """One task's body on a Ray worker: ``(True, result, "")`` or ``(False, exception, traceback)``.

    The exception comes back as a value, not through Ray's own error wrapping, so the caller
    re-raises the task's own exception class.
    """
    try:
        return True, fn(item), ""
    except Exception as exc:
        return False, exc, traceback.format_exc()


def _with_index(exc: BaseException, index: int) -> BaseException:
    """``exc`` with ``task I:`` in front of its message and ``task_index`` set."""
    args = exc.args
    if args and isinstance(args[0], str):
        exc.args = (f"task {index}: {args[0]}", *args[1:])
    else:
        exc.args = (f"task {index}", *args)
    try:
        exc.task_index = index  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - exception classes with __slots__
        pass
    return exc


class RayExecutor:
    """The executor protocol over Ray tasks.

    Parameters
    ----------
    address : a Ray cluster to join (``ray.init(address=...)``); ``None``: start a local instance.
    num_cpus : CPUs of the local instance (ignored with ``address``; ``None``: all Ray sees).

    Raises
    ------
    InvalidInputError
        When Ray is not installed (the ``ray`` extra).
    """

    def __init__(self, *, address: str | None = None, num_cpus: int | None = None) -> None:
        ray = _import_ray()
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            if address is not None:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            self._started = True
        self._remote = ray.remote(num_cpus=1)(_run_task)
        self._closed = False

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(item) for item in items]``, each call a Ray task, results in the items' order."""
        if self._closed:
            raise SolverError("RayExecutor.map called after close()")
        ray = self._ray
        fn_ref = ray.put(fn)
        refs = [self._remote.remote(fn_ref, item) for item in items]
        results: list[R] = []
        for index, ref in enumerate(refs):
            try:
                ok, value, text = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self._cancel(refs[index + 1:])
                raise SolverError(f"task {index}: Ray lost the task: {type(exc).__name__}: {exc}") from exc
            if not ok:
                self._cancel(refs[index + 1:])
                raise _with_index(value, index) from RuntimeError(f"in the Ray task:\n{text}")
            results.append(value)
        return results

    def _cancel(self, refs: list[Any]) -> None:
        for ref in refs:
            try:
                self._ray.cancel(ref)
            except Exception:  # pragma: no cover - already finished or gone
                pass

    def close(self) -> None:
        """Shut Ray down if this executor started it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
