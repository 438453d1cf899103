"""One progress display for long work (conformance, bench), with an estimate of the time left.

On a terminal it is a `rich` progress bar (imported only then); elsewhere (CI logs) a plain line
at every tenth of the steps, and at least once a minute. Steps may weigh differently (a
compiled target's case takes many times an eager one's): the estimate of the time left is the
time so far scaled by the weight left over the weight done.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

LINE_EVERY = 60.0
"""Off a terminal, the most seconds between two lines."""


class Progress:
    """Progress over ``total`` steps of total weight ``work`` (default one a step; both may
    grow, see `add`), drawn on ``stream``."""

    def __init__(
        self,
        description: str,
        total: int = 0,
        stream: IO[str] | None = None,
        *,
        work: float | None = None,
    ) -> None:
        self.description = description
        self.total, self.done = total, 0
        self.work = float(total if work is None else work)
        self.work_done = 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.last_tenth, self.last_line = 0, self.started
        self.bar: Any = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[left]}"),
                TextColumn("{task.fields[label]}"), console=Console(file=self.stream),
            )
            self.task = self.bar.add_task(description, total=total or None, label="", left="")
            self.bar.start()

    def add(self, steps: int, work: float | None = None) -> None:
        """``steps`` more to do, of weight ``work`` (default ``steps``)."""
        self.total += steps
        self.work += steps if work is None else work
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def left(self) -> float:
        """The estimated seconds left: the time so far, times the weight left over the weight
        done."""
        elapsed = time.perf_counter() - self.started
        return elapsed * max(self.work - self.work_done, 0.0) / max(self.work_done, 1e-9)

    def advance(self, label: str, by: int = 1, work: float | None = None) -> None:
        """``by`` steps done, of weight ``work`` (default ``by``); ``label`` says what the last
        one was."""
        self.done += by
        self.work_done += by if work is None else work
        if self.bar is not None:
            left = f"about {_duration(self.left())} left"
            self.bar.update(self.task, advance=by, label=label, left=left)
            return
        total = max(self.total, self.done)
        tenth = 10 * self.done // total
        now = time.perf_counter()
        if tenth > self.last_tenth or now - self.last_line >= LINE_EVERY:
            self.last_tenth, self.last_line = tenth, now
            elapsed = now - self.started
            self.stream.write(
                f"{self.description}: {self.done}/{total}, {elapsed:.0f} s, about "
                f"{_duration(self.left())} left ({label})\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _duration(seconds: float) -> str:
    """``seconds`` as ``"42 s"`` below two minutes, else ``"12 min"``."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
