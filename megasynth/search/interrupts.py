"""Ctrl-C in a search: the main process alone decides what an interrupt does. The worker processes it spawns start
with SIGINT blocked (`interrupts_held`), so Ctrl-C in a terminal, which signals the whole process group, does not
make each of them print a KeyboardInterrupt traceback; the main process records it (`InterruptWatch`) and stops at
its next loop step, then stops the workers and says what the run kept."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT blocked in this thread while open. A process spawned meanwhile inherits the blocked mask through its
    exec, and Python leaves it so: Ctrl-C never reaches it, from its first instruction on, before its imports. An
    interrupt that arrives inside is held, not lost: it is delivered here when the block closes. Open it only
    around a spawn."""
    if not hasattr(signal, "pthread_sigmask"):  # (no signal masks: Windows)
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class InterruptWatch:
    """Ctrl-C in the search's main process, while open (from the main thread; elsewhere it does nothing). Python's
    own handler raises KeyboardInterrupt wherever the main thread is: inside a database transaction, whose
    connection then holds its lock while the interrupted search tries to give its claims back, or inside a weakref
    callback, which prints it and loses it. So the first Ctrl-C is only recorded, and `check`, called once a loop
    step where no transaction is open, raises it; a second one raises at once (and if Python swallows that one,
    `check` raises it too, and its "Exception ignored" report is left out)."""

    def __init__(self) -> None:
        self.hit = False
        self._previous: Any = None
        self._hook: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True
        # (os.write: a handler that prints through sys.stderr can interrupt a write to it)
        os.write(2, b"\ninterrupt: stopping at the next candidate (Ctrl-C again: at once)\n")

    def _unraisable(self, unraisable: Any) -> None:
        if not (self.hit and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._hook(unraisable)

    def __enter__(self) -> InterruptWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._hook

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came, even where the first one was swallowed."""
        if self.hit:
            raise KeyboardInterrupt
