"""How a long ``normkit`` command stops: SIGTERM (a time limit's kill) is handled as Ctrl-C,
so that the command can still write the part of its report it has, and exits `INTERRUPTED`.

Used by ``normkit bench`` and ``normkit conformance``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

#: The exit status of an interrupted command, as a shell reports Ctrl-C's.
INTERRUPTED = 130

T = TypeVar("T")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interruptible(work: Callable[[], T]) -> T:
    """``work()`` with SIGTERM raising KeyboardInterrupt in it, as Ctrl-C does (main thread);
    SIGTERM's handler is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, previous)
