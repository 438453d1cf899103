"""One progress display for long work (conformance, bench), with an estimate of the time left.

On a terminal it is a `rich` progress bar (imported only then); elsewhere (CI logs) a plain line
at every tenth of the work.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


class Progress:
    """Progress over ``total`` steps (which may grow, see `add`), drawn on ``stream``."""

    def __init__(self, description: str, total: int = 0, stream: IO[str] | None = None) -> None:
        self.description = description
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.last_tenth = 0
        self.bar: Any = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                TextColumn("{task.fields[label]}"), console=Console(file=self.stream),
            )
            self.task = self.bar.add_task(description, total=total or None, label="")
            self.bar.start()

    def add(self, steps: int) -> None:
        """``steps`` more to do."""
        self.total += steps
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def advance(self, label: str, by: int = 1) -> None:
        """``by`` steps done; ``label`` says what the last one was."""
        self.done += by
        if self.bar is not None:
            self.bar.update(self.task, advance=by, label=label)
            return
        total = max(self.total, self.done)
        tenth = 10 * self.done // total
        if tenth > self.last_tenth:
            self.last_tenth = tenth
            elapsed = time.perf_counter() - self.started
            left = elapsed * (total - self.done) / self.done
            self.stream.write(
                f"{self.description}: {self.done}/{total}, {elapsed:.0f} s, about {left:.0f} s "
                f"left ({label})\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
