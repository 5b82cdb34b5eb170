"""Executors: where a batch of independent, deterministic tasks runs (one machine or a cluster).

``placement plan`` solves its candidate layouts through this interface, so that the same sweep
runs in a local process pool or fans out over a Ray cluster (:mod:`placement.core.ray_executor`, the
``ray`` extra).  An executor only decides *where* ``fn(item)`` runs: results come back in the
items' order, and every task is deterministic on its own (seeds and work budgets travel inside
the item), so a plan is byte-identical whichever executor and however many workers ran it.

>>> from placement.core.executor import make_executor
>>> ex = make_executor("local", workers=1)
>>> ex.map(abs, [-1, 2, -3])
[1, 2, 3]
>>> ex.close()
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Protocol, Sequence, TypeVar

from placement.core.model import InvalidInputError

__all__ = ["Executor", "LocalExecutor", "EXECUTOR_NAMES", "make_executor", "default_workers"]

T = TypeVar("T")
R = TypeVar("R")

EXECUTOR_NAMES: tuple[str, ...] = ("local", "ray")
MAX_EXECUTOR_WORKERS = 1024


def _cgroup_cpu_limit() -> int | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max``: ``quota period``), or None if unlimited."""
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def default_workers() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (containers)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = max(1, os.cpu_count() or 1)
    limit = _cgroup_cpu_limit()
    return cores if limit is None else min(cores, limit)



class Executor(Protocol):
    """Runs ``fn`` on every item; results in the items' order.

    ``fn`` must be a module-level function and the items picklable (they may cross a process or a
    machine boundary).  An exception raised by ``fn`` is re-raised by :meth:`map`.
    """

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]: ...

    def close(self) -> None: ...


class LocalExecutor:
    """A process pool on this machine (``workers`` processes, default: the usable cores).

    ``workers=1`` runs every task in this process, in order (no pool, no pickling).  The pool uses
    the ``spawn`` start method: no forked copy of a caller's threads or locks.

    Parameters
    ----------
    workers : processes, ``[1, 1024]``; default :func:`default_workers`.
    """

    def __init__(self, workers: int | None = None) -> None:
        if workers is None:
            workers = default_workers()
        _check_workers(workers)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(x) for x in items]``, run on up to ``workers`` processes."""
        items = list(items)
        if self.workers == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        """Shut the pool down (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_workers(workers: object) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_EXECUTOR_WORKERS:
        raise InvalidInputError(f"workers: expected an integer in [1, {MAX_EXECUTOR_WORKERS}] or None, found {workers!r}")


def make_executor(name: str = "local", *, workers: int | None = None, address: str | None = None) -> Executor:
    """The executor called ``name``: ``local`` (:class:`LocalExecutor`) or ``ray``.

    Parameters
    ----------
    name : ``local`` or ``ray`` (imports :mod:`placement.core.ray_executor` only then).
    workers : processes (``local``) or CPUs to ask Ray for (``ray``, its ``num_cpus``).
    address : the Ray cluster's address (``ray`` only; ``None`` starts or joins a local one).

    Raises
    ------
    InvalidInputError
        An unknown name, bad ``workers``, an ``address`` for ``local``, or Ray not installed.
    """
    if workers is not None:
        _check_workers(workers)
    if name == "local":
        if address is not None:
            raise InvalidInputError("address: only the ray executor takes an address")
        return LocalExecutor(workers)
    if name == "ray":
        try:
            from placement.core.ray_executor import RayExecutor  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise InvalidInputError(
                f"executor: ray is not available ({exc}); install the ray extra: pip install 'placement[ray]'"
            ) from exc
        executor: Executor = RayExecutor(address=address, num_cpus=workers)
        return executor
    raise InvalidInputError(f"executor: expected one of {', '.join(EXECUTOR_NAMES)}, found {name!r}")
