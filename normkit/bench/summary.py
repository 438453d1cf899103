"""What ``normkit bench`` prints first: the ratios a user wants, the host time per call at one
token, the targets' verdicts, and what each term means; at most 100 columns.

It reads a run as its JSON file holds it (``{"normkit", "quick", "versions", "machine",
"seconds", "rows", ...}``, see `normkit.bench`), so that a run and a combination of runs
(`normkit.bench.runs.merge`) print alike.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from normkit.bench.compare import Cell, Comparison, geomean, ratios
from normkit.bench.core import (
    AS_ALLOCATED,
    LATENCY,
    MEMORY_NOTE,
    PASSES,
    THROUGHPUT,
    TIMING_NOTE,
    TIMINGS,
    TOKEN_SHAPE,
    swept,
)
from normkit.bench.targets import PARITY_RUNS, Verdict

Row = dict[str, Any]
WIDTH = 100
HEADING = "normkit layer vs framework layer"
def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def header(data: Mapping[str, Any], runs: int = 1) -> list[str]:
    """The run: what, how long, on what machine and how busy it was, and the versions."""
    machine = data.get("machine") or {}
    load = machine.get("load_average") or []
    busy = ""
    if load:
        busy = f", load average {load[0]:.1f} at the start" + (
            f" and {load[1]:.1f} at the end" if len(load) > 1 else "")
        if machine.get("cpus") and max(load) > 0.5 * machine["cpus"]:
            busy += " (other work shared the cores: single figures move more)"
    cpus = f" on {machine['cpus']} CPUs" if machine.get("cpus") else ""
    what = "bench --quick" if data.get("quick") else "bench"
    if runs > 1:
        what += f", {runs} runs combined (each figure their median)"
    lines = _wrap(f"normkit {data.get('normkit', '?')} {what}: {data.get('seconds', 0):.0f} s"
                  f"{cpus}{busy}", "")
    versions = "; ".join(f"{b}: " + ", ".join(f"{k} {v}" for k, v in vs.items())
                         for b, vs in (data.get("versions") or {}).items())
    if versions:
        lines += _wrap(versions)
    return lines


def _shapes(rows: Sequence[Row]) -> str:
    shapes = sorted({tuple(r["shape"]) for r in swept(rows)}, key=lambda s: s[1])
    return ", ".join(f"{r} x {h}" for r, h in shapes)


def _panels(table: Mapping[Comparison, Any]) -> list[tuple[str, str, str, str, str]]:
    """(backend, device, mode, memory, dtype) in the order measured."""
    return list(dict.fromkeys((c.backend, c.device, c.mode, c.memory, cell[0])
                              for c, cells in table.items() for cell in cells))


def _title(backend: str, device: str, mode: str, memory: str, dtype: str) -> str:
    on = "" if memory == AS_ALLOCATED else f", outputs {memory}"
    return f"{backend} on {device}, {mode}, {dtype}{on}"


def _label(comparison: Comparison) -> str:
    """``"RMSNorm vs torch.nn.RMSNorm"``."""
    return comparison.label()


def _headline(rows: Sequence[Row]) -> dict[Comparison, dict[Cell, list[float]]]:
    """The ratios of normkit's layers as users build them (no kernel option) against the
    frameworks' own layers and Liger's (not the Llama RMSNorm in torch ops); every pair is in
    the table and the JSON."""
    return {c: cells for c, cells in ratios(rows).items()
            if "(" not in c.normkit and not c.peer.startswith("Llama")}


def _number(value: float | None, width: int = 9, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def _span(width: int, heads: Sequence[str], span: int) -> str:
    """A header line naming, after ``width`` characters, groups of columns ``span`` wide."""
    return (" " * width + "".join(f"{h:^{span}}" for h in heads)).rstrip()


def speed(rows: Sequence[Row]) -> list[str]:
    """Per backend, device, mode and dtype: each normkit layer against each framework layer of
    its kind, the geometric mean over hidden sizes of the ratio, per pass and timing."""
    table = _headline(swept(rows))
    if not table:
        return []
    timings = [t for t in TIMINGS if any(c[2] == t for v in table.values() for c in v)]
    width = max(len(HEADING), *(len(_label(c)) for c in table)) + 6
    column = 11 if len(timings) > 1 else 18
    lines = _wrap(f"Speed at {_shapes(rows)}: the framework layer's time / normkit's (above 1: "
                  "normkit faster)" + ("" if len(timings) > 1 else f", {timings[0]} timing"), "")
    for panel in _panels(table):
        lines += ["", f"  {_title(*panel)}"]
        if len(timings) > 1:
            lines.append(_span(width, PASSES, column * len(timings)))
            heads = [t for _ in PASSES for t in timings]
        else:
            heads = list(PASSES)
        lines.append(f"    {HEADING:<{width - 4}}" + "".join(f"{h:>{column}}" for h in heads))
        for comparison in (c for c in table if (c.backend, c.device, c.mode, c.memory) ==
                           panel[:4] and any(cell[0] == panel[4] for cell in table[c])):
            cells = table[comparison]
            values = [cells.get((panel[4], p, t)) for p in PASSES for t in timings]
            lines.append(f"    {_label(comparison):<{width - 4}}"
                         + "".join(_number(geomean(v) if v else None, column) for v in values))
    return lines


def token(rows: Sequence[Row]) -> list[str]:
    """Host microseconds per call at `TOKEN_SHAPE`, throughput timing: each normkit layer and
    each framework layer of its kind, forward and forward+backward."""
    chosen = [r for r in rows if tuple(r["shape"]) == TOKEN_SHAPE and r.get("host_s")
              and r.get("timing", LATENCY) == THROUGHPUT and r["memory"] == AS_ALLOCATED]
    by_key = {(r["backend"], r["device"], r["mode"], r["dtype"], r["pass"], r["implementation"]):
              r for r in chosen}
    table = _headline(chosen)
    if not table:
        return []
    shape = " x ".join(map(str, TOKEN_SHAPE))
    width = max(len(HEADING), *(len(_label(c)) for c in table)) + 6
    lines = [f"One token ({shape}): microseconds of host time per call, throughput timing",
             "(on the CPU, where a call computes before it returns, the whole call)"]
    for panel in _panels(table):
        lines += ["", f"  {_title(*panel)}",
                  _span(width, ("forward", "forward+backward"), 20),
                  f"    {HEADING:<{width - 4}}" + f"{'normkit':>10}{'framework':>10}" * 2]
        for comparison in (c for c in table if (c.backend, c.device, c.mode, c.memory) ==
                           panel[:4] and any(cell[0] == panel[4] for cell in table[c])):
            cells = []
            for pass_ in PASSES:
                for name in (comparison.normkit, comparison.peer):
                    row = by_key.get((comparison.backend, comparison.device, comparison.mode,
                                      panel[4], pass_, name))
                    cells.append(None if row is None else row["host_s"] * 1e6)
            lines.append(f"    {_label(comparison):<{width - 4}}"
                         + "".join(_number(v, 10, 1) for v in cells))
    return lines


def verdicts(judged: Sequence[Verdict]) -> list[str]:
    """Each target's verdict and values, family by family."""
    if not judged:
        return []
    met = sum(v.met for v in judged)
    quick = any(v.quick for v in judged)
    undecided = [v for v in judged if not v.final]
    head = f"Targets (docs/benchmarks.md): {met} of {len(judged)} met"
    if quick:
        head += "; a quick run: every verdict is indicative, at its shapes"
    elif undecided:
        head += (f"; {len(undecided)} decided by the median of {PARITY_RUNS} full runs, their "
                 "verdict marked with the runs read (1/3)")
    lines = _wrap(head, "")
    families: dict[str, list[Verdict]] = {}
    for v in judged:
        families.setdefault(v.target.family, []).append(v)
    for family, members in families.items():
        width = max(len(v.target.case) for v in members) + 2
        first = members[0]
        sizes = ["x".join(map(str, TOKEN_SHAPE)) if first.target.token else str(h)
                 for h in first.values]
        lines += ["", *_wrap(family),
                  f"    {'verdict':<12}{'target':<{width}}" + "".join(f"{h:>7}" for h in sizes)]
        for v in members:
            word = "met" if v.met else "NOT MET"
            if not (v.final or v.quick):
                word += f" {v.runs}/{v.target.runs}"
            values = "".join(f"{'-' if x is None else v.target.cell(x):>7}"
                             for x in v.values.values())
            lines.append(f"    {word:<12}{v.target.case:<{width}}{values}")
    return lines


def terms(rows: Sequence[Row], judged: Sequence[Verdict] = ()) -> list[str]:
    """What the terms printed above mean."""
    lines = ["Terms"]
    timings = {r.get("timing", LATENCY) for r in rows}
    for timing in TIMINGS:
        if timing in timings:
            lines += _wrap(TIMING_NOTE[timing])
    lines += _wrap("ratio: the median time per call of the framework's layer over normkit's, "
                   "both timed side by side in one group (one backend, device, mode, dtype, "
                   "shape, pass and timing), with a copy of the same bytes; forward+backward: "
                   "the gradients of x and of the parameters, given dy")
    lines += _wrap("host time: the host's time in a call, until it returns, before the wait for "
                   "the device")
    if any(r["memory"] != AS_ALLOCATED for r in rows):
        lines += _wrap(MEMORY_NOTE)
    if any(not (v.final or v.quick) for v in judged):
        lines += _wrap("1/3: a target within the noise of its bound, decided by the median of "
                       "three full runs (normkit bench --combine A.json B.json C.json); its "
                       "verdict read 1 of them")
    return lines


def summary(data: Mapping[str, Any], judged: Sequence[Verdict], runs: int = 1) -> str:
    """The summary: header, speed ratios, one token's host time, targets, terms."""
    rows = data.get("rows") or []
    sections: Iterable[list[str]] = (
        header(data, runs), speed(rows), token(rows), verdicts(judged), terms(rows, judged),
    )
    return "\n\n".join("\n".join(s) for s in sections if s)


def skipped(data: Mapping[str, Any]) -> list[str]:
    """The backends or views skipped, and why."""
    return [line for name, why in (data.get("skipped") or {}).items()
            for line in _wrap(f"{name}: skipped, {why}", "")]

