"""The conformance report as a terminal table, Markdown and JSON."""

from __future__ import annotations

import io
import json
import textwrap
from collections import defaultdict
from typing import Any

from normkit import __version__, tolerances
from normkit.conformance.batch_invariance import BATCH_ROWS, BatchInvariance
from normkit.conformance.cases import FEATURES
from normkit.conformance.runner import PAIRWISE_FACTOR, Report
from normkit.identify import Identification
from normkit.identify.differences import differences as identify_differences
from normkit.spec import ALL_KINDS, NormSpec

WIDTH = 100
"""The terminal summary's width: its table and lines fit it."""


def _summary(report: Report) -> tuple[list[str], list[list[str]]]:
    """Rows of target@device: cases passed / run per kind, skipped, and the worst error in
    float32/float64 (as a fraction of its bound) and in half precision (in ulps)."""
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # passed, failed
    skipped: dict[str, int] = defaultdict(int)
    worst: dict[tuple[str, bool], float] = {}
    for r in report.results:
        name = f"{r.target}@{r.device}"
        if r.status == "SKIP":
            skipped[name] += 1
            continue
        cells[(name, r.case.spec.kind)][r.status == "FAIL"] += 1
        for m in r.measurements.values():
            half = m["bound"]["unit"] == "ulp"
            figure = m["max_ulp"] if half else m["error"] / m["bound"]["value"]
            worst[(name, half)] = max(worst.get((name, half), 0.0), figure)
    header = ["implementation", *ALL_KINDS, "skipped", "worst f32/64", "worst half ulp"]
    rows = []
    names = {row for row, _ in cells} | set(skipped) | set(report.batch_invariance)
    for name in sorted(names):
        row = [name]
        for kind in ALL_KINDS:
            passed, failed = cells.get((name, kind), [0, 0])
            row.append(f"{passed}/{passed + failed}" if passed + failed else "-")
        row.append(str(skipped.get(name, 0)))
        row += [f"{worst[(name, half)]:.2g}" if (name, half) in worst else "-"
                for half in (False, True)]
        rows.append(row)
    for name in sorted(report.skipped_targets):
        rows.append([name, *("-" for _ in ALL_KINDS), "all", "-", "-"])
    return header, rows


def _invariance_cell(found: dict[str, Any]) -> str:
    """One probe's finding: "invariant", what the bits depend on, or why it did not run."""
    if "skip" in found or "error" in found:
        return f"not checked: {found.get('skip') or found['error']}"
    checked = BatchInvariance(**found)
    return ", ".join(checked.dependencies()) or "invariant"


def _invariance_verdict(probes: dict[str, dict[str, Any]]) -> str:
    """A target's summary over the probes: "yes" (threads included where checked), or what
    the bits depend on and for which probes."""
    checked = {
        label: BatchInvariance(**found)
        for label, found in probes.items()
        if "skip" not in found and "error" not in found
    }
    if not checked:
        reasons = sorted({found.get("skip") or found.get("error", "") for found in probes.values()})
        return f"not checked: {'; '.join(reasons)}" if reasons else "not checked"
    depending = {label: c.dependencies() for label, c in checked.items() if c.dependencies()}
    if not depending:
        threads = all(c.threads for c in checked.values())
        return "yes, thread count too" if threads else "yes"
    found = sorted({d for ds in depending.values() for d in ds})
    return f"no: depends on the {', '.join(found)} ({'; '.join(depending)})"


def _invariance_lines(report: Report) -> list[str]:
    """The terminal's batch-invariance section: the targets grouped by verdict, and whether it
    matters."""
    if not report.batch_invariance:
        return []
    by_verdict: dict[str, list[str]] = defaultdict(list)
    for name, probes in sorted(report.batch_invariance.items()):
        by_verdict[_invariance_verdict(probes)].append(name)
    lines = ["", "batch-invariant (does a row's output depend on the rest of its batch?):"]
    for verdict, names in sorted(by_verdict.items()):
        lines += _wrapped(f"{verdict}: {', '.join(names)}", "  ")
    lines += _wrapped(INVARIANCE_LEGEND, "")
    return lines


def _invariance_section(report: Report) -> list[str]:
    """The Markdown section: target@device x probe, what a row's output bits depend on."""
    if not report.batch_invariance:
        return []
    labels = list(dict.fromkeys(label for p in report.batch_invariance.values() for label in p))
    rows = [
        [name, *(_invariance_cell(probes[label]) if label in probes else "-" for label in labels)]
        for name, probes in sorted(report.batch_invariance.items())
    ]
    return [
        "",
        "## Batch invariance",
        "",
        "Whether a row's output bits depend on the batch it is computed in: its row count "
        f"(batches of {', '.join(map(str, BATCH_ROWS))} rows), their order, the row's position "
        "and, where the framework can set it, the thread count (1 and 2). Rows of each "
        "probe's dtype and size, normalized by its kind (a built-in layer by the spec it "
        "appears to implement).",
        "",
        _markdown_table(["implementation", *labels], rows),
    ]


def _features(report: Report) -> tuple[list[str], list[list[str]]]:
    """Rows of target@device x `FEATURES` (the extended fields, DyT, float64): passed/run."""
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in report.results:
        if r.status != "SKIP":
            for feature in r.case.features:
                cells[(f"{r.target}@{r.device}", feature)][r.status == "FAIL"] += 1
    seen = [f for f in FEATURES if any(feature == f for _, feature in cells)]
    rows = []
    for name in sorted({row for row, _ in cells}):
        row = [name]
        for feature in seen:
            passed, failed = cells.get((name, feature), [0, 0])
            row.append(f"{passed}/{passed + failed}" if passed + failed else "-")
        rows.append(row)
    return ["implementation", *seen], rows


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` as lines of at most `WIDTH` characters, continued 2 spaces further in."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table drawn by rich (imported here only), at most `WIDTH` wide."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in header:
        table.add_column(Text(name), overflow="fold")  # a long name wraps, never cut
    for row in rows:
        table.add_row(*map(Text, row))  # Text: a name like tf[jax,jit] is not markup
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None, emoji=False)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


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
    "rms, partial_rms, layer, dyt: cases passed / run (a case: one spec, dtype and shape, "
    "forward and backward). skipped: cases the target cannot compute (named below). "
    "worst f32/64: the worst error of any output or gradient in float32 or float64, as a "
    "fraction of its bound (1e-6 of max|ref| for outputs, 1e-5 for gradients; above 1 fails). "
    "worst half ulp: the worst error in float16 or bfloat16, in ulps from normkit's correctly "
    "rounded reference: a correct float32 computation reaches 1 where it rounds a near-tie the "
    "other way (bounds: 1 ulp for outputs, 2 with cast='before_scale' and for gradients; "
    "normkit.tolerances)."
)


INVARIANCE_LEGEND = (
    "Batch invariance is not part of the verdict: every row above is within its bound in "
    "whatever batch it ran. It matters only where a row's bits must not depend on the rest of "
    "its batch (deterministic serving, bit-exact replays): there use a target marked yes, or "
    "run rows in batches of a fixed size. The probes (row counts 1 to 509, reversed order, a "
    "row moved through the batch, 1 and 2 threads where set) are in "
    "normkit.conformance.batch_invariance; --markdown has each one."
)


def _lean_line(report: Report) -> str:
    return (
        f"{', '.join(report.lean)} compile each program, so they ran the lean default matrix: "
        "every kind, dtype, option and kind of rows, on fewer shapes and combinations "
        "(normkit.conformance.cases.lean); --full runs every case on every target."
    )


def _stopped(report: Report) -> str:
    """What a summary line adds for a run stopped before the end, else ""."""
    return ", interrupted before the end of the matrix" if report.interrupted else ""


def text(report: Report, failures: int = 10) -> str:
    """The terminal summary: the table, failures (up to ``failures``), skips, pairwise worst."""
    header, rows = _summary(report)
    out = [_table(header, rows), "", *_wrapped(LEGEND, "")]
    if report.lean:
        out += _wrapped(_lean_line(report), "")
    out += _invariance_lines(report)
    failed = report.failed
    if failed:
        out += ["", f"{len(failed)} failed:"]
        for r in failed[:failures]:
            out += _wrapped(f"{r.target}@{r.device} {r.case.label}: {r.reason}", "  ")
        if len(failed) > failures:
            out.append(f"  ... and {len(failed) - failures} more (see --json)")
    skips = [f"{name}: not run: {why}" for name, why in sorted(report.skipped_targets.items())]
    skips += sorted(
        {f"{r.target}@{r.device}: {r.reason}" for r in report.results if r.status == "SKIP"}
    )
    if skips:
        out += ["", "skipped:"]
        for line in skips[:failures]:
            out += _wrapped(line, "  ")
        if len(skips) > failures:
            out.append(f"  ... and {len(skips) - failures} more (see --json)")
    if report.pairwise:
        worst = max(report.pairwise, key=lambda p: p.worst)
        disagreeing = sum(p.disagreements for p in report.pairwise)
        out += ["", *_wrapped(
            f"pairwise: {len(report.pairwise)} pairs of implementations, {disagreeing} case "
            f"disagreements; worst {worst.worst:.2f} of {PAIRWISE_FACTOR:g}x the tolerance "
            f"({worst.a} vs {worst.b})", "",
        )]
    if report.restarts:
        out += ["", "workers restarted after a signal killed them:"]
        for line in report.restarts:
            out += _wrapped(line, "  ")
    if report.target_seconds:
        times = ", ".join(
            f"{name} {seconds:.0f} s" for name, seconds in report.target_seconds.items()
        )
        out += ["", *_wrapped(f"worker time: {times}", "")]
    passed = sum(r.status == "PASS" for r in report.results)
    skipped = sum(r.status == "SKIP" for r in report.results)
    out += [
        "",
        f"{passed} passed, {len(failed)} failed, {skipped} skipped in {report.seconds:.0f} s"
        f"{_stopped(report)}",
    ]
    return "\n".join(out)


def departures(report: Report) -> dict[str, list[str]]:
    """Per target, where its results depart from its spec, summarized from the failures.

    One line per finding: output dtype promotion, then the worst forward and gradient errors in
    float32 (a departure in the math) and in half precision (in the dtype handling).
    """
    promoted: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    worst: dict[str, dict[tuple[str, str], tuple[float, str]]] = defaultdict(dict)
    errors: dict[str, set[str]] = defaultdict(set)
    for r in report.failed:
        for problem in r.reason.split("; "):
            if " has dtype " in problem:
                quantity, _, rest = problem.partition(" has dtype ")
                got, _, want = rest.partition(", expected ")
                promoted[r.target][f"{quantity} is {got}"].add(want)
            elif problem.startswith(("raised", "worker crashed")):
                errors[r.target].add(problem)
        precision = "half precision" if r.case.dtype != "float32" else "float32"
        for quantity, m in r.measurements.items():
            if m["error"] > m["bound"]["value"]:
                key = (precision, "forward output" if quantity == "y" else quantity)
                unit = "ulp" if m["bound"]["unit"] == "ulp" else "of max|ref|"
                shape = "x".join(str(d) for d in r.case.shape)
                figure = (
                    m["error"],
                    f"{m['error']:.3g} {unit} at {shape} (bound {m['bound']['value']:g})",
                )
                worst[r.target][key] = max(worst[r.target].get(key, figure), figure)
    found: dict[str, list[str]] = {}
    for target in sorted(set(promoted) | set(worst) | set(errors)):
        lines = [
            f"{what} for {', '.join(sorted(inputs))} input (output dtype promotion)"
            for what, inputs in promoted[target].items()
        ]
        for precision in ("float32", "half precision"):
            parts = [
                f"{q} {text}"
                for (p, q), (_, text) in sorted(worst[target].items())
                if p == precision
            ]
            if parts:
                lines.append(f"{precision}: " + ", ".join(parts))
        found[target] = lines + sorted(errors[target])
    return found


def peers_markdown(report: Report, title: str) -> str:
    """The peers table: each built-in layer, the spec it appears to implement, results per dtype
    and where it departs."""
    by_dtype: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in report.results:
        if r.status != "SKIP":
            by_dtype[(r.target, r.case.dtype)][r.status == "FAIL"] += 1
    order = ["float32", "float16", "bfloat16", "float64"]
    dtypes_seen = sorted({d for _, d in by_dtype}, key=order.index)
    notes = departures(report)
    header = [
        "built-in layer",
        "appears to implement",
        *dtypes_seen,
        "identified by probing",
        "departs from it",
    ]
    rows = []
    for target in report.targets:
        spec = target.claims
        claimed = "-" if spec is None else _spec_text(spec)
        if target.name in report.skipped_targets:
            rows.append(
                [
                    target.name,
                    claimed,
                    *("-" for _ in dtypes_seen),
                    "-",
                    f"not run: {report.skipped_targets[target.name]}",
                ]
            )
            continue
        cells = []
        for d in dtypes_seen:
            passed, failed = by_dtype.get((target.name, d), [0, 0])
            cells.append(f"{passed}/{passed + failed}" if passed + failed else "-")
        skipped = sorted(
            {r.reason for r in report.results if r.target == target.name and r.status == "SKIP"}
        )
        identified, differences = _identified(report.identified.get(target.name), target.claims)
        found = differences + notes.get(target.name, []) + [f"not run: {s}" for s in skipped]
        rows.append([target.name, claimed, *cells, identified, "<br>".join(found) or "none found"])
    intro = (
        "Each built-in layer runs as people use it (torch and Hugging Face modules with "
        "parameters in the input dtype, or float32 where the name says `[float32-weight]`, Keras "
        "layers under `mixed_<dtype>` for half inputs, Flax with float32 params) and is checked, "
        "forward and backward, against the NormSpec it appears to implement. Cells: cases passed "
        "/ run. The spec found by `normkit identify` is shown beside it; identify probes the "
        "forward only, so it never sees the `backward` field. Departures name the worst error "
        "and the shape where it occurs: on rows of one element (3x1) the exact gradient is of "
        "the order of eps, which a plain float32 backward loses to cancellation."
    )
    out = [f"# {title}", "", intro, "", _markdown_table(header, rows)]
    return "\n".join(out + _invariance_section(report)) + "\n"


def _identified(found: dict[str, Any] | None, claims: NormSpec | None) -> tuple[str, list[str]]:
    """The identified spec as text, and the fields where it differs from the claimed one."""
    if not found:
        return "-", []
    if "error" in found:
        return "not a norm or DyT", [found["error"]]
    spec = NormSpec.from_dict(found["spec"])
    text = _spec_text(spec)
    unseen = [name for name in found["undetermined"] if name != "backward"]
    if unseen:
        text += f" (undetermined: {', '.join(unseen)})"
    differences = [] if claims is None else identify_differences(
        Identification(spec, tuple(found["undetermined"]), tuple(found.get("notes", ()))),
        claims,
    )
    return text, differences


def _spec_text(spec: object) -> str:
    assert isinstance(spec, NormSpec)
    return f"`{spec!r}`"


def markdown(report: Report, title: str = "normkit conformance") -> str:
    """The report as Markdown: summary, pairwise agreement, failures."""
    header, rows = _summary(report)
    out = [
        f"# {title}",
        "",
        f"normkit {__version__}; {len(report.results)} case runs in {report.seconds:.0f} s"
        f"{_stopped(report)}.",
        "",
        _markdown_table(header, rows),
        "",
        LEGEND,
    ]
    if report.lean:
        out += ["", _lean_line(report)]
    out += _invariance_section(report)
    skips = [f"`{name}`: not run: {why}" for name, why in sorted(report.skipped_targets.items())]
    skips += sorted(
        {f"`{r.target}@{r.device}`: {r.reason}" for r in report.results if r.status == "SKIP"}
    )
    if skips:
        out += ["", "## Skipped", ""] + [f"- {line}" for line in skips]
    fh, fr = _features(report)
    if fr:
        out += [
            "",
            "## Extended fields",
            "",
            "Cases passed / run that exercise each field of the spec off its default "
            "(residual, variance, offset_dtype, output_dtype, backward), DyT and float64 inputs.",
            "",
            _markdown_table(fh, fr),
        ]
    if report.pairwise:
        ph, pr = _pairwise_rows(report)
        out += [
            "",
            "## Pairwise agreement",
            "",
            "Worst difference between two implementations as a fraction of "
            f"{PAIRWISE_FACTOR:g}x the tolerance.",
            "",
            _markdown_table(ph, pr),
        ]
    if report.restarts:
        out += ["", "## Worker restarts", ""] + [f"- {line}" for line in report.restarts]
    if report.failed:
        out += ["", "## Failures", ""] + [
            f"- `{r.target}@{r.device}` {r.case.label}: {r.reason}" for r in report.failed
        ]
    return "\n".join(out) + "\n"


def to_json(report: Report) -> str:
    """Every case with its figures, the skipped targets, devices and pairwise agreement."""
    return json.dumps(
        {
            "normkit": __version__,
            "seconds": report.seconds,
            "interrupted": report.interrupted,
            "tolerances": {
                "forward_rel": tolerances.FORWARD_REL,
                "grad_rel": tolerances.GRAD_REL,
                "forward_ulps": tolerances.FORWARD_ULPS,
                "forward_ulps_before_scale": tolerances.FORWARD_ULPS_BEFORE_SCALE,
                "grad_ulps": tolerances.GRAD_ULPS,
                "ulp_floor": tolerances.ULP_FLOOR,
            },
            "devices": report.devices,
            "target_seconds": report.target_seconds,
            "skipped_targets": report.skipped_targets,
            "lean": report.lean,
            "summary": {
                s: sum(r.status == s for r in report.results) for s in ("PASS", "FAIL", "SKIP")
            },
            "cases": [r.to_dict() for r in report.results],
            "pairwise": [vars(p) for p in report.pairwise],
            "batch_invariance": report.batch_invariance,
            "identified": report.identified,
            "restarts": report.restarts,
        },
        indent=1,
    )
