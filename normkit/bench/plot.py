"""The benchmark's figures, from its rows (see `normkit.bench` for the row schema).

- `ratio_figure`: at a glance, how much faster or slower each normkit layer is than each
  framework layer of the same kind, per backend and device, dtype and pass, a column of panels
  per timing (latency, throughput).
- `throughput_figure`: the detail, GB/s against hidden size for every implementation and the
  copy floor, a row of panels per timing.

Each figure carries a caption under it that says what is drawn and what the terms mean.

matplotlib is imported only when a figure is drawn (``pip install 'normkit[bench]'``); the
figures are drawn on their own canvas, without pyplot, so no global plotting state changes.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normkit.bench.compare import geomean, ratios
from normkit.bench.core import AS_ALLOCATED, LATENCY, MEMORY_NOTE, TIMING_NOTE, TIMINGS, swept
from normkit.files import write_atomically

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Row = dict[str, Any]
PASS_MARKERS = {"forward": "o", "forward+backward": "s"}
DTYPE_COLORS = {"float32": "#1f77b4", "bfloat16": "#ff7f0e", "float16": "#2ca02c"}
CAPTION_FONT = 8.5


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the benchmark figures need matplotlib: pip install 'normkit[bench]'"
        ) from exc


def _memory_note(memory: str) -> str:
    """A panel title's note of the memory view; nothing for the default one."""
    return "" if memory == AS_ALLOCATED else f" (outputs {memory})"


def _caption(fig: Figure, text: str) -> None:
    """``text`` under the figure, wrapped to its width, whole."""
    columns = int(fig.get_figwidth() * 72 / (CAPTION_FONT * 0.55))
    fig.supxlabel(textwrap.fill(text, columns), fontsize=CAPTION_FONT, ha="left", x=0.01,
                  linespacing=1.3)


def _timings(rows: Sequence[Row]) -> list[str]:
    present = {r.get("timing", LATENCY) for r in rows}
    return [t for t in TIMINGS if t in present]


def _timing_notes(timings: Sequence[str]) -> str:
    return " ".join(f"{TIMING_NOTE[t][0].upper()}{TIMING_NOTE[t][1:]}." for t in timings)


def ratio_figure(rows: Sequence[Row], title: str = "") -> Figure:
    """Speed ratios against each peer: a row of panels per backend, device and memory view, a
    column per timing (latency, throughput); one line of a panel per (normkit layer, peer,
    mode), a marker per dtype (colour) and pass (shape) at the geometric mean over the hidden
    sizes, a bar over their range. Log scale; 1 is parity. The caption under it says so."""
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    table = ratios(swept(rows))
    if not table:
        raise ValueError("no normkit row has a peer of its kind: no ratios to plot")
    panels = list(dict.fromkeys((c.backend, c.device, c.memory) for c in table))
    timings = _timings(swept(rows))
    cells = list(dict.fromkeys((d, p) for values in table.values() for d, p, _ in values))
    heights = [sum((c.backend, c.device, c.memory) == panel for c in table) for panel in panels]
    width = 4.0 + 4.5 * len(timings)
    fig = Figure(figsize=(width, 2.4 + 0.55 * sum(heights) + 0.5 * len(panels)),
                 layout="constrained")
    axes = fig.subplots(len(panels), len(timings), squeeze=False, sharex=True, sharey="row",
                        gridspec_kw={"height_ratios": heights})
    every = [r for values in table.values() for v in values.values() for r in v]
    low, high = min(every + [0.8]), max(every + [1.25])
    for i, (backend, device, memory) in enumerate(panels):
        comparisons = [c for c in table if (c.backend, c.device, c.memory) == (
            backend, device, memory)]
        show_mode = len({c.mode for c in comparisons}) > 1
        for j, timing in enumerate(timings):
            ax = axes[i][j]
            for k, comparison in enumerate(comparisons):
                for m, (dtype, pass_) in enumerate(cells):
                    values = table[comparison].get((dtype, pass_, timing))
                    if not values:
                        continue
                    y = k + (m - (len(cells) - 1) / 2) * 0.7 / max(1, len(cells))
                    color = DTYPE_COLORS.get(dtype, "black")
                    ax.plot([min(values), max(values)], [y, y], color=color, linewidth=1.2,
                            alpha=0.6)
                    ax.plot([geomean(values)], [y], marker=PASS_MARKERS.get(pass_, "D"),
                            color=color, markersize=6, linestyle="none")
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_yticks(range(len(comparisons)),
                          [c.label(show_mode) for c in comparisons], fontsize=8.5)
            ax.set_ylim(len(comparisons) - 0.5, -0.5)
            ax.set_title(f"{backend} on {device}{_memory_note(memory)}, {timing}", fontsize=10,
                         loc="left")
            ax.grid(axis="x", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xscale("log", base=2)
        ax.set_xlim(low / 1.15, high * 1.15)
        first, last = math.floor(math.log2(low / 1.15)), math.ceil(math.log2(high * 1.15))
        step = max(1, math.ceil((last - first) / 8))  # at most about 8 ticks, 1x among them
        ticks = [2.0**k for k in range(first, last + 1) if k % step == 0]
        ax.set_xticks(ticks, [f"{t:g}x" if t >= 1 else f"1/{1 / t:g}x" for t in ticks],
                      fontsize=8.5)
        ax.set_xlabel("framework layer's time / normkit's", fontsize=8.5)
    handles = [Line2D([], [], color=DTYPE_COLORS.get(d, "black"), linewidth=6, label=d)
               for d in dict.fromkeys(d for d, _ in cells)]
    handles += [
        Line2D([], [], color="grey", marker=PASS_MARKERS.get(p, "D"), linestyle="none", label=p)
        for p in dict.fromkeys(p for _, p in cells)
    ]
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize=8.5,
               frameon=False)
    several = any(len(v) > 1 for values in table.values() for v in values.values())
    summary = (" Marker: the geometric mean over the hidden sizes; bar: their range."
               if several else "")
    memory = f" Outputs {MEMORY_NOTE}." if any(m != AS_ALLOCATED for _, _, m in panels) else ""
    _caption(fig, "Each line: a normkit layer against a framework layer of its kind (its mode "
                  "in brackets where the backend has several), timed side by side; right of 1 "
                  f"normkit is faster (log scale).{summary} {_timing_notes(timings)}{memory}")
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
    """GB/s against hidden size: a figure row per backend, device, memory view and timing, a
    column per dtype and pass, a line per implementation and mode (normkit thick, the copy floor
    grey, a backend's second mode dashed) and a legend per figure row."""
    _matplotlib()
    from matplotlib.figure import Figure

    rows = swept(rows)
    if not rows:
        raise ValueError("no rows to plot")

    def where(r: Row) -> tuple[str, str, str, str]:
        return r["backend"], r["device"], r["memory"], r.get("timing", LATENCY)

    fig_rows = list(dict.fromkeys(where(r) for r in rows))
    fig_cols = list(dict.fromkeys((r["dtype"], r["pass"]) for r in rows))
    fig = Figure(figsize=(3.4 * len(fig_cols) + 4.2, 2.9 * len(fig_rows) + 0.8),
                 layout="constrained")
    axes = fig.subplots(len(fig_rows), len(fig_cols), squeeze=False)
    hidden = sorted({r["shape"][-1] for r in rows})
    for i, (backend, device, memory, timing) in enumerate(fig_rows):
        mine = [r for r in rows if where(r) == (backend, device, memory, timing)]
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
            ax.set_title(f"{backend} {device}{_memory_note(memory)}, {timing},\n{dtype}, "
                         f"{pass_}", fontsize=9)
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
    memory = (f" Outputs {MEMORY_NOTE}." if any(m != AS_ALLOCATED for _, _, m, _ in fig_rows)
              else "")
    _caption(fig, "Bytes a pass must move (forward: x and y; forward+backward: x, y, x, dy, dx) "
                  "over the median time per call; grey: a copy of the same bytes in the same "
                  f"framework. {_timing_notes(_timings(rows))}{memory}")
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
