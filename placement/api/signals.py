"""SIGINT and SIGTERM around a solve: stop the solver, keep its best placement."""

from __future__ import annotations

import signal
import socket
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["Interrupted", "SignalStop"]


class Interrupted(KeyboardInterrupt):
    """A signal arrived when there was nothing worth saving (or a second one arrived).

    ``signum`` is the signal; ``exit_code`` the shell convention ``128 + signum`` (130 for
    SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class SignalStop:
    """While active, SIGINT and SIGTERM ask a solve to stop instead of killing the process.

    A context manager for the main thread of a program that embeds :func:`solve` (the CLI uses
    it).  Pass :attr:`event` as ``solve(stop_event=...)`` and set :attr:`armed` just before
    solving.  Then:

    - a signal before the solve (``armed`` False) raises :class:`Interrupted` at once: nothing has
      been found that is worth saving;
    - the first signal once armed only sets :attr:`event`: the solver returns the best complete
      placement found so far and the caller checks, scores and writes it;
    - a second signal raises :class:`Interrupted` wherever the main thread is (an atomic write in
      progress removes its temporary file, so no partial file appears).

    Python runs signal handlers only between bytecodes of the main thread, which may sit in C
    code for a long time (CP-SAT's ``solve``).  So a helper thread also reads the signal numbers
    from :func:`signal.set_wakeup_fd` and sets :attr:`event` at once; solvers relay it to C code
    with :func:`solvers.base.call_on_stop`.  Outside the main thread the handlers cannot be
    installed and only :attr:`event` is provided.  Previous handlers are restored on exit.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.event = threading.Event()
        self.armed = False
        self.signum: int | None = None  # the first signal received
        self._count = 0
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd = -1
        self._socks: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.signals:
            self._old_handlers[s] = signal.signal(s, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._socks = (reader, writer)
        self._old_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="placement-signal-watch", daemon=True)
        self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._socks is None:
            return
        signal.set_wakeup_fd(self._old_wakeup_fd)
        for s, old in self._old_handlers.items():
            signal.signal(s, old)
        reader, writer = self._socks
        try:
            writer.send(b"\0")  # wakes the watcher: no signal has number 0
        except OSError:
            pass
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        reader.close()
        writer.close()
        self._socks = None

    @property
    def exit_code(self) -> int:
        """``128 + signum`` of the first signal (0 if none arrived)."""
        return 0 if self.signum is None else 128 + self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._count += 1
        if self.signum is None:
            self.signum = signum
        self.event.set()
        if not self.armed or self._count > 1:
            raise Interrupted(self.signum)

    def _watch(self) -> None:
        assert self._socks is not None
        reader = self._socks[0]
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for byte in data:
                if byte == 0:
                    return
                if byte in self.signals and self.armed:
                    self.event.set()
