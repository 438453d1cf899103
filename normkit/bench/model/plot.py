"""The model benchmark's figures, from its runs (see `normkit.bench.model`).

- `step_time_figure`: the median step time per norm, a panel per framework and mode, with the
  band where RMSNorm would fall if the RMSNorm paper's 7%-64% held against that panel's
  LayerNorm (the framework's own).
- `loss_figure`: the loss against the step and against the time spent in the steps, a line per
  norm (colour) and framework (line style), compiled runs.

matplotlib is imported only when a figure is drawn (``pip install 'normkit[bench]'``), without
pyplot, so no global plotting state changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normkit.bench.model.config import IDENTITY, MODES, NORMS, ModelConfig
from normkit.bench.plot import _matplotlib  # the bench's figures' check: matplotlib installed
from normkit.files import write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Run = dict[str, Any]
PAPER_SPEEDUP = (0.07, 0.64)
"""The RMSNorm paper's running-time reductions against LayerNorm, lowest and highest."""
SHORT = {"own-layer": "own\nLayerNorm", "own-rms": "own\nRMSNorm", "layer": "normkit\nLayerNorm",
         "rms": "normkit\nRMSNorm", "partial-rms": "normkit\npRMSNorm", "dyt": "normkit\nDyT",
         IDENTITY: "identity"}
COLORS = {"own-layer": "#7f7f7f", "own-rms": "#bcbd22", "layer": "#1f77b4", "rms": "#ff7f0e",
          "partial-rms": "#2ca02c", "dyt": "#9467bd", IDENTITY: "#e0e0e0"}
LINESTYLES: dict[str, Any] = {"torch": "-", "keras": "--", "flax": ":"}


def _timed(run: Run, config: ModelConfig) -> list[float]:
    return [float(s) for s in run["step_s"][config.timing_warmup:]]


def step_time_figure(runs: Sequence[Run], config: ModelConfig, title: str = "") -> Figure:
    """Median step time (ms) per norm: a column per framework, a row per mode; a bar per norm
    (normkit's coloured, the framework's own grey and olive, the identity hatched), its
    interquartile range as an error bar, its ratio to the panel's LayerNorm above it, and the
    band 0.36-0.93 of that LayerNorm: where RMSNorm's step would be if the paper's 7%-64%
    held."""
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    frameworks = list(dict.fromkeys(r["framework"] for r in runs))
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    if not frameworks or not modes:
        raise ValueError("no runs to plot")
    fig = Figure(figsize=(3.6 * len(frameworks) + 0.6, 2.9 * len(modes) + 0.9),
                 layout="constrained")
    axes = fig.subplots(len(modes), len(frameworks), squeeze=False)
    for (i, mode), (j, framework) in itertools.product(enumerate(modes), enumerate(frameworks)):
        ax = axes[i][j]
        mine = {r["norm"]: r for r in runs if (r["framework"], r["mode"]) == (framework, mode)
                and _timed(r, config)}
        names = [n for n in (*NORMS, IDENTITY) if n in mine]
        medians = [1e3 * float(np.median(_timed(mine[n], config))) for n in names]
        low = [m - 1e3 * float(np.percentile(_timed(mine[n], config), 25))
               for n, m in zip(names, medians, strict=True)]
        high = [1e3 * float(np.percentile(_timed(mine[n], config), 75)) - m
                for n, m in zip(names, medians, strict=True)]
        ax.bar(range(len(names)), medians, color=[COLORS[n] for n in names],
               hatch=["//" if n == IDENTITY else "" for n in names], edgecolor="black",
               linewidth=0.5, yerr=[low, high], capsize=2, error_kw={"linewidth": 0.7})
        if "own-layer" in names:
            layer = medians[names.index("own-layer")]
            ax.axhspan(layer * (1 - PAPER_SPEEDUP[1]), layer * (1 - PAPER_SPEEDUP[0]),
                       color="#2ca02c", alpha=0.12, zorder=0)
            ax.axhline(layer, color="black", linewidth=0.7, linestyle="--", zorder=0)
            for k, median in enumerate(medians):
                ax.text(k, median + high[k], f"{median / layer:.2f}", ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), [SHORT[n] for n in names], fontsize=7, rotation=45,
                      ha="right", rotation_mode="anchor")
        compiler = next((r["compiler"] for r in mine.values() if r["compiler"]), None)
        ax.set_title(f"{framework}, {compiler or mode}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7.5)
        ax.set_ylim(0, max(m + h for m, h in zip(medians, high, strict=True)) * 1.18)
        if j == 0:
            ax.set_ylabel("median step time (ms)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles = [
        Patch(facecolor="#2ca02c", alpha=0.25, label="RMSNorm paper: 7%-64% faster than "
              "LayerNorm (the panel's own, dashed)"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="no norm (identity)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    fig.suptitle(title or "Training step (forward, backward, AdamW); numbers: time / LayerNorm's",
                 fontsize=9.5)
    return fig


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    """The running mean over the last ``window`` values (fewer at the start)."""
    sums = np.cumsum(np.asarray(values, dtype=np.float64))
    starts = np.concatenate([np.zeros(window), sums[:-window]]) if len(sums) > window else None
    counts = np.minimum(np.arange(1, len(sums) + 1), window)
    if starts is None:
        return sums / counts
    return (sums - starts[: len(sums)]) / counts


def loss_figure(runs: Sequence[Run], config: ModelConfig, title: str = "") -> Figure:
    """The compiled runs' loss (the eager runs' where none was compiled; running mean over a
    thirtieth of the steps) against the step and against the time spent in the steps after the
    first (whose compilation is left out), log scale: a colour per norm, a line style per
    framework."""
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    trained = [r for r in runs if r["norm"] != IDENTITY and len(r["losses"]) > 1]
    mode = "compiled" if any(r["mode"] == "compiled" for r in trained) else "eager"
    curves = [r for r in trained if r["mode"] == mode]
    if not curves:
        raise ValueError("no run with losses to plot")
    window = max(1, config.steps // 30)
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    for run in curves:
        style = {"color": COLORS[run["norm"]], "linestyle": LINESTYLES.get(run["framework"], "-"),
                 "linewidth": 1.2}
        smooth = _smooth(run["losses"], window)
        by_step.plot(range(len(smooth)), smooth, **style)
        by_time.plot(np.cumsum(run["step_s"][1:]), smooth[1:], **style)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax in (by_step, by_time):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3, which="both")
        ax.tick_params(labelsize=8)
    by_step.set_xlabel("step", fontsize=8.5)
    by_time.set_xlabel("seconds in the steps (compilation, the first step's, left out)",
                       fontsize=8.5)
    by_step.set_ylabel(f"training loss (running mean of {window} steps)", fontsize=8.5)
    norms = [n for n in NORMS if any(r["norm"] == n for r in curves)]
    frameworks = list(dict.fromkeys(r["framework"] for r in curves))
    handles = [Line2D([], [], color=COLORS[n], label=SHORT[n].replace("\n", " ")) for n in norms]
    handles += [Line2D([], [], color="black", linestyle=LINESTYLES.get(f, "-"), label=f)
                for f in frameworks]
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    fig.suptitle(title or f"Sorting task, {mode} runs: loss per step and per second",
                 fontsize=9.5)
    return fig


def loss_path(path: str | Path) -> Path:
    """Where `plot` writes the loss figure beside ``path``: ``NAME-loss.png`` for ``NAME.png``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-loss{path.suffix}")


def _save(figure: Figure, path: str | Path) -> None:
    suffix = Path(path).suffix.lstrip(".") or "png"
    write_atomically(path, lambda f: figure.savefig(f, dpi=90, format=suffix))


def plot(path: str | Path, runs: Sequence[Run], config: ModelConfig, title: str = "") -> list[Path]:
    """Write the step-time figure to ``path`` and the loss figure to `loss_path` (the loss
    figure only when a norm's run has two losses or more). Returns the paths written."""
    _save(step_time_figure(runs, config, title), path)
    written = [Path(path)]
    if any(r["norm"] != IDENTITY and len(r["losses"]) > 1 for r in runs):
        _save(loss_figure(runs, config, title), loss_path(path))
        written.append(loss_path(path))
    return written
