"""normkit.bench.timing and core.time_group: what a sample holds (the calls between two waits),
what is timed, and the rows of both timings; on a fake clock, so that every figure is exact."""

from __future__ import annotations

from typing import Any

import pytest

from normkit.bench import timing
from normkit.bench.core import TOKEN_SHAPE, Group, Sweep, time_group

CALL, WAIT = 1.0, 100.0
"""What a call and a wait for the device cost on the fake clock."""


class Fake:
    """A clock that only calls and waits advance, and the log of what ran."""

    def __init__(self) -> None:
        self.now = 0.0
        self.log: list[str] = []

    def perf_counter(self) -> float:
        return self.now

    def candidate(self, name: str) -> Any:
        def call() -> str:
            self.now += CALL
            self.log.append(name)
            return f"{name} result {self.log.count(name)}"
        return call

    def wait(self, result: object) -> None:
        self.now += WAIT
        self.log.append(f"wait for {result}")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    clock = Fake()
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    return clock


def _samples(log: list[str]) -> list[list[str]]:
    """The calls between consecutive waits."""
    found, current = [], []
    for entry in log:
        if entry.startswith("wait for "):
            found.append(current)
            current = []
        else:
            current.append(entry)
    return found


def test_latency_waits_after_every_call(fake: Fake) -> None:
    timings = timing.interleaved({"a": fake.candidate("a"), "b": fake.candidate("b")},
                                 warmup=1, repeats=4, wait=fake.wait)
    assert all(len(calls) == 1 for calls in _samples(fake.log))
    assert len(_samples(fake.log)) == 2 * (1 + 4)
    for t in timings.values():
        assert (t.median_s, t.min_s, t.max_s, t.repeats, t.calls) == (CALL + WAIT, CALL + WAIT,
                                                                       CALL + WAIT, 4, 1)
        assert t.host_s == CALL  # read when the call returns, before the wait


def test_throughput_issues_its_calls_back_to_back_between_two_waits(fake: Fake) -> None:
    """Each timed sample of a candidate is ``calls`` of its calls in a row, then one wait on the
    last one's result; the time per call divides the wait among them."""
    timings = timing.interleaved({"a": fake.candidate("a"), "b": fake.candidate("b")},
                                 warmup=0, repeats=3, calls={"a": 50, "b": 7}, wait=fake.wait)
    samples = _samples(fake.log)
    assert [len(s) for s in samples] == [7, 50, 50, 7, 7, 50]  # the order reversed every round
    assert all(len(set(s)) == 1 for s in samples)  # one candidate's calls only
    waits = [entry for entry in fake.log if entry.startswith("wait for ")]
    assert waits[:2] == ["wait for b result 7", "wait for a result 50"]  # the last call's result
    assert timings["a"].median_s == pytest.approx((50 * CALL + WAIT) / 50)
    assert timings["b"].median_s == pytest.approx((7 * CALL + WAIT) / 7)
    assert timings["a"].host_s == timings["b"].host_s == pytest.approx(CALL)
    assert (timings["a"].calls, timings["b"].calls, timings["a"].repeats) == (50, 7, 3)


def test_a_stopwatch_times_each_sample_and_gets_its_last_result(fake: Fake) -> None:
    """A device's own clock (CUDA events) replaces the host's: started before a sample's first
    call, stopped after its last with that call's result; it does the waiting."""
    events: list[tuple[str, object]] = []

    class Events:
        def start(self) -> None:
            events.append(("start", None))

        def stop(self, result: object) -> float:
            events.append(("stop", result))
            return 0.5

    timings = timing.interleaved({"a": fake.candidate("a")}, warmup=0, repeats=2, calls=10,
                                 stopwatch=Events())
    assert events == [("start", None), ("stop", "a result 10"), ("start", None),
                      ("stop", "a result 20")]
    assert timings["a"].median_s == pytest.approx(0.05) and timings["a"].host_s == CALL


def test_calls_per_sample_must_be_positive(fake: Fake) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        timing.interleaved({"a": fake.candidate("a")}, calls=0)


def test_a_group_is_timed_in_both_timings_each_against_its_own_copy_floor(fake: Fake) -> None:
    """time_group: latency first, then throughput with the calls the sweep gives each
    candidate's latency median; ratios and fractions within each timing."""
    sweep = Sweep.make(quick=True)
    shape = sweep.shapes()[0]
    group = Group("torch", "cpu", "forward", "eager", shape, "float32")
    calls: dict[str, int] = {}

    def candidate(name: str, cost: float) -> Any:
        def call() -> None:
            fake.now += cost
            calls[name] = calls.get(name, 0) + 1
        return call

    rows = time_group(group, sweep, {"normkit.torch.RMSNorm": candidate("n", 0.0015),
                                     "torch.nn.RMSNorm": candidate("t", 0.0045)},
                      ("copy (clone)", candidate("c", 0.0035)))
    by = {(r["timing"], r["implementation"]): r for r in rows}
    assert len(rows) == 6 and {t for t, _ in by} == {"latency", "throughput"}
    ours, theirs = by["latency", "normkit.torch.RMSNorm"], by["throughput", "torch.nn.RMSNorm"]
    assert ours["median_s"] == pytest.approx(0.0015) and ours["calls"] == 1
    assert ours["ratios"] == {"torch.nn.RMSNorm": pytest.approx(3.0)}
    assert ours["fraction_of_copy_floor"] == pytest.approx(0.0035 / 0.0015)
    # as many calls as fill the quick sweep's 20 ms: 13, 4 and 5
    assert theirs["calls"] == sweep.calls("cpu", shape, 0.0045) == 4
    assert by["throughput", "normkit.torch.RMSNorm"]["calls"] == 13
    assert by["throughput", "copy (clone)"]["calls"] == 5
    assert by["throughput", "copy (clone)"]["ratios"] == {}
    warmup, latency, throughput = sweep.warmup, sweep.repeats, sweep.throughput_repeats
    assert calls == {"n": warmup + latency + 13 * throughput, "t": warmup + latency + 4 * throughput,
                     "c": warmup + latency + 5 * throughput}


def test_one_timing_alone_probes_the_call_time_for_throughput(fake: Fake) -> None:
    sweep = Sweep.make(quick=True, timings=["throughput"])
    group = Group("jax", "cpu", "forward", "jax.jit", TOKEN_SHAPE, "float32")
    rows = time_group(group, sweep, {"normkit.jax.RMSNorm": fake.candidate("n")},
                      ("copy (jnp.copy)", fake.candidate("c")), wait=fake.wait)
    assert [(r["timing"], r["calls"]) for r in rows] == [("throughput", 50)] * 2
    assert rows[0]["median_s"] == pytest.approx((50 * CALL + WAIT) / 50)
