"""The conformance report as a terminal table, Markdown and JSON."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from normkit import __version__, tolerances
from normkit.conformance.runner import PAIRWISE_FACTOR, Report
from normkit.spec import KINDS


def _summary(report: Report) -> tuple[list[str], list[list[str]]]:
    """Rows of target@device x kinds: passed/total and the worst error as a fraction of its bound."""
    cells: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [0, 0, 0, 0.0])  # pass, fail, skip, worst
    for r in report.results:
        cell = cells[(f"{r.target}@{r.device}", r.case.spec.kind)]
        cell[{"PASS": 0, "FAIL": 1, "SKIP": 2}[r.status]] += 1
        cell[3] = max(cell[3], r.worst)
    header = ["implementation", *KINDS, "passed", "failed", "skipped"]
    rows = []
    for name in sorted({row for row, _ in cells}):
        counts = [0, 0, 0]
        row = [name]
        for kind in KINDS:
            passed, failed, skipped, worst = cells.get((name, kind), [0, 0, 0, 0.0])
            counts = [counts[0] + passed, counts[1] + failed, counts[2] + skipped]
            total = passed + failed
            row.append(f"{passed}/{total} worst {worst:.2f}" if total else "-")
        rows.append([*row, *(str(c) for c in counts)])
    for name, reason in sorted(report.skipped_targets.items()):
        rows.append([name, *("-" for _ in KINDS), "0", "0", f"all: {reason}"])
    return header, rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pairwise_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    header = ["a", "b", "cases", "disagree", "worst", "example"]
    rows = [
        [p.a, p.b, str(p.cases), str(p.disagreements), f"{p.worst:.2f}", p.example]
        for p in sorted(report.pairwise, key=lambda p: (-p.worst, p.a, p.b))
    ]
    return header, rows


LEGEND = (
    "Cells: cases passed / run, and the worst error over forward output and gradients as a "
    "fraction of its tolerance (normkit.tolerances; above 1.00 fails)."
)


def text(report: Report, failures: int = 10) -> str:
    """The terminal summary: the table, failures (up to ``failures``), skips, pairwise worst."""
    header, rows = _summary(report)
    out = [_table(header, rows), "", LEGEND]
    failed = report.failed
    if failed:
        out += ["", f"{len(failed)} failed:"]
        out += [f"  {r.target}@{r.device} {r.case.label}: {r.reason}" for r in failed[:failures]]
        if len(failed) > failures:
            out.append(f"  ... and {len(failed) - failures} more (see --json)")
    skips = sorted({f"{r.target}@{r.device}: {r.reason}" for r in report.results if r.status == "SKIP"})
    if skips:
        out += ["", "skipped:"] + [f"  {s}" for s in skips[:failures]]
    if report.pairwise:
        worst = max(report.pairwise, key=lambda p: p.worst)
        disagreeing = sum(p.disagreements for p in report.pairwise)
        out += [
            "",
            f"pairwise: {len(report.pairwise)} pairs of implementations, {disagreeing} case disagreements; "
            f"worst {worst.worst:.2f} of {PAIRWISE_FACTOR:g}x the tolerance ({worst.a} vs {worst.b})",
        ]
    passed = sum(r.status == "PASS" for r in report.results)
    out += ["", f"{passed} passed, {len(failed)} failed, {sum(r.status == 'SKIP' for r in report.results)} skipped in {report.seconds:.0f} s"]
    return "\n".join(out)


def markdown(report: Report, title: str = "normkit conformance") -> str:
    """The report as Markdown: summary, pairwise agreement, failures."""
    header, rows = _summary(report)
    out = [f"# {title}", "", f"normkit {__version__}; {len(report.results)} case runs in {report.seconds:.0f} s.", "",
           _markdown_table(header, rows), "", LEGEND]
    if report.pairwise:
        ph, pr = _pairwise_rows(report)
        out += ["", "## Pairwise agreement", "",
                f"Worst difference between two implementations as a fraction of {PAIRWISE_FACTOR:g}x the tolerance.", "",
                _markdown_table(ph, pr)]
    if report.failed:
        out += ["", "## Failures", ""] + [f"- `{r.target}@{r.device}` {r.case.label}: {r.reason}" for r in report.failed]
    return "\n".join(out) + "\n"


def to_json(report: Report) -> str:
    """Every case with its figures, the skipped targets, devices and pairwise agreement."""
    return json.dumps(
        {
            "normkit": __version__,
            "seconds": report.seconds,
            "tolerances": {
                "forward_rel": tolerances.FORWARD_REL,
                "grad_rel": tolerances.GRAD_REL,
                "forward_ulps": tolerances.FORWARD_ULPS,
                "forward_ulps_before_scale": tolerances.FORWARD_ULPS_BEFORE_SCALE,
                "grad_ulps": tolerances.GRAD_ULPS,
                "ulp_floor": tolerances.ULP_FLOOR,
            },
            "devices": report.devices,
            "skipped_targets": report.skipped_targets,
            "summary": {s: sum(r.status == s for r in report.results) for s in ("PASS", "FAIL", "SKIP")},
            "cases": [r.to_dict() for r in report.results],
            "pairwise": [vars(p) for p in report.pairwise],
        },
        indent=1,
    )
