"""The benchmark's figures, from its rows (see `normkit.bench` for the row schema).

- `ratio_figure`: at a glance, how much faster or slower each normkit layer is than each
  framework layer of the same kind, per backend and device, dtype and pass.
- `throughput_figure`: the detail, GB/s against hidden size for every implementation and the
  copy floor.

matplotlib is imported only when a figure is drawn (``pip install 'normkit[bench]'``); the
figures are drawn on their own canvas, without pyplot, so no global plotting state changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normkit.bench.core import AS_ALLOCATED, short_name, swept
from normkit.files import write_atomically

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Row = dict[str, Any]
PASS_MARKERS = {"forward": "o", "forward+backward": "s"}
DTYPE_COLORS = {"float32": "#1f77b4", "bfloat16": "#ff7f0e", "float16": "#2ca02c"}


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

    def label(self, show_mode: bool) -> str:
        short = short_name(self.normkit, self.backend)
        return f"{short} vs {self.peer}" + (f"\n[{self.mode}]" if show_mode else "")


def ratios(rows: Sequence[Row]) -> dict[Comparison, dict[tuple[str, str], list[float]]]:
    """``peer median / normkit median`` (above 1: normkit faster) for every normkit row and every
    peer of its group with the same kind, keyed by `Comparison` then ``(dtype, pass)``, one value
    per shape (in order of hidden size)."""
    found: dict[Comparison, dict[tuple[str, str], list[tuple[int, float]]]] = {}
    for row in swept(rows):
        if row["role"] != "normkit":
            continue
        for peer, ratio in row["ratios"].items():
            if peer.startswith("normkit.") or norm_kind(peer) != norm_kind(row["implementation"]):
                continue
            key = Comparison(
                row["backend"], row["device"], row["implementation"], peer, row["mode"],
                row["memory"],
            )
            cell = found.setdefault(key, {}).setdefault((row["dtype"], row["pass"]), [])
            cell.append((row["shape"][-1], ratio))
    return {key: {cell: [r for _, r in sorted(v)] for cell, v in cells.items()}
            for key, cells in found.items()}


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the benchmark figures need matplotlib: pip install 'normkit[bench]'"
        ) from exc


def _memory_note(memory: str) -> str:
    """A panel title's note of the memory view; nothing for the default one."""
    return "" if memory == AS_ALLOCATED else f" ({memory})"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ratio_figure(rows: Sequence[Row], title: str = "") -> Figure:
    """Speed ratios against each peer: one panel per backend and device, one line of the panel
    per (normkit layer, peer, mode), a marker per dtype (colour) and pass (shape) at the geometric
    mean over the hidden sizes, a bar over their range. Log scale; 1 is parity."""
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    table = ratios(rows)
    if not table:
        raise ValueError("no normkit row has a peer of its kind: no ratios to plot")
    panels = list(dict.fromkeys((c.backend, c.device, c.memory) for c in table))
    cells = list(dict.fromkeys(cell for values in table.values() for cell in values))
    heights = [sum((c.backend, c.device, c.memory) == panel for c in table) for panel in panels]
    fig = Figure(figsize=(9.5, 1.2 + 0.55 * sum(heights) + 0.5 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    every = [r for values in table.values() for v in values.values() for r in v]
    low, high = min(every + [0.8]), max(every + [1.25])
    for ax, (backend, device, memory) in zip(axes, panels, strict=False):
        comparisons = [c for c in table if (c.backend, c.device, c.memory) == (
            backend, device, memory)]
        show_mode = len({c.mode for c in comparisons}) > 1
        for i, comparison in enumerate(comparisons):
            for j, cell in enumerate(cells):
                values = table[comparison].get(cell)
                if not values:
                    continue
                y = i + (j - (len(cells) - 1) / 2) * 0.7 / max(1, len(cells))
                color = DTYPE_COLORS.get(cell[0], "black")
                ax.plot([min(values), max(values)], [y, y], color=color, linewidth=1.2, alpha=0.6)
                marker = PASS_MARKERS.get(cell[1], "D")
                ax.plot([_geomean(values)], [y], marker=marker, color=color, markersize=6,
                        linestyle="none")
        ax.axvline(1.0, color="black", linewidth=0.8)
        labels = [c.label(show_mode) for c in comparisons]
        ax.set_yticks(range(len(comparisons)), labels, fontsize=8.5)
        ax.set_ylim(len(comparisons) - 0.5, -0.5)
        ax.set_title(f"{backend} on {device}{_memory_note(memory)}", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    ax = axes[-1]
    ax.set_xscale("log", base=2)
    ax.set_xlim(low / 1.15, high * 1.15)
    first, last = math.floor(math.log2(low / 1.15)), math.ceil(math.log2(high * 1.15))
    step = max(1, math.ceil((last - first) / 8))  # at most about 8 ticks, 1x always among them
    ticks = [2.0**k for k in range(first, last + 1) if k % step == 0]
    ax.set_xticks(ticks, [f"{t:g}x" if t >= 1 else f"1/{1 / t:g}x" for t in ticks], fontsize=8.5)
    several = any(len(v) > 1 for values in table.values() for v in values.values())
    summary = "; marker: geometric mean over hidden sizes, bar: their range" if several else ""
    ax.set_xlabel(f"peer time / normkit time (right of 1: normkit faster){summary}", fontsize=8.5)
    handles = [Line2D([], [], color=DTYPE_COLORS.get(d, "black"), linewidth=6, label=d)
               for d in dict.fromkeys(d for d, _ in cells)]
    handles += [
        Line2D([], [], color="grey", marker=PASS_MARKERS.get(p, "D"), linestyle="none", label=p)
        for p in dict.fromkeys(p for _, p in cells)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8.5,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    return fig


def _throughput_panel(ax: Axes, rows: Sequence[Row], names: list[str], modes: list[str]) -> None:
    from matplotlib import rcParams

    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    lines: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        lines.setdefault((row["implementation"], row["mode"]), []).append(row)
    for (name, mode), points in lines.items():
        points.sort(key=lambda r: r["shape"][-1])
        role = points[0]["role"]
        ax.plot(
            [r["shape"][-1] for r in points], [r["gb_per_s"] for r in points],
            linestyle="-" if mode == modes[0] else "--", marker="o", markersize=3,
            linewidth={"normkit": 2.2, "peer": 1.2, "copy floor": 1.5}[role],
            color="grey" if role == "copy floor" else colors[names.index(name) % len(colors)],
            label=name if len(modes) == 1 else f"{name} [{mode}]",
        )


def throughput_figure(rows: Sequence[Row], title: str = "") -> Figure:
    """GB/s against hidden size: a figure row per backend and device, a column per dtype and
    pass, a line per implementation and mode (normkit thick, the copy floor grey, a backend's
    second mode dashed) and a legend per figure row."""
    _matplotlib()
    from matplotlib.figure import Figure

    rows = swept(rows)
    if not rows:
        raise ValueError("no rows to plot")
    fig_rows = list(dict.fromkeys((r["backend"], r["device"], r["memory"]) for r in rows))
    fig_cols = list(dict.fromkeys((r["dtype"], r["pass"]) for r in rows))
    fig = Figure(figsize=(3.4 * len(fig_cols) + 4.2, 2.9 * len(fig_rows)), layout="constrained")
    axes = fig.subplots(len(fig_rows), len(fig_cols), squeeze=False)
    hidden = sorted({r["shape"][-1] for r in rows})
    for i, (backend, device, memory) in enumerate(fig_rows):
        mine = [r for r in rows
                if (r["backend"], r["device"], r["memory"]) == (backend, device, memory)]
        names = list(dict.fromkeys(r["implementation"] for r in mine if r["role"] != "copy floor"))
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        for j, (dtype, pass_) in enumerate(fig_cols):
            ax = axes[i][j]
            _throughput_panel(ax, [r for r in mine if (r["dtype"], r["pass"]) == (dtype, pass_)],
                              names, modes)
            ax.set_xscale("log", base=2)
            ax.set_xticks(hidden, [str(h) for h in hidden])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{backend} {device}{_memory_note(memory)}, {dtype}, {pass_}", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if i == len(fig_rows) - 1:
                ax.set_xlabel("hidden size", fontsize=8.5)
            if j == 0:
                ax.set_ylabel("GB/s (bytes moved / median)", fontsize=8.5)
        handles, labels = [], []
        for ax in axes[i]:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                if label not in labels:
                    handles.append(handle)
                    labels.append(label)
        axes[i][-1].legend(handles, labels, fontsize=8, loc="upper left",
                           bbox_to_anchor=(1.02, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def detail_path(path: str | Path) -> Path:
    """Where `plot` writes the GB/s detail beside ``path``: ``NAME-gbps.png`` for ``NAME.png``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-gbps{path.suffix}")


def _save(figure: Figure, path: str | Path, dpi: int) -> None:
    """``figure`` written to ``path`` whole (`normkit.files.write_atomically`), in the format of
    its suffix."""
    suffix = Path(path).suffix.lstrip(".") or "png"
    write_atomically(path, lambda f: figure.savefig(f, dpi=dpi, format=suffix))


def plot(path: str | Path, rows: Sequence[Row], title: str = "") -> list[Path]:
    """Write the ratio figure to ``path`` and the GB/s detail to `detail_path` (PNG, or the
    format of the suffix); the ratio figure is left out when no normkit row has a peer. Returns
    the paths written."""
    written = []
    if ratios(rows):
        _save(ratio_figure(rows, title), path, dpi=110)
        written.append(Path(path))
        path = detail_path(path)
    _save(throughput_figure(rows, title), path, dpi=100)
    written.append(Path(path))
    return written
