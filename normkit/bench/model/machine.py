"""The machine a benchmark ran on, as far as the operating system says: its CPU, cores, memory
and how busy it was (load averages)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _field(path: str, name: str) -> str | None:
    """The first ``name: value`` line of a /proc file, or None."""
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        return None
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe() -> dict[str, Any]:
    """CPU model, logical cores (and those this process may use), memory, the OS, Python and
    numpy, and the load averages now."""
    memory = _field("/proc/meminfo", "MemTotal")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory": memory,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "load_average_start": load_average(),
    }
