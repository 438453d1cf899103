"""A benchmark worker: one backend's groups, timed in a process of its own.

`main` (``python -m normkit.bench.worker``) reads ``{"backend": ..., "sweep": {...}}`` on stdin
and writes events on stdout, each a line ``PREFIX + json``: ``{"versions", "devices", "planned"}``,
then ``{"group": label, "rows": [...]}`` per group, or ``{"fatal": traceback}``. Lines without the
prefix (a framework's own output) are not events.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any

from normkit.bench.core import collect, sweep_from_dict

PREFIX = "normkit-bench-event "


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Run the job on stdin; exit status 1 after a ``fatal`` event."""
    job = json.load(sys.stdin)
    try:
        bench = importlib.import_module(f"normkit.{job['backend']}.bench")
        sweep = sweep_from_dict(job["sweep"])
        planned = len(bench.plan(sweep))  # first: it raises if the backend cannot be measured here
        _emit({"versions": bench.versions(), "devices": bench.devices(), "planned": planned})
        collect(bench, sweep, lambda group, rows: _emit({"group": group.label, "rows": rows}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the backend
        _emit({"fatal": traceback.format_exc()})
        sys.exit(1)


if __name__ == "__main__":
    main()
