"""``normkit bench``: normkit's norms against each framework's own, side by side, with a copy floor.

`run` times every installed backend (torch, tf, jax), each in a process of its own, one after
the other (they would contend for the same cores), on every device the backend sees. Within a
backend, each *group* (device, dtype, shape, pass, mode) times all its implementations and a
memory copy of the same bytes interleaved, round after round (`normkit.timing.interleaved`), so
drift hits all of them alike and the ratios within a group are fair.

Row schema (one dict per implementation and group; `FIELDS`, in this order):

- ``implementation``: e.g. ``"normkit.torch.RMSNorm"``, ``"torch.nn.RMSNorm"``, ``"copy (clone)"``.
- ``role``: ``"normkit"``, ``"peer"`` or ``"copy floor"``.
- ``backend``: ``"torch"``, ``"tf"`` or ``"jax"``; ``device``: the backend's name for it
  (``"cpu"``, ``"cuda:0"``, ``"gpu:0"``).
- ``pass``: ``"forward"`` or ``"forward+backward"`` (gradient of x and the parameters, given dy).
- ``mode``: ``"eager"``, ``"torch.compile"``, ``"tf.function(jit_compile=True)"``, ``"jax.jit"``.
- ``shape``: ``[rows, hidden]``, normalized over hidden; ``dtype``: of x, y, dy and dx.
- ``median_s``, ``min_s``: over ``repeats`` timed rounds.
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

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from normkit import backends as _backends
from normkit.bench.core import FIELDS, Sweep, sweep_to_dict
from normkit.bench.worker import PREFIX

__all__ = ["FIELDS", "Report", "Sweep", "run"]

ENV = {"torch": {}, "tf": {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}, "jax": {}}


@dataclass
class Report:
    """One benchmark run: the rows, and per backend its versions, or why it was skipped or failed."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _work(backend: str, sweep: Sweep, report: Report, progress: Any) -> None:
    env = {**os.environ, **ENV[backend]}
    job = json.dumps({"backend": backend, "sweep": sweep_to_dict(sweep)})
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "normkit.bench.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(job)
        proc.stdin.close()
        fatal = ""
        for line in proc.stdout:
            if not line.startswith(PREFIX):
                continue
            event = json.loads(line[len(PREFIX):])
            if "fatal" in event:
                fatal = event["fatal"].strip().splitlines()[-1]
            elif "planned" in event:
                report.versions[backend] = event["versions"]
                if not event["planned"]:
                    report.skipped[backend] = f"no device of {list(sweep.devices or ())} (it sees {event['devices']})"
                if progress is not None:
                    progress.total += event["planned"]
            else:
                report.rows += event["rows"]
                if progress is not None:
                    progress.advance(event["group"])
        proc.wait()
        if proc.returncode:
            stderr.seek(0)
            lines = stderr.read().strip().splitlines()
            report.errors[backend] = fatal or (lines[-1] if lines else f"exit status {proc.returncode}")


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
    """
    from normkit.conformance.runner import Progress

    start = time.perf_counter()
    sweep = Sweep.make(quick, devices, dtypes)
    chosen = [_backends.get(name) for name in backends] if backends else list(_backends.BACKENDS)
    report = Report()
    bar = Progress(0) if progress else None
    for backend in chosen:
        missing = backend.missing()
        if missing:
            report.skipped[backend.name] = f"{', '.join(missing)} not installed: pip install 'normkit[{backend.extra}]'"
            continue
        _work(backend.name, sweep, report, bar)
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report
