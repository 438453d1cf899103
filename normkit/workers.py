"""The worker protocol: the harness runs framework code in processes of its own.

A worker is ``python -m MODULE``. The parent writes one JSON job on its stdin and reads events
on its stdout, each a line ``PREFIX + json``; the worker's stderr goes to a file (a chatty
framework cannot fill a pipe and stall it). In the worker, `serve` keeps the event channel to
itself: everything else written to stdout (a stray ``print``, a framework's own C-level output)
is sent to stderr, so it can neither corrupt an event nor stall the parent. A worker that dies,
raises (the ``{"fatal": traceback}`` event) or writes a line that is not an event is reported
with the reason; the parent never waits on a worker that cannot finish.

Used by `normkit.conformance` and `normkit.bench`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import IO, Any

PREFIX = "normkit-event "
Event = dict[str, Any]
Emit = Callable[[Event], None]

_running: set[subprocess.Popen[str]] = set()
_running_lock = threading.Lock()


def run(
    module: str, job: Mapping[str, Any], env: Mapping[str, str], on_event: Callable[[Event], None]
) -> str:
    """Run worker ``module`` on ``job``, passing each event to ``on_event``.

    Returns "" when the worker finished cleanly, else one line saying why it did not: its fatal
    exception, a line on its event channel that is not an event, an error in ``on_event``, or
    the last line of its stderr with its exit status.
    """
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
        )
        assert proc.stdin is not None and proc.stdout is not None
        with _running_lock:
            _running.add(proc)
        error = ""
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            error = _read(proc.stdout, on_event)
        except Exception as exc:  # a broken pipe, or the caller's on_event: report, never hang
            error = f"{type(exc).__name__}: {exc}"
        except BaseException:  # an interrupt: the worker does not outlive it
            proc.kill()
            proc.wait()
            raise
        finally:
            with _running_lock:
                _running.discard(proc)
        if error:
            proc.kill()
        proc.wait()
        if proc.returncode and not error:
            log.seek(0)
            lines = log.read().strip().splitlines()
            error = f"exit status {proc.returncode}" + (f": {lines[-1]}" if lines else "")
        return error


def kill_running() -> None:
    """Kill every worker `run` is waiting on, in any thread: an interrupted parent whose
    workers run in threads of its own stops them this way (each `run` then returns the
    worker's exit status as its error)."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        proc.kill()


def _read(stdout: IO[str], on_event: Callable[[Event], None]) -> str:
    """Pass every event to ``on_event``; the reason the worker failed, or ""."""
    for line in stdout:
        if not line.startswith(PREFIX):
            return f"the worker wrote a line that is not an event: {line.strip()[:200]!r}"
        try:
            event = json.loads(line[len(PREFIX) :])
        except json.JSONDecodeError:
            return f"the worker wrote a malformed event: {line.strip()[:200]!r}"
        if "fatal" in event:
            return str(event["fatal"]).strip().splitlines()[-1]
        on_event(event)
    return ""


def serve(work: Callable[[Any, Emit], None]) -> None:
    """The worker's side: read the job on stdin, run ``work(job, emit)``, exit 1 on an error.

    Events go to a private copy of stdout; from here on, stdout itself is stderr.
    """
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def emit(event: Event) -> None:
        channel.write(PREFIX + json.dumps(event) + "\n")
        channel.flush()

    try:
        work(json.load(sys.stdin), emit)
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the target
        emit({"fatal": traceback.format_exc()})
        sys.exit(1)
