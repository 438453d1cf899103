"""The benchmark's terminal table (the JSON file: `normkit.bench.cli`; the figures: `normkit.bench.plot`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

def _ratios(row: dict[str, Any]) -> str:
    return ", ".join(f"{peer} {r:.2f}" for peer, r in row["ratios"].items() if not peer.startswith("normkit."))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per row, a header per group; normkit's rows list ``peer median / its median``."""
    lines: list[str] = []
    head = f"  {'implementation':<40} {'median ms':>10} {'GB/s':>7} {'of copy':>7}  ratios (peer/this)"
    last: tuple[Any, ...] | None = None
    for row in rows:
        key = (row["backend"], row["device"], row["dtype"], tuple(row["shape"]), row["pass"], row["mode"], row["memory"])
        if key != last:
            shape = "x".join(map(str, row["shape"]))
            lines += [f"{row['backend']} {row['device']} {row['dtype']} {shape} {row['pass']} ({row['mode']}; outputs {row['memory']})", head]
            last = key
        saved = row["saved_for_backward_bytes"]
        extra = [] if saved is None else [f"saved {saved / 2**20:.1f} MiB"]
        if row["peak_memory_bytes"] is not None:
            extra.append(f"peak {row['peak_memory_bytes'] / 2**20:.1f} MiB")
        ratios = _ratios(row) if row["role"] == "normkit" else ""
        lines.append(
            f"  {row['implementation']:<40} {row['median_s'] * 1e3:10.2f} {row['gb_per_s']:7.2f} "
            f"{row['fraction_of_copy_floor']:6.0%}  {'; '.join([ratios, *extra]) if extra else ratios}"
        )
    return "\n".join(lines)
