"""Run the conformance matrix over every target in worker processes, and compare pairwise."""

from __future__ import annotations

import itertools
import json
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from normkit import tolerances, workers
from normkit.conformance import batch_invariance, compare
from normkit.conformance.cases import Case
from normkit.conformance.result import Result
from normkit.conformance.targets import Target
from normkit.progress import Progress

WORKER = "normkit.conformance.worker"

PAIRWISE_FACTOR = 2.0

#: How often a group's worker is started again after a signal killed it (a framework's
#: segfault, the kernel's OOM killer); the cases it had not reported run in the new one.
RESTARTS = 3

#: How long an interrupted run waits for its workers to be killed and their threads to end.
STOP_WAIT_S = 10.0


@dataclass
class Pairwise:
    """How two targets' outputs agree over the cases both ran: worst error as a fraction of
    ``PAIRWISE_FACTOR`` times the tolerance, and how many cases exceed it."""

    a: str
    b: str
    cases: int = 0
    disagreements: int = 0
    worst: float = 0.0
    example: str = ""


@dataclass
class Report:
    """Everything one conformance run found."""

    results: list[Result]
    skipped_targets: dict[str, str]
    devices: dict[str, list[str]]
    targets: list[Target] = field(default_factory=list)
    identified: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_seconds: dict[str, float] = field(default_factory=dict)
    pairwise: list[Pairwise] = field(default_factory=list)
    seconds: float = 0.0
    restarts: list[str] = field(default_factory=list)
    batch_invariance: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per ``target@device``, per probe label (`normkit.conformance.batch_invariance.PROBES`):
    ``{"rows", "order", "position", "threads"}`` (True: invariant; ``threads`` None where it
    was not checked), or ``{"skip": reason}`` / ``{"error": message}``."""
    interrupted: bool = False
    """Stopped before every case ran (Ctrl-C, or SIGTERM under `normkit.interrupts`): the
    results are those of the cases that finished, and nothing is compared pairwise."""
    lean: list[str] = field(default_factory=list)
    """The targets that ran the lean default matrix (`normkit.conformance.cases.lean`)."""

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "FAIL"]

    @property
    def ran(self) -> list[Result]:
        """The results of the cases that ran (passed or failed)."""
        return [r for r in self.results if r.status != "SKIP"]


def _job(
    group: list[Target],
    planned: dict[str, list[Case]],
    devices: Sequence[str] | None,
    outdir: str | None,
    invariance: bool,
) -> dict[str, Any]:
    """The job of one worker: ``group``, targets that share a hook module and an environment."""
    return {
        "hook": group[0].hook,
        "targets": [
            {
                "name": t.name,
                "variant": dict(t.variant),
                "identify": t.claims is not None,
                "cases": [c.to_dict() for c in planned[t.name]],
                "batch_invariance": [
                    p.to_dict() for p in batch_invariance.probes(t.claims) if invariance
                ],
            }
            for t in group
        ],
        "devices": list(devices) if devices else None,
        "outdir": outdir,
    }


def run(
    targets: Sequence[Target],
    cases_for: Callable[[Target], list[Case]],
    *,
    devices: Sequence[str] | None = None,
    jobs: int = 2,
    pairwise: bool = True,
    invariance: bool = False,
    progress: bool = True,
) -> Report:
    """Run every target on its cases (``cases_for(target) -> list[Case]``) in worker processes.

    Args:
      targets: the implementations; one not installed is skipped with the reason.
      cases_for: the cases of each target.
      devices: only these device names (e.g. ``["cpu"]``); a name a backend lacks is a SKIP.
      jobs: how many workers run at once, at least 1. Targets that share a hook module and an
        environment share a worker (one framework import).
      pairwise: also compare every two targets' outputs on the cases both ran.
      invariance: also check each target's batch invariance on
        `normkit.conformance.batch_invariance.PROBES`.
      progress: show progress on stderr.

    A KeyboardInterrupt while the workers run stops them and returns the report of the cases
    that finished, with ``interrupted`` set.
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs} is invalid: at least one worker must run")
    start = time.perf_counter()
    skipped = {t.name: reason for t in targets if (reason := t.missing())}
    runnable = [t for t in targets if t.name not in skipped]
    planned = {t.name: cases_for(t) for t in runnable}
    cost = {t.name: t.cost for t in runnable}
    copies = max(1, len(devices or ()))
    per_device = sum(len(c) for c in planned.values())
    weight = sum(len(c) * cost[name] for name, c in planned.items())
    bar = Progress("conformance", per_device * copies, work=weight * copies) if progress else None
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    slots = threading.Semaphore(jobs)
    results: list[Result] = []
    seen_devices: dict[str, list[str]] = {}
    identified: dict[str, dict[str, Any]] = {}
    target_seconds: dict[str, float] = {}
    restarts: list[str] = []
    invariances: dict[str, dict[str, Any]] = {}
    stopping = threading.Event()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="normkit-conformance-") as outdir:
        groups: dict[tuple[str, str], list[Target]] = {}
        for t in runnable:
            groups.setdefault((t.hook, json.dumps(t.environment, sort_keys=True)), []).append(t)

        def work(group: list[Target]) -> None:
            error = "the worker did not finish"
            try:
                with slots:
                    run = _GroupRun(group, planned, devices, events.put)
                    for attempt in range(RESTARTS + 1):
                        if stopping.is_set():
                            break
                        kept = outdir if pairwise else None
                        job = _job(run.unfinished(), run.left, devices, kept, invariance)
                        error = workers.run(WORKER, job, group[0].environment, run.forward)
                        if not _killed(error) or attempt == RESTARTS or run.complete():
                            break
                        restarts.append(run.restart(error))
            finally:
                events.put({"done": [t.name for t in group], "error": error})

        threads = [threading.Thread(target=work, args=(g,), daemon=True) for g in groups.values()]
        for thread in threads:
            thread.start()
        finished = 0
        reported: dict[str, set[tuple[str, str]]] = {t.name: set() for t in runnable}
        try:
            while finished < len(groups):
                event = events.get()
                name = event.get("target", "")
                if "done" in event:
                    finished += 1
                    if event["error"]:
                        for crashed in event["done"]:
                            seen = seen_devices.get(crashed, list(devices or ["cpu"]))
                            lost = _crashed(
                                crashed, planned[crashed], seen, reported[crashed], event["error"]
                            )
                            results.extend(lost)
                            if bar is not None and lost:
                                bar.advance(f"{crashed} crashed", by=len(lost),
                                            work=len(lost) * cost[crashed])
                elif "devices" in event:
                    seen_devices[name] = event["devices"]
                    if bar is not None and not devices:
                        more = len(planned[name]) * (len(event["devices"]) - 1)
                        bar.add(more, work=more * cost[name])
                elif "identified" in event:
                    identified[name] = event["identified"]
                elif "batch_invariance" in event:
                    invariances[f"{name}@{event['device']}"] = event["batch_invariance"]
                elif "seconds" in event:
                    target_seconds[name] = target_seconds.get(name, 0.0) + event["seconds"]
                elif "status" in event:
                    result = Result.from_dict(event)
                    reported[name].add((result.case.id, result.device))
                    results.append(result)
                    if bar is not None:
                        bar.advance(f"{name} {result.device}", work=cost[name])
        except KeyboardInterrupt:
            interrupted = True
            stopping.set()
            _stop(threads)
        if bar is not None:
            bar.close()
        pairs = _pairwise(results, Path(outdir)) if pairwise and not interrupted else []
    seconds = time.perf_counter() - start
    return Report(
        results, skipped, seen_devices, list(targets), identified, target_seconds, pairs, seconds,
        restarts, invariances, interrupted,
    )


def _stop(threads: list[threading.Thread]) -> None:
    """Kill the workers until every thread that runs one has ended (their loops start no
    worker once stopping is set), for at most `STOP_WAIT_S`."""
    deadline = time.monotonic() + STOP_WAIT_S
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            workers.kill_running()
            thread.join(0.05)


def _killed(error: str) -> bool:
    """Whether a worker's error says a signal ended it (``exit status -11``: a segfault)."""
    return error.startswith("exit status -")


class _GroupRun:
    """What one group's workers have reported, so that a worker killed by a signal can be
    replaced by one that runs the rest.

    Events pass to ``put`` once: a restarted worker's repeated ``devices`` event is dropped.
    The case a killed worker was running is run again in the next one; if that one is killed on
    the same case as well, the case is reported as a FAIL naming the crashes and skipped.
    """

    def __init__(
        self,
        group: list[Target],
        planned: dict[str, list[Case]],
        devices: Sequence[str] | None,
        put: Callable[[dict[str, Any]], None],
    ) -> None:
        self.group = group
        self.left = {t.name: list(planned[t.name]) for t in group}
        self.wanted = list(devices) if devices else None
        self.put = put
        self.finished: set[str] = set()
        self.announced: set[str] = set()
        self.devices: dict[str, list[str]] = {}
        self.reported: set[tuple[str, str, str]] = set()
        self.crashed_on: tuple[str, str] | None = None

    def forward(self, event: dict[str, Any]) -> None:
        name = event.get("target", "")
        if "devices" in event:
            self.devices[name] = event["devices"]
            if name in self.announced:
                return
            self.announced.add(name)
        elif "status" in event:
            key = (name, event["case_id"], event["device"])
            if key in self.reported:  # a restarted worker ran its case again
                return
            self.reported.add(key)
        elif "seconds" in event:
            self.finished.add(name)
        self.put(event)

    def unfinished(self) -> list[Target]:
        return [t for t in self.group if t.name not in self.finished]

    def complete(self) -> bool:
        return not self.unfinished()

    def restart(self, error: str) -> str:
        """Drop the reported cases from ``left``; after a second crash on the same case, report
        it as failed. Returns the line the report shows."""
        first: tuple[str, Case] | None = None
        for target in self.unfinished():
            done = {(c, d) for t, c, d in self.reported if t == target.name}
            devices = self.wanted or self.devices.get(target.name, [])
            self.left[target.name] = [
                case for case in self.left[target.name]
                if not devices or any((case.id, d) not in done for d in devices)
            ]
            if first is None and self.left[target.name]:
                first = (target.name, self.left[target.name][0])
        if first is None:
            return f"{', '.join(t.name for t in self.group)}: {error}; nothing left to run"
        name, case = first
        if self.crashed_on == (name, case.id):
            self.left[name].pop(0)
            for device in self.wanted or self.devices.get(name, ["cpu"]):
                if (name, case.id, device) not in self.reported:
                    reason = f"the worker was killed twice running this case: {error}"
                    self.put(Result(name, device, case, "FAIL", reason).to_dict())
                    self.reported.add((name, case.id, device))
        self.crashed_on = (name, case.id)
        return f"{name}: {error}, running {case.label}; restarted for the cases left"


def _crashed(
    target: str, cases: list[Case], devices: list[str], reported: set[tuple[str, str]], error: str
) -> list[Result]:
    reason = "worker crashed: " + (error.strip().splitlines() or ["no output"])[-1]
    return [
        Result(target, device, case, "FAIL", reason)
        for case in cases
        for device in devices
        if (case.id, device) not in reported
    ]


def _pairwise(results: list[Result], outdir: Path) -> list[Pairwise]:
    by_case: dict[str, list[Result]] = {}
    for r in results:
        if r.status != "SKIP" and (outdir / f"{r.target}@{r.device}@{r.case.id}.npz").exists():
            by_case.setdefault(r.case.id, []).append(r)
    pairs: dict[tuple[str, str], Pairwise] = {}
    for group in by_case.values():
        loaded = {
            f"{r.target}@{r.device}": np.load(outdir / f"{r.target}@{r.device}@{r.case.id}.npz")
            for r in group
        }
        case = group[0].case
        inputs = case.arrays()
        dtypes = compare.expected_dtypes(case.spec, inputs)
        factor = compare.bound_factor(case.rows, case.spec, inputs)
        measured_in = {
            q: compare.tolerance(q, case.spec, inputs, dtypes[q])
            for q in compare.quantities(case.spec)
        }
        for (na, a), (nb, b) in itertools.combinations(sorted(loaded.items()), 2):
            pair = pairs.setdefault((na, nb), Pairwise(na, nb))
            pair.cases += 1
            worst = 0.0
            for q, (dtype, magnitude) in measured_in.items():
                if q not in a.files or q not in b.files or a[q].shape != b[q].shape:
                    continue
                m = tolerances.measure(
                    a[q].astype(np.float64),
                    b[q].astype(np.float64),
                    dtype=dtype,
                    quantity="forward" if q in compare.FORWARD_QUANTITIES else "grad",
                    cast=case.spec.cast if q == "y" else "after_scale",
                    magnitude=magnitude,
                )
                m = compare.widened(m, factor)
                worst = max(worst, m.error / (PAIRWISE_FACTOR * m.bound.value))
            if worst > 1:
                pair.disagreements += 1
                pair.example = pair.example or case.label
            pair.worst = max(pair.worst, worst)
    return list(pairs.values())
