"""Progress of long work on a terminal: the one mechanism every command shares.

The library never prints: a long routine takes an optional callback (``on_progress(done, total)``,
a :data:`ProgressCallback`, called in the calling process as work finishes) and the command line
opens a bar with :func:`progress` and passes the bar's :meth:`Progress.report` as that callback
(or calls :meth:`Progress.update` with the work just finished).

A bar is drawn (by tqdm, on standard error) only when standard error is a terminal and the command
was not told to be quiet.  The environment variable ``PLACEMENT_PROGRESS`` overrides the terminal
test: ``1`` draws the bar whatever standard error is (tests use it to draw into a pipe), ``0``
never draws it; ``quiet=True`` wins over both.  Nothing here touches an output file, and the work
only reports to a bar, never reads from it, so what a command writes is the same with or without
one.

>>> with progress(3, "layers", "layer", quiet=True) as bar:
...     for _ in range(3):
...         bar.update()
>>> bar.n
3
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, NoReturn, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["ENV_VAR", "Progress", "ProgressCallback", "progress", "progress_enabled"]

ENV_VAR = "PLACEMENT_PROGRESS"
"""``1`` forces bars on (even into a pipe), ``0`` forces them off; unset: on a terminal only."""

ProgressCallback = Callable[[int, int], None]
"""``on_progress(done, total)``: work finished so far and work expected (layers, candidates, bytes)."""


def progress_enabled(*, quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default: standard error).

    Parameters
    ----------
    quiet : the command's ``--quiet``; wins over everything else.
    stream : where the bar would be drawn.

    Returns
    -------
    bool : False when quiet or ``PLACEMENT_PROGRESS=0``; True when ``PLACEMENT_PROGRESS=1``;
        otherwise whether ``stream`` is a terminal.
    """
    if quiet:
        return False
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced == "0":
        return False
    if forced == "1":
        return True
    out = sys.stderr if stream is None else stream
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False


class Progress:
    """A progress bar, or nothing when bars are off; counts the work reported either way.

    Attributes
    ----------
    n : work reported so far (in the bar's unit).
    total : the work expected, or None when unknown (the bar then shows a count and a rate).
    active : whether a bar is drawn.
    """

    def __init__(self, total: int | None, desc: str, unit: str, *, active: bool, unit_scale: bool,
                 stream: TextIO | None) -> None:
        self.n = 0
        self.total = total
        self.active = active
        self._stream = sys.stderr if stream is None else stream
        self._bar: tqdm[NoReturn] | None = None
        if active:
            from tqdm import tqdm  # here: a quiet run never loads it

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=self._stream,
                             leave=False, dynamic_ncols=True, mininterval=0.2)

    def update(self, n: int = 1) -> None:
        """Report ``n`` more units of finished work (usable as a :data:`ProgressCallback`)."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def report(self, done: int, total: int | None = None) -> None:
        """Work finished so far (and, when given, expected): a :data:`ProgressCallback`."""
        if total is not None and total != self.total:
            self.set_total(total)
        if done != self.n:
            self.update(done - self.n)

    def set_total(self, total: int | None) -> None:
        """Change the work expected (known only once the work is under way, e.g. a file's size)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def write(self, message: str) -> None:
        """Print a one-line message above the bar when a bar is drawn (nothing otherwise)."""
        if self._bar is not None:
            self._bar.write(message, file=self._stream)

    def close(self) -> None:
        """Draw the final figures, then remove the bar from the terminal (idempotent)."""
        if self._bar is not None:
            self._bar.refresh()  # the final figures, whatever the refresh interval skipped
            self._bar.close()
            self._bar = None


@contextmanager
def progress(total: int | None, desc: str, unit: str = "it", *, quiet: bool = False,
             unit_scale: bool = False, stream: TextIO | None = None) -> Iterator[Progress]:
    """A bar for one piece of long work, drawn only where :func:`progress_enabled` says so.

    Parameters
    ----------
    total : the work expected (e.g. layers to solve, candidates to score, bytes to read), or None.
    desc : what is being done, shown left of the bar (e.g. ``"solve: layers"``).
    unit : the unit of ``total`` (``"layer"``, ``"candidate"``, ``"B"``).
    quiet : the command's ``--quiet``: no bar.
    unit_scale : show large counts with SI prefixes (for bytes: ``1.2 GB``).
    stream : where to draw (default: standard error).

    Yields
    ------
    Progress : call ``.update(n)`` as work finishes; the bar is removed on leaving the block.
    """
    bar = Progress(total, desc, unit, active=progress_enabled(quiet=quiet, stream=stream),
                   unit_scale=unit_scale, stream=stream)
    try:
        yield bar
    finally:
        bar.close()
