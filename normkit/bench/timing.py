"""Side-by-side timing: several callables measured in one interleaved loop.

Shared machines drift; timing candidates in alternation, round after round, makes the drift hit
all of them, so the ratios between their medians are fair even when the absolute times wander.
The order is reversed every other round: the first candidate of a round runs a few percent
slower (caches, frequency), and that must not fall on one candidate only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Median and spread of one candidate's repeated runs, in seconds."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    sync: Callable[[], object] | None = None,
    min_time_s: float = 0.0,
) -> dict[str, Timing]:
    """Time each candidate ``repeats`` times, alternating between them every round.

    Args:
      candidates: name -> a callable that runs the work once. It must finish the work before
        returning, or ``sync`` must wait for it (e.g. ``torch.cuda.synchronize``; for JAX the
        callable should call ``block_until_ready``).
      warmup: untimed rounds first (compilation, caches, allocator).
      repeats: timed rounds at least.
      sync: called after each run, inside the timed region.
      min_time_s: keep adding rounds until each candidate has run this long in total.
    """
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
            if sync is not None:
                sync()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    while True:
        order.reverse()
        for name, fn in order:
            start = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            samples[name].append(time.perf_counter() - start)
        rounds = len(next(iter(samples.values())))
        if rounds >= repeats and all(sum(s) >= min_time_s for s in samples.values()):
            break
    return {
        name: Timing(statistics.median(s), min(s), max(s), len(s)) for name, s in samples.items()
    }
