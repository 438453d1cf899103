"""A fake GPU for scripts/gpu-check's tests: an ``nvidia-smi`` on PATH, and a ``sitecustomize``
that answers gpu-check's setup at once and makes the step's command sleep past its limit.

gpu-check counts its setup (``normkit info --json``, pip's install of the wheels carried in
.whl/gpu) against its budget; on a loaded machine that setup alone took the tests' budget of
12-20 s, and the step never started. Here it returns at once, whatever the machine."""

from __future__ import annotations

import json
from pathlib import Path

GPU_NAME = "Fake GPU, 80 GiB, 1.0"

SITECUSTOMIZE = """
import json, signal, sys, time
if sys.argv[:2] in (["-m", "info"], ["-m", "install"]):  # normkit info; pip install
    print("{}")
    sys.exit(0)
REPORTS = json.loads(%r)  # argv when sitecustomize runs: ["-m", "bench", ...], "-m" standing for normkit
for prefix, report in REPORTS:
    if sys.argv[:len(prefix)] == prefix:
        path = sys.argv[sys.argv.index("--json") + 1]
        def stopped(signum, frame, report=report, path=path):  # as normkit writes what it did
            with open(path, "w") as f:
                json.dump(report, f)
            sys.exit(130)
        signal.signal(signal.SIGTERM, stopped)
        time.sleep(300)
"""


def install(folder: Path, reports: list[tuple[list[str], dict]] | None = None) -> Path:
    """``nvidia-smi`` in ``folder`` (put it first on PATH), and ``folder/slow/sitecustomize.py``
    (put ``folder/slow`` on PYTHONPATH) where a command whose argv starts with a prefix of
    ``reports`` sleeps until SIGTERM and then writes its report to its ``--json`` path and exits
    130. Returns ``folder/slow``."""
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{GPU_NAME}'\n")
    smi.chmod(0o755)
    slow = folder / "slow"
    slow.mkdir(exist_ok=True)
    (slow / "sitecustomize.py").write_text(SITECUSTOMIZE % json.dumps(reports or []))
    return slow
