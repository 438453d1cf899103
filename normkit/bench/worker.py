"""A benchmark worker: one backend's groups, timed in a process of its own (`normkit.workers`).

``python -m normkit.bench.worker`` reads ``{"backend": ..., "sweep": {...}}`` and emits
``{"versions", "devices", "planned"}``, then ``{"group": label, "rows": [...]}`` per group.

A worker keeps the compilations of JAX and of TensorFlow's XLA in persistent caches
(`compilation_caches`), so that a second run does not compile again what the first compiled:
the jitted layers of each group, and Keras' ops dispatched one by one on JAX. What is timed is
unchanged: every candidate is called before its timed rounds.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from normkit import workers
from normkit.bench.core import HUGE_PAGE_ENV, HUGE_PAGES, collect, sweep_from_dict
from normkit.conformance.worker import jax_compilation_cache

TF_CACHE_DIR_ENV = "NORMKIT_TF_XLA_CACHE_DIR"
TF_CACHE_FLAG = "--tf_xla_persistent_cache_directory"


def compilation_caches() -> dict[str, str]:
    """Turn on JAX's persistent compilation cache (`jax_compilation_cache`) and TensorFlow's
    XLA cache, through the environment the frameworks read when imported; the folders in use
    ("" for one turned off). TensorFlow's goes in ``$NORMKIT_TF_XLA_CACHE_DIR``, by default
    ``normkit/tf-xla`` in the user's cache folder; an empty value turns it off, and a
    ``--tf_xla_persistent_cache_directory`` already in ``TF_XLA_FLAGS`` is left as it is."""
    jax_folder = jax_compilation_cache()
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if TF_CACHE_FLAG in flags:
        tf_folder = flags.split(f"{TF_CACHE_FLAG}=", 1)[-1].split()[0]
    else:
        user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        tf_folder = os.environ.get(TF_CACHE_DIR_ENV, str(user_cache / "normkit" / "tf-xla"))
        if tf_folder:
            os.environ["TF_XLA_FLAGS"] = f"{flags} {TF_CACHE_FLAG}={tf_folder}".strip()
    return {"jax": jax_folder, "tf": tf_folder}


def run_job(job: Mapping[str, Any], emit: workers.Emit) -> None:
    """Time every group of the job's backend, emitting the rows group by group."""
    compilation_caches()
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
