"""Side-by-side timing: several callables measured in one interleaved loop.

Shared machines drift; timing candidates in alternation, round after round, makes the drift hit
all of them, so the ratios between their medians are fair even when the absolute times wander.
The order is reversed every other round: the first candidate of a round runs a few percent
slower (caches, frequency), and that must not fall on one candidate only.

A sample is ``calls`` back-to-back calls of one candidate between two waits for the device:
one call (latency: the wait after each call exposes its host time) or many (throughput: the
host queues the next call while the device runs the last, as a training loop does). Its time
per call is the sample's time over ``calls``; so is its host time, read when the last call
returns, before the wait.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

Wait = Callable[[object], object]
"""Blocks until a call's result, and all the work queued before it, is computed."""


@dataclass(frozen=True)
class Timing:
    """One candidate's samples, per call, in seconds: median and spread of the sample times,
    the median host time, how many samples and how many calls each."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int
    calls: int = 1
    host_s: float = 0.0


class Stopwatch(Protocol):
    """Times one sample: `start` before its first call, `stop` after its last (given the last
    call's result), which waits for the work and returns the seconds between."""

    def start(self) -> None: ...
    def stop(self, result: object) -> float: ...


class HostStopwatch:
    """The host's clock (`time.perf_counter`), read after ``wait`` (None: the calls finish their
    work before they return)."""

    def __init__(self, wait: Wait | None = None) -> None:
        self.wait = wait
        self.began = 0.0

    def start(self) -> None:
        self.began = time.perf_counter()

    def stop(self, result: object) -> float:
        if self.wait is not None:
            self.wait(result)
        return time.perf_counter() - self.began


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    calls: int | Mapping[str, int] = 1,
    wait: Wait | None = None,
    stopwatch: Stopwatch | None = None,
    min_time_s: float = 0.0,
) -> dict[str, Timing]:
    """Time each candidate ``repeats`` samples of ``calls`` calls, alternating between them
    every round; the results per call.

    Args:
      candidates: name -> a callable that runs the work once and returns its result.
      warmup: untimed rounds first, one call and a wait each (compilation, caches, allocator).
      repeats: timed rounds at least.
      calls: calls per sample, for all candidates or per name: 1 times each call alone (a wait
        after each), more time them back to back between two waits.
      wait: given the last call's result, blocks until the work is done (e.g.
        ``jax.block_until_ready``, or a device synchronization); None where a call finishes its
        work before it returns.
      stopwatch: times a sample (default: `HostStopwatch` with ``wait``); it must wait for the
        work itself, e.g. CUDA events recorded around the calls.
      min_time_s: keep adding rounds until each candidate has run this long in total.
    """
    watch = stopwatch if stopwatch is not None else HostStopwatch(wait)
    count = {name: calls if isinstance(calls, int) else calls[name] for name in candidates}
    if any(n < 1 for n in count.values()):
        raise ValueError(f"calls per sample must be at least 1, got {count}")
    for _ in range(warmup):
        for fn in candidates.values():
            result = fn()
            if wait is not None:
                wait(result)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    hosts: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    while True:
        order.reverse()
        for name, fn in order:
            n = count[name]
            watch.start()
            began = time.perf_counter()  # after the stopwatch's start: the host's part is within
            result = None
            for _ in range(n):
                result = fn()
            hosts[name].append((time.perf_counter() - began) / n)
            samples[name].append(watch.stop(result) / n)
        rounds = len(next(iter(samples.values())))
        total = {name: sum(s) * count[name] for name, s in samples.items()}
        if rounds >= repeats and all(t >= min_time_s for t in total.values()):
            break
    return {
        name: Timing(statistics.median(s), min(s), max(s), len(s), count[name],
                     statistics.median(hosts[name]))
        for name, s in samples.items()
    }
