"""The benchmark's detail table, a line per row under a header per group (``normkit bench
--table``; the summary: `normkit.bench.summary`; the JSON file: `normkit.bench.cli`; the
figures: `normkit.bench.plot`)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

LEGEND = (
    "Per call: median ms and the samples' min-max; GB/s: bytes moved / median; of copy: the "
    "group's copy median / this median; host us: the host's time in a call (before the wait), "
    "median; calls: back to back per sample; vs: a peer's median / this median (above 1: this "
    "one faster)."
)


def _ms(seconds: float) -> str:
    """Milliseconds with three significant digits at least."""
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _ratios(row: dict[str, Any]) -> str:
    return ", ".join(f"{peer} {r:.2f}" for peer, r in row["ratios"].items()
                     if not peer.startswith("normkit."))


def _group_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["backend"], row["device"], row["dtype"], tuple(row["shape"]), row["pass"],
            row["mode"], row["timing"], row["memory"])


def table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per row, a header per group; normkit's rows list ``peer median / its median``."""
    if not rows:
        return ""
    name_width = max(len("implementation"), *(len(r["implementation"]) for r in rows))
    head = (f"  {'implementation':<{name_width}} {'median ms':>9} {'min-max ms':>17} "
            f"{'GB/s':>8} {'of copy':>7} {'host us':>8} {'calls':>5}  vs (peer/this)")
    lines: list[str] = textwrap.wrap(LEGEND, 100)
    last: tuple[Any, ...] | None = None
    for row in rows:
        key = _group_key(row)
        if key != last:
            shape = "x".join(map(str, row["shape"]))
            lines += [f"{row['backend']} {row['device']} {row['dtype']} {shape} {row['pass']}, "
                      f"{row['mode']}, {key[6]}; outputs {row['memory']}", head]
            last = key
        saved = row.get("saved_for_backward_bytes")
        extra = [] if saved is None else [f"saved {saved / 2**20:.1f} MiB"]
        if row.get("peak_memory_bytes") is not None:
            extra.append(f"peak {row['peak_memory_bytes'] / 2**20:.1f} MiB")
        ratios = _ratios(row) if row["role"] == "normkit" else ""
        low, high = row.get("min_s", row["median_s"]), row.get("max_s", row["median_s"])
        spread = f"{_ms(low)}-{_ms(high)}"
        host = row.get("host_s")
        line = (
            f"  {row['implementation']:<{name_width}} {_ms(row['median_s']):>9} {spread:>17} "
            f"{row['gb_per_s']:8.2f} {row['fraction_of_copy_floor']:7.0%} "
            f"{'-' if host is None else f'{host * 1e6:.1f}':>8} {row.get('calls', 1):>5}  "
            + "; ".join(p for p in [ratios, *extra] if p)
        )
        lines.append(line.rstrip())
    return "\n".join(lines)
