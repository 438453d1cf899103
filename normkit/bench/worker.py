"""A benchmark worker: one backend's groups, timed in a process of its own (`normkit.workers`).

``python -m normkit.bench.worker`` reads ``{"backend": ..., "sweep": {...}}`` and emits
``{"versions", "devices", "planned"}``, then ``{"group": label, "rows": [...]}`` per group.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from normkit import workers
from normkit.bench.core import HUGE_PAGE_ENV, HUGE_PAGES, collect, sweep_from_dict


def run_job(job: Mapping[str, Any], emit: workers.Emit) -> None:
    """Time every group of the job's backend, emitting the rows group by group."""
    bench = importlib.import_module(f"normkit.bench.{job['backend']}")
    sweep = sweep_from_dict(job["sweep"])
    if sweep.memory == HUGE_PAGES:
        needed = HUGE_PAGE_ENV[job["backend"]]
        if any(os.environ.get(k) != v for k, v in needed.items()):
            raise RuntimeError(f"the {HUGE_PAGES} view needs {dict(needed)} in the worker's env")
    planned = len(bench.plan(sweep))  # first: it raises if the backend cannot be measured here
    emit({"versions": bench.versions(), "devices": bench.devices(), "planned": planned})
    collect(bench, sweep, lambda group, rows: emit({"group": group.label, "rows": rows}))


if __name__ == "__main__":
    workers.serve(run_job)
