"""``normkit bench``: normkit's norms against each framework's own, side by side, with a copy floor.

`run` times every installed backend (torch, tf, jax), each in a process of its own, one after
the other (they would contend for the same cores), on every device the backend sees. Within a
backend, each *group* (device, dtype, shape, pass, mode) times all its implementations and a
memory copy of the same bytes interleaved, round after round
(`normkit.bench.timing.interleaved`), so
drift hits all of them alike and the ratios within a group are fair.

Row schema (one dict per implementation and group; `FIELDS`, in this order):

- ``implementation``: e.g. ``"normkit.torch.RMSNorm"``, ``"torch.nn.RMSNorm"``, ``"copy (clone)"``.
- ``role``: ``"normkit"``, ``"peer"`` or ``"copy floor"``.
- ``backend``: ``"torch"``, ``"tf"`` or ``"jax"``; ``device``: its `normkit.backends` name
  (``"cpu"``, ``"cuda:0"``, ...), the same for every backend.
- ``pass``: ``"forward"`` or ``"forward+backward"`` (gradient of x and the parameters, given dy).
- ``mode``: ``"eager"``, ``"torch.compile"``, ``"tf.function(jit_compile=True)"``, ``"jax.jit"``;
  normkit.tf on Keras' JAX backend (backend ``"tf"``): ``"JAX eager"`` and ``"jax.jit"``.
- ``memory``: ``"as allocated"`` (each implementation's outputs where it puts them) or, for
  torch on the CPU in a second worker, ``"on huge pages"`` (every output on transparent huge pages,
  torch's own and the copy's included: equal memory for all).
- ``shape``: ``[rows, hidden]``, normalized over hidden: the sweep's hidden sizes at about
  32M elements (1M with ``quick``), then one token's row ``[1, 4096]`` (`core.TOKEN_SHAPE`),
  where a call's time is its host work; ``dtype``: of x, y, dy and dx.
- ``median_s``, ``min_s``: over ``repeats`` timed rounds (for the token `Sweep.token_rounds`:
  200, 20 with ``quick``).
- ``bytes_moved``: the least traffic the pass needs: forward reads x and writes y; forward+backward
  adds reading x and dy and writing dx (5 tensors); parameters are negligible.
- ``gb_per_s``: ``bytes_moved / median_s / 1e9``.
- ``fraction_of_copy_floor``: the copy's median / this median, where the copy moves the same
  ``bytes_moved`` in the same group (1.0: as fast as copying).
- ``ratios``: ``{peer: peer median / this median}`` for the other non-copy implementations of the
  group (above 1: this one is faster).
- ``peak_memory_bytes``: on CUDA (torch) and TF GPUs, the peak allocated during one call above
  what was allocated before it; None elsewhere.
- ``saved_for_backward_bytes``: torch eager forward+backward: the bytes autograd saves for
  backward (parameters excluded); None elsewhere.

``normkit bench --json PATH`` writes ``{"normkit", "quick", "versions", "skipped", "errors",
"seconds", "rows"}``: versions, skip reasons (with the install command) and failures per backend.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normkit import backends as _backends
from normkit import workers
from normkit.arguments import refuse_empty
from normkit.bench.core import ALSO_ON, FIELDS, HUGE_PAGE_ENV, HUGE_PAGES, Sweep, sweep_to_dict
from normkit.progress import Progress

__all__ = ["FIELDS", "Report", "Sweep", "run"]

WORKER = "normkit.bench.worker"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class Report:
    """One benchmark run: the rows, and per backend its versions, or why it was skipped or
    failed; ``interrupted`` when it was stopped before the end (its rows are those measured)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False


def _work(
    backend: _backends.Backend,
    sweep: Sweep,
    report: Report,
    progress: Progress | None,
    env: Mapping[str, str] | None = None,
    label: str | None = None,
) -> None:
    """Time ``backend`` in a worker (its environment plus ``env``); its rows and versions go in
    ``report``, and its skip reason or error under ``label`` (default: the backend's name)."""
    label = label or backend.name

    def on_event(event: dict[str, Any]) -> None:
        if "planned" in event:
            report.versions.setdefault(backend.name, {}).update(event["versions"])
            if not event["planned"]:
                report.skipped[label] = (
                    f"no device of {list(sweep.devices or ())} (it sees {event['devices']})"
                )
            if progress is not None:
                progress.add(event["planned"])
        else:
            report.rows += event["rows"]
            if progress is not None:
                progress.advance(event["group"])

    job = {"backend": backend.name, "sweep": sweep_to_dict(sweep)}
    error = workers.run(WORKER, job, {**backend.env, **(env or {})}, on_event)
    if error:
        report.errors[label] = error


def _alternatives(
    backend: _backends.Backend, sweep: Sweep, report: Report, progress: Progress | None
) -> None:
    """Time ``backend`` again on each alternative framework the benchmark measures (`ALSO_ON`:
    normkit.tf on Keras' JAX backend), in a worker of its own; one not installed is skipped."""
    for alternative in backend.alternatives:
        if alternative.note not in ALSO_ON.get(backend.name, ()):
            continue
        label = f"{backend.name} [{alternative.note}]"
        missing = alternative.missing()
        if missing:
            report.skipped[label] = f"{', '.join(missing)} not installed"
        else:
            _work(backend, sweep, report, progress, alternative.env, label)


def _huge_pages_unavailable() -> str:
    """Why outputs cannot be put on transparent huge pages here, or "" when they can."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"no transparent huge pages ({THP_SETTING} is missing)"
    if "[never]" in setting:
        return f"transparent huge pages are disabled ({THP_SETTING}: {setting.strip()})"
    return ""


def _huge_pages_view(
    backend: _backends.Backend, sweep: Sweep, report: Report, progress: Progress | None
) -> None:
    """Time ``backend``'s CPU groups again with every output on huge pages (equal memory)."""
    if sweep.devices is not None and "cpu" not in sweep.devices:
        return
    why = _huge_pages_unavailable()
    if why:
        report.skipped[f"{backend.name} [{HUGE_PAGES}]"] = why
        return
    view = dataclasses.replace(sweep, devices=("cpu",), memory=HUGE_PAGES)
    _work(backend, view, report, progress, HUGE_PAGE_ENV[backend.name])


def run(
    *,
    backends: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
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
      quick: hidden 1024 and 4096 at 1M elements, 3 rounds, one torch.compile pair.
      progress: draw a progress bar on stderr.

    torch's CPU groups are timed twice: as torch allocates, then in a second worker with every
    output on transparent huge pages (``memory="on huge pages"``, `HUGE_PAGE_ENV`). normkit.tf
    is timed on TensorFlow, then on Keras' JAX backend where JAX is installed (`ALSO_ON`), with
    or without TensorFlow. An empty ``backends``, ``devices`` or ``dtypes`` would select
    nothing: it raises ValueError (leave the argument out for all). Interrupted
    (KeyboardInterrupt), it stops the worker and returns the groups measured so far, with
    ``interrupted`` set.
    """
    refuse_empty(backends=backends, devices=devices, dtypes=dtypes)
    start = time.perf_counter()
    sweep = Sweep.make(quick, [_backends.device_name(d) for d in devices or ()] or None, dtypes)
    chosen = [_backends.get(name) for name in backends] if backends else list(_backends.BACKENDS)
    report = Report()
    bar = Progress("bench") if progress else None
    try:
        for backend in chosen:
            missing = backend.missing()
            if missing:
                report.skipped[backend.name] = (
                    f"{', '.join(missing)} not installed: {backend.install}"
                )
            else:
                _work(backend, sweep, report, bar)
                if backend.name in HUGE_PAGE_ENV:
                    _huge_pages_view(backend, sweep, report, bar)
            _alternatives(backend, sweep, report, bar)
    except KeyboardInterrupt:
        report.interrupted = True
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report
