"""``normkit bench``: normkit's norms against each framework's own, side by side, with a copy floor.

`run` times every installed backend (torch, tf, jax), each in a process of its own, one after
the other (they would contend for the same cores), on every device the backend sees. Within a
backend, each *group* (device, dtype, shape, pass, mode) times all its implementations and a
memory copy of the same bytes interleaved, round after round
(`normkit.bench.timing.interleaved`), so drift hits all of them alike and the ratios within a
group are fair; and it does so in two *timings* (`core.TIMINGS`): latency, a wait for the
device after each call, and throughput, many calls back to back between two waits (CUDA
events on a CUDA device).

Row schema (one dict per implementation, group and timing; `FIELDS`, in this order):

- ``implementation``: e.g. ``"normkit.torch.RMSNorm"``, ``"torch.nn.RMSNorm"``, ``"copy (clone)"``.
- ``role``: ``"normkit"``, ``"peer"`` or ``"copy floor"``.
- ``backend``: ``"torch"``, ``"tf"`` or ``"jax"``; ``device``: its `normkit.backends` name
  (``"cpu"``, ``"cuda:0"``, ...), the same for every backend.
- ``pass``: ``"forward"`` or ``"forward+backward"`` (gradient of x and the parameters, given dy).
- ``mode``: ``"eager"``, ``"torch.compile"``, ``"tf.function(jit_compile=True)"``, ``"jax.jit"``;
  normkit.tf on Keras' JAX backend (backend ``"tf"``): ``"JAX eager"`` and ``"jax.jit"``.
- ``timing``: ``"latency"`` (one call a sample, the wait after it) or ``"throughput"``
  (``calls`` calls a sample back to back, one wait after the last).
- ``memory``: ``"as allocated"`` (each implementation's outputs where it puts them) or, for
  torch on the CPU in a second worker, ``"on huge pages"`` (every output on transparent huge pages,
  torch's own and the copy's included: equal memory for all; `core.MEMORY_NOTE`).
- ``shape``: ``[rows, hidden]``, normalized over hidden: the sweep's hidden sizes at about
  32M elements (1M with ``quick``), then one token's row ``[1, 4096]`` (`core.TOKEN_SHAPE`),
  where a call's time is its host work; ``dtype``: of x, y, dy and dx.
- ``median_s``, ``min_s``, ``max_s``: per call, the median and spread of ``repeats`` samples.
- ``repeats``: samples: latency 8 (3 with ``quick``; at one token `Sweep.token_rounds`, 200 or
  20), throughput 3 (at one token 10, 3 with ``quick``).
- ``calls``: calls per sample: 1 for latency; for throughput `core.THROUGHPUT_CALLS` (50), fewer
  on the CPU's large shapes (`core.CPU_SAMPLE_S`).
- ``host_s``: the median of the host's time per call until the call returns, before the wait
  (on the CPU, where a call computes before it returns, the whole call).
- ``bytes_moved``: the least traffic the pass needs: forward reads x and writes y; forward+backward
  adds reading x and dy and writing dx (5 tensors); parameters are negligible.
- ``gb_per_s``: ``bytes_moved / median_s / 1e9``.
- ``fraction_of_copy_floor``: the copy's median / this median, where the copy moves the same
  ``bytes_moved`` in the same group and timing (1.0: as fast as copying).
- ``ratios``: ``{peer: peer median / this median}`` for the other non-copy implementations of the
  group, in the same timing (above 1: this one is faster).
- ``peak_memory_bytes``: on CUDA (torch) and TF GPUs, the peak allocated during one call above
  what was allocated before it; None elsewhere.
- ``saved_for_backward_bytes``: torch eager forward+backward: the bytes autograd saves for
  backward (parameters excluded); None elsewhere.

``normkit bench --json PATH`` writes ``{"normkit", "quick", "versions", "machine", "skipped",
"errors", "seconds", "interrupted", "rows", "targets"}``: versions, the CPUs and the load
average at the start and the end, skip reasons (with the install command) and failures per
backend, and each target's verdict (`normkit.bench.targets`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normkit import backends as _backends
from normkit import workers
from normkit.arguments import refuse_empty
from normkit.bench.core import (
    ALSO_ON,
    FIELDS,
    HUGE_PAGE_ENV,
    HUGE_PAGES,
    MEMORY_NOTE,
    PASSES,
    Sweep,
    sweep_to_dict,
)
from normkit.progress import Progress

__all__ = ["FIELDS", "Report", "Sweep", "run"]

WORKER = "normkit.bench.worker"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# What a worker is expected to cost on an idle 2-core machine, in seconds: its start (imports)
# and each group (quick, full), per worker label; the quick figures from a run with warm
# compilation caches. Only the estimate of the time left reads them, before each worker says
# how many groups it plans: they weigh the work of different frameworks against one another,
# and the pace measured scales them.
EXPECTED_S: Mapping[str, tuple[float, float, float]] = {
    "torch": (3.0, 2.4, 12.0),
    f"torch [{HUGE_PAGES}]": (3.0, 2.4, 12.0),
    "tf": (5.0, 2.4, 8.0),
    "tf [Keras on JAX]": (4.0, 1.25, 10.0),
    "jax": (3.0, 0.4, 8.0),
}
EXPECTED_MODES = {"torch": 2, "tf": 2, "jax": 1}


@dataclass
class Report:
    """One benchmark run: the rows, and per backend its versions, or why it was skipped or
    failed; ``interrupted`` when it was stopped before the end (its rows are those measured);
    ``machine``: the CPUs and the load average at the start and the end."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    machine: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Job:
    """One worker to run: a backend in an environment (a memory view, an alternative framework)
    under a label, with its expected cost for the estimate of the time left."""

    backend: _backends.Backend
    sweep: Sweep
    label: str
    env: Mapping[str, str] = field(default_factory=dict)
    groups: int = 0
    group_s: float = 0.0
    startup_s: float = 0.0

    def expect(self) -> None:
        """The expected groups (the devices asked for, else the CPU) and their seconds."""
        startup, quick, full = EXPECTED_S.get(self.label, (5.0, 1.0, 10.0))
        devices = len(self.sweep.devices or ("cpu",))
        dtypes = len(self.sweep.dtypes or ("float32", "bfloat16"))
        modes = EXPECTED_MODES.get(self.backend.name, 1)
        self.groups = devices * dtypes * len(self.sweep.shapes()) * len(PASSES) * modes
        self.group_s = quick if self.sweep.quick else full
        self.startup_s = startup


class _Eta:
    """The progress of the whole run: every job's expected groups and seconds from the start,
    corrected as each worker says how many groups it plans, and what a job did not do taken
    off when it ends."""

    def __init__(self, jobs: Sequence[_Job], bar: Progress | None) -> None:
        self.bar = bar
        if bar is not None:
            bar.add(sum(j.groups for j in jobs), sum(j.startup_s + j.groups * j.group_s
                                                     for j in jobs))

    def planned(self, job: _Job, groups: int) -> None:
        if self.bar is not None:
            self.bar.advance(f"{job.label} started", 0, job.startup_s)
            self.bar.add(groups - job.groups, (groups - job.groups) * job.group_s)
        job.groups, job.startup_s = groups, 0.0

    def group(self, job: _Job, label: str) -> None:
        if self.bar is not None:
            self.bar.advance(label, 1, job.group_s)
        job.groups -= 1

    def ended(self, job: _Job) -> None:
        """What the job was expected to do and did not (it failed, or was skipped), taken off."""
        if self.bar is not None and (job.groups or job.startup_s):
            self.bar.add(-job.groups, -(job.groups * job.group_s + job.startup_s))
        job.groups, job.startup_s = 0, 0.0


def _work(job: _Job, report: Report, eta: _Eta) -> None:
    """Time ``job`` in a worker (its backend's environment plus the job's); its rows and
    versions go in ``report``, and its skip reason or error under the job's label."""
    sweep, backend = job.sweep, job.backend

    def on_event(event: dict[str, Any]) -> None:
        if "planned" in event:
            report.versions.setdefault(backend.name, {}).update(event["versions"])
            if not event["planned"]:
                report.skipped[job.label] = _nothing_planned(sweep, event["devices"])
            eta.planned(job, event["planned"])
        else:
            report.rows += event["rows"]
            eta.group(job, event["group"])

    request = {"backend": backend.name, "sweep": sweep_to_dict(sweep)}
    try:
        error = workers.run(WORKER, request, {**backend.env, **job.env}, on_event)
    finally:
        eta.ended(job)
    if error:
        report.errors[job.label] = error


def _nothing_planned(sweep: Sweep, seen: Sequence[str]) -> str:
    """Why a worker that sees ``seen`` plans no group of ``sweep``."""
    if not sweep.select(seen):
        return f"no device of {list(sweep.devices or ())} (it sees {list(seen)})"
    return f"it runs in none of the modes {list(sweep.modes or ())}"


def _alternatives(backend: _backends.Backend, sweep: Sweep, report: Report) -> list[_Job]:
    """A job per alternative framework the benchmark measures ``backend`` on (`ALSO_ON`:
    normkit.tf on Keras' JAX backend), in a worker of its own; one not installed is skipped."""
    jobs = []
    for alternative in backend.alternatives:
        if alternative.note not in ALSO_ON.get(backend.name, ()):
            continue
        label = f"{backend.name} [{alternative.note}]"
        missing = alternative.missing()
        if missing:
            report.skipped[label] = f"{', '.join(missing)} not installed"
        else:
            jobs.append(_Job(backend, sweep, label, alternative.env))
    return jobs


def _huge_pages_unavailable() -> str:
    """Why outputs cannot be put on transparent huge pages here, or "" when they can."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"no transparent huge pages ({THP_SETTING} is missing)"
    if "[never]" in setting:
        return f"transparent huge pages are disabled ({THP_SETTING}: {setting.strip()})"
    return ""


def _huge_pages_view(backend: _backends.Backend, sweep: Sweep, report: Report) -> list[_Job]:
    """A job timing ``backend``'s CPU groups again with every output on huge pages (equal
    memory); none for the quick sweep, which judges no target of equal memory."""
    label = f"{backend.name} [{HUGE_PAGES}]"
    if sweep.devices is not None and "cpu" not in sweep.devices:
        return []
    if sweep.quick:
        report.skipped[label] = f"not with --quick ({MEMORY_NOTE})"
        return []
    why = _huge_pages_unavailable()
    if why:
        report.skipped[label] = why
        return []
    view = dataclasses.replace(sweep, devices=("cpu",), memory=HUGE_PAGES)
    return [_Job(backend, view, label, HUGE_PAGE_ENV[backend.name])]


def _machine() -> dict[str, Any]:
    """The CPUs, their model where Linux names it, and the load average now."""
    found: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                found["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        found["load_average"] = [round(os.getloadavg()[0], 2)]
    return found


def run(
    *,
    backends: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    timings: Sequence[str] | None = None,
    modes: Sequence[str] | None = None,
    quick: bool = False,
    progress: bool = True,
) -> Report:
    """Benchmark each installed backend in its own process, one after the other.

    Args:
      backends: names from `normkit.backends` (default: all); one not installed is skipped
        with the install command.
      devices: only these device names (e.g. ``["cpu"]``); default every device each backend sees.
        A backend that sees none of them is skipped, naming the devices it sees.
      dtypes: from ``float32``, ``bfloat16``, ``float16``; default float32 and bfloat16, plus
        float16 off the CPU.
      timings: ``"latency"`` and/or ``"throughput"`` (default both, `normkit.bench.timing`).
      modes: only these modes (`core.MODES`, e.g. ``["eager", "jax.jit"]``); default every mode
        each backend runs. A backend with none of them is skipped, saying so.
      quick: hidden 4096 at 1M elements and one token, 3 rounds, one torch.compile pair, outputs
        as allocated only.
      progress: draw a progress bar on stderr, with an estimate of the time left in the run.

    torch's CPU groups are timed twice: as torch allocates, then in a second worker with every
    output on transparent huge pages (``memory="on huge pages"``, `HUGE_PAGE_ENV`; not with
    ``quick``). normkit.tf is timed on TensorFlow, then on Keras' JAX backend where JAX is
    installed (`ALSO_ON`), with or without TensorFlow. An empty ``backends``, ``devices``,
    ``dtypes``, ``timings`` or ``modes`` would select nothing: it raises ValueError (leave the
    argument out for all). Interrupted (KeyboardInterrupt), it stops the worker and returns the
    groups measured so far, with ``interrupted`` set.
    """
    refuse_empty(backends=backends, devices=devices, dtypes=dtypes, timings=timings,
                 modes=modes)
    start = time.perf_counter()
    sweep = Sweep.make(
        quick, [_backends.device_name(d) for d in devices or ()] or None, dtypes, timings, modes
    )
    chosen = [_backends.get(name) for name in backends] if backends else list(_backends.BACKENDS)
    report = Report(machine=_machine())
    jobs: list[_Job] = []
    for backend in chosen:
        missing = backend.missing()
        if missing:
            report.skipped[backend.name] = f"{', '.join(missing)} not installed: {backend.install}"
        else:
            jobs.append(_Job(backend, sweep, backend.name))
            if backend.name in HUGE_PAGE_ENV:
                jobs += _huge_pages_view(backend, sweep, report)
        jobs += _alternatives(backend, sweep, report)
    for job in jobs:
        job.expect()
    bar = Progress("bench") if progress else None
    eta = _Eta(jobs, bar)
    try:
        for job in jobs:
            _work(job, report, eta)
    except KeyboardInterrupt:
        report.interrupted = True
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - start
    if hasattr(os, "getloadavg"):
        report.machine.setdefault("load_average", []).append(round(os.getloadavg()[0], 2))
    return report
