"""normkit's layers paired with the framework layers of the same kind, and their speed ratios
(the summary's tables and the ratio figure read them; see `normkit.bench` for the rows)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from normkit.bench.core import LATENCY, short_name

Row = dict[str, Any]


def norm_kind(implementation: str) -> str | None:
    """``"rms"``, ``"partial_rms"`` or ``"layer"`` from an implementation's name; else None."""
    if "Partial" in implementation:
        return "partial_rms"
    if "RMSNorm" in implementation:  # also keras' RMSNormalization, "Llama RMSNorm (torch ops)"
        return "rms"
    if "LayerNorm" in implementation:  # also keras' LayerNormalization
        return "layer"
    return None


@dataclass(frozen=True)
class Comparison:
    """One normkit layer against one peer of the same kind, in one mode, on one device and
    memory view."""

    backend: str
    device: str
    normkit: str
    peer: str
    mode: str
    memory: str

    def label(self, show_mode: bool = False) -> str:
        short = short_name(self.normkit, self.backend)
        return f"{short} vs {self.peer}" + (f"\n[{self.mode}]" if show_mode else "")


Cell = tuple[str, str, str]
"""``(dtype, pass, timing)``."""


def ratios(rows: Sequence[Row]) -> dict[Comparison, dict[Cell, list[float]]]:
    """``peer median / normkit median`` (above 1: normkit faster) for every normkit row and every
    peer of its group with the same kind, keyed by `Comparison` then ``(dtype, pass, timing)``,
    one value per shape (in order of hidden size). Rows without a ``timing`` (written before the
    bench had two) are latency rows."""
    found: dict[Comparison, dict[Cell, list[tuple[int, float]]]] = {}
    for row in rows:
        if row["role"] != "normkit":
            continue
        for peer, ratio in row["ratios"].items():
            if peer.startswith("normkit.") or norm_kind(peer) != norm_kind(row["implementation"]):
                continue
            key = Comparison(
                row["backend"], row["device"], row["implementation"], peer, row["mode"],
                row["memory"],
            )
            cell = (row["dtype"], row["pass"], row.get("timing", LATENCY))
            found.setdefault(key, {}).setdefault(cell, []).append((row["shape"][-1], ratio))
    return {key: {cell: [r for _, r in sorted(v)] for cell, v in cells.items()}
            for key, cells in found.items()}


def geomean(values: Sequence[float]) -> float:
    """The geometric mean: the typical ratio of several."""
    return math.exp(sum(math.log(v) for v in values) / len(values))
