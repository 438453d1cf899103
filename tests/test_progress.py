"""The progress display off a terminal: a line per tenth of the work, with the time left."""

import io
import re

from normkit.progress import Progress


def test_a_line_per_tenth_with_an_estimate_of_the_time_left():
    stream = io.StringIO()
    progress = Progress("conformance", 5, stream=stream)
    progress.add(15)  # the total may grow once a worker says how many devices it sees
    for i in range(20):
        progress.advance(f"case {i}")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert re.fullmatch(r"conformance: 2/20, \d+ s, about \d+ s left \(case 1\)", lines[0])
    assert re.fullmatch(r"conformance: 20/20, \d+ s, about 0 s left \(case 19\)", lines[-1])


class _Clock:
    """A stand-in for time.perf_counter that the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_estimate_weighs_each_step(monkeypatch):
    """Two cheap steps done in 2 s leave two steps of eight times their weight: 16 s left, where
    counting steps would say 2 s."""
    clock = _Clock()
    monkeypatch.setattr("normkit.progress.time.perf_counter", clock)
    stream = io.StringIO()
    progress = Progress("conformance", 4, stream=stream, work=18.0)
    for _ in range(2):
        clock.now += 1.0
        progress.advance("eager", work=1.0)
    assert progress.left() == 16.0
    clock.now += 16.0
    progress.advance("compiled", work=8.0)
    assert progress.left() == 18.0 * 8.0 / 10.0
    progress.add(1, work=8.0)  # one more compiled step: a second device
    assert progress.left() == 18.0 * 16.0 / 10.0
    lines = stream.getvalue().splitlines()
    assert lines[1] == "conformance: 2/4, 2 s, about 16 s left (eager)"
    assert lines[2] == "conformance: 3/4, 18 s, about 14 s left (compiled)"


def test_a_line_at_least_once_a_minute(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("normkit.progress.time.perf_counter", clock)
    stream = io.StringIO()
    progress = Progress("conformance", 1000, stream=stream)
    clock.now += 61.0
    progress.advance("slow")
    clock.now += 30.0
    progress.advance("slow")
    clock.now += 150.0
    progress.advance("slow")
    assert stream.getvalue().splitlines() == [
        "conformance: 1/1000, 61 s, about 1016 min left (slow)",
        "conformance: 3/1000, 241 s, about 1335 min left (slow)",
    ]
