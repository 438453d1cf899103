"""normkit.workers: an interrupted parent leaves no worker behind."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from normkit import workers


def test_an_interrupted_parent_kills_its_worker_before_the_interrupt_goes_on() -> None:
    pids: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            workers.run("tests.helpers.sleeping_worker", {}, {}, lambda event: pids.append(event["pid"]))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    [pid] = pids
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(pid, 0)
