"""Bench runs read back from their JSON files (``normkit bench --json``), and several runs read as
one (``normkit bench --combine``): each figure the median of the runs that measured it.

Files written before the bench had two timings hold latency rows without a ``timing``; they are
read as such.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from normkit.bench.core import LATENCY
from normkit.bench.targets import Run
from normkit.files import open_regular

Row = dict[str, Any]
NEEDED = ("implementation", "role", "backend", "device", "pass", "mode", "memory", "shape",
          "dtype", "median_s", "ratios", "fraction_of_copy_floor")
KEY = ("backend", "device", "pass", "mode", "timing", "memory", "dtype", "implementation")


def load(path: str) -> dict[str, Any]:
    """A bench run's JSON file; ValueError naming the file and the problem when it is not one."""
    with open_regular(path) as f:
        try:
            data = json.loads(f.read().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not a normkit bench file (no list of 'rows')")
    for i, row in enumerate(rows):
        missing = [k for k in NEEDED if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {missing}")
    return data


def as_run(data: Mapping[str, Any]) -> Run:
    """A run's rows and kind, for `normkit.bench.targets.judge`."""
    return Run(data["rows"], bool(data.get("quick")))


def _key(row: Row) -> tuple[Any, ...]:
    return (*(row.get(k, LATENCY) if k == "timing" else row[k] for k in KEY), tuple(row["shape"]))


def merge(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several runs as one: per row (its group and implementation) the median over the runs of
    each time, ratio and fraction, the spread from the least ``min_s`` to the largest ``max_s``,
    the samples summed. ValueError for quick runs mixed with full ones."""
    if len({bool(r.get("quick")) for r in runs}) > 1:
        raise ValueError("quick and full runs measure different shapes: combine one kind only")
    grouped: dict[tuple[Any, ...], list[Row]] = {}
    for run in runs:
        for row in run["rows"]:
            grouped.setdefault(_key(row), []).append(row)
    rows = [_median_row(found) for found in grouped.values()]
    first = runs[0]
    return {
        "normkit": first.get("normkit"), "quick": bool(first.get("quick")),
        "versions": first.get("versions", {}), "machine": first.get("machine", {}),
        "seconds": sum(float(r.get("seconds", 0.0)) for r in runs), "runs": len(runs),
        "skipped": {}, "errors": {}, "interrupted": any(r.get("interrupted") for r in runs),
        "rows": rows,
    }


def _median(rows: Sequence[Row], field: str) -> Any:
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def _median_row(rows: Sequence[Row]) -> Row:
    merged = dict(rows[0])
    merged.setdefault("timing", LATENCY)
    for field in ("median_s", "host_s", "gb_per_s", "fraction_of_copy_floor",
                  "peak_memory_bytes", "saved_for_backward_bytes"):
        if field in merged:
            merged[field] = _median(rows, field)
    if "min_s" in merged:
        merged["min_s"] = min(float(r.get("min_s") or r["median_s"]) for r in rows)
    if "max_s" in merged:
        merged["max_s"] = max(float(r.get("max_s") or r["median_s"]) for r in rows)
    if "repeats" in merged:
        merged["repeats"] = sum(r.get("repeats", 0) for r in rows)
    peers = dict.fromkeys(p for r in rows for p in r["ratios"])
    merged["ratios"] = {p: statistics.median([r["ratios"][p] for r in rows if p in r["ratios"]])
                        for p in peers}
    return merged
