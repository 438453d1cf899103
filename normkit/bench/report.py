"""The benchmark's outputs: a terminal table, a JSON file and a plot (matplotlib imported lazily)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

def _ratios(row: dict[str, Any]) -> str:
    return ", ".join(f"{peer} {r:.2f}" for peer, r in row["ratios"].items() if not peer.startswith("normkit."))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per row, a header per group; normkit's rows list ``peer median / its median``."""
    lines: list[str] = []
    head = f"  {'implementation':<40} {'median ms':>10} {'GB/s':>7} {'of copy':>7}  ratios (peer/this)"
    last: tuple[Any, ...] | None = None
    for row in rows:
        key = (row["backend"], row["device"], row["dtype"], tuple(row["shape"]), row["pass"], row["mode"])
        if key != last:
            shape = "x".join(map(str, row["shape"]))
            lines += [f"{row['backend']} {row['device']} {row['dtype']} {shape} {row['pass']} ({row['mode']})", head]
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


def write_json(path: str | Path, rows: Sequence[dict[str, Any]], **meta: Any) -> None:
    """Write ``{**meta, "rows": rows}`` to ``path``."""
    Path(path).write_text(json.dumps({**meta, "rows": list(rows)}, indent=1) + "\n")


def plot(path: str | Path, rows: Sequence[dict[str, Any]], title: str = "") -> None:
    """Write a PNG of GB/s against hidden size: one panel per backend x device (a figure row) and
    dtype x pass (a column), one line per implementation and mode (normkit thick, the copy floor
    grey, a second mode dashed), one legend per figure row."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'normkit[bench]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no rows to plot")
    fig_rows = list(dict.fromkeys((r["backend"], r["device"]) for r in rows))
    fig_cols = list(dict.fromkeys((r["dtype"], r["pass"]) for r in rows))
    fig, axes = plt.subplots(len(fig_rows), len(fig_cols), figsize=(3.3 * len(fig_cols) + 2.6, 2.7 * len(fig_rows)),
                             squeeze=False, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (backend, device) in enumerate(fig_rows):
        mine = [r for r in rows if (r["backend"], r["device"]) == (backend, device)]
        names = list(dict.fromkeys(r["implementation"] for r in mine if r["role"] != "copy floor"))
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        for j, (dtype, pass_) in enumerate(fig_cols):
            ax = axes[i][j]
            lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for row in mine:
                if (row["dtype"], row["pass"]) == (dtype, pass_):
                    lines.setdefault((row["implementation"], row["mode"]), []).append(row)
            for (name, mode), points in lines.items():
                points.sort(key=lambda r: r["shape"][1])
                role = points[0]["role"]
                ax.plot(
                    [r["shape"][1] for r in points], [r["gb_per_s"] for r in points],
                    linestyle="-" if mode == modes[0] else "--", marker="o", markersize=2.5,
                    linewidth={"normkit": 2.0, "peer": 1.0, "copy floor": 1.4}[role],
                    color="grey" if role == "copy floor" else colors[names.index(name) % len(colors)],
                    label=name if len(modes) == 1 else f"{name} [{mode}]",
                )
            ax.set_xscale("log", base=2)
            hidden = sorted({r["shape"][1] for r in mine})
            ax.set_xticks(hidden, [str(h) for h in hidden])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{backend} {device} {dtype} {pass_}", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
            if i == len(fig_rows) - 1:
                ax.set_xlabel("hidden size", fontsize=7)
            if j == 0:
                ax.set_ylabel("GB/s (bytes moved / median)", fontsize=7)
        handles, labels = axes[i][0].get_legend_handles_labels()
        for ax in axes[i][1:]:
            for h, label in zip(*ax.get_legend_handles_labels()):
                if label not in labels:
                    handles.append(h)
                    labels.append(label)
        axes[i][-1].legend(handles, labels, fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=72)
    plt.close(fig)
