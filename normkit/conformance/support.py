"""What each of normkit's implementations computes: every option of `NormSpec` (and the call
arguments only some frameworks take) against the frameworks, their kernels and their other
implementations, asked of the code that decides it.

The rows (`options`) are generated from `NormSpec`'s fields and their allowed values; pairs of
options are kept where an implementation treats the pair worse than either option alone (a
residual with ``group_size`` outside torch). Each backend's seam (`normkit.conformance.targets`'
hook modules) answers for its implementations with a ``support(spec, argument)`` that runs the
adapter's own checks: the kernels' ``unsupported`` predicates, the adapters' refusals traced on
a small input, the kernels' ``supports``. Each seam runs in a worker process of its own
(`normkit.workers`, with the environment of its targets: one per Keras backend), so a missing
framework leaves its columns out and no framework is imported here.

`docs/support.md` is this table (`python -m normkit.conformance.support --markdown`;
tests/conformance/test_support.py fails when it is out of date); ``normkit info`` shows it
compactly.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from normkit import spec as spec_module
from normkit import workers
from normkit.conformance import targets
from normkit.spec import EXTENDED_DEFAULTS, NormSpec

__all__ = [
    "ARGUMENTS", "Cell", "Column", "Option", "Table", "columns", "markdown", "options", "page",
    "table", "text",
]

Verdict = Literal["yes", "fallback", "no"]
Cell = tuple[Verdict, str]
"""A seam's answer for one option and implementation: ``("yes", "")``; ``("fallback", "the
composite path")``: computed by another of the backend's implementations, chosen silently;
``("no", reason)``: refused, with the adapter's own message."""

ARGUMENTS: tuple[str, ...] = ("mask", "axis_name")
"""The call arguments beyond the spec that one framework's API takes (normkit.jax's: a mask
that restricts the statistic, and the mesh axis the normalized axes are sharded over)."""

PROBE_VALUES: dict[str, tuple[object, ...]] = {"group_size": (4,)}
"""The value probed for an option whose values are not a fixed list (``group_size``: groups of
4 of a row of `PROBE_SHAPE`)."""

COMPANIONS: dict[tuple[str, object], dict[str, object]] = {
    ("kind", "partial_rms"): {"p": 0.5},
    ("variance", "fast"): {"kind": "layer"},
    ("offset_dtype", "param"): {"scale_offset": 1.0},
    **{("gate_activation", a): {"gate": "after"} for a in spec_module.GATE_ACTIVATIONS},
}
"""The fields an option needs set to be a valid spec (`NormSpec` names them when they are
missing): partial RMS a fraction, the fast variance LayerNorm, an activation a gate, ...)."""

PROBE_SHAPE = (2, 8)
"""The input every seam probes with: two rows of 8."""


@dataclass(frozen=True)
class Option:
    """One row: ``name`` as shown, the ``spec`` probed, and the call ``argument`` it adds."""

    name: str
    spec: NormSpec
    argument: str | None = None


def _allowed(field: str) -> tuple[object, ...]:
    """The values of a `NormSpec` field other than its default: its Literal's, or
    `PROBE_VALUES`'."""
    if field in PROBE_VALUES:
        return PROBE_VALUES[field]
    hint = typing.get_type_hints(NormSpec, vars(spec_module))[field]
    values = [v for arg in typing.get_args(hint) or (hint,) for v in typing.get_args(arg)]
    if typing.get_origin(hint) is Literal:
        values = list(typing.get_args(hint))
    return tuple(v for v in values if v != EXTENDED_DEFAULTS[field])


def _spec(**fields: object) -> NormSpec | None:
    """The spec of ``fields`` with their companions, or None where no such spec is valid."""
    for name, value in list(fields.items()):
        fields = {**COMPANIONS.get((name, value), {}), **fields}
    try:
        return NormSpec(**fields)  # type: ignore[arg-type]
    except ValueError:
        return None


def _singles() -> list[tuple[str, dict[str, object]]]:
    found: list[tuple[str, dict[str, object]]] = [
        (f"kind={kind!r}", {"kind": kind}) for kind in spec_module.ALL_KINDS
    ]
    for field in EXTENDED_DEFAULTS:
        found += [(f"{field}={value!r}", {field: value}) for value in _allowed(field)]
    return found


def options(pairs: bool = True) -> tuple[Option, ...]:
    """Every row: each kind, each non-default value of each field of
    `normkit.spec.EXTENDED_DEFAULTS`, each of `ARGUMENTS`, then (``pairs``) every valid pair
    of a non-RMS kind or an option with another option (`table` keeps the pairs that tell
    something)."""
    found = []
    singles = _singles()
    for name, fields in singles:
        spec = _spec(**fields)
        if spec is not None:
            found.append(Option(name, spec))
    found += [Option(argument, NormSpec(), argument) for argument in ARGUMENTS]
    if pairs:
        for (a, first), (b, second) in itertools.combinations(singles[1:], 2):
            if set(first) & set(second):
                continue
            spec = _spec(**first, **second)
            if spec is not None:
                found.append(Option(f"{a} + {b}", spec))
        for name, fields in singles[1:]:
            for argument in ARGUMENTS:
                spec = _spec(**fields)
                if spec is not None:
                    found.append(Option(f"{name} + {argument}", spec, argument))
    return tuple(found)


@dataclass(frozen=True)
class Column:
    """A worker's share of the table: a seam (a hook module), the environment it runs in, and
    the label its implementations' columns take (``tf[jax]`` for Keras on JAX)."""

    hook: str
    env: Mapping[str, str]
    label: str
    target: targets.Target


def columns(registry: Sequence[targets.Target] = targets.TARGETS) -> list[Column]:
    """One per distinct hook and environment of the conformance targets (the Keras backends
    each their own), in the registry's order."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], Column] = {}
    for target in registry:
        if target.claims is not None:
            continue
        env = target.environment
        key = (target.hook, tuple(sorted(env.items())))
        if key not in found:
            label = target.name.split("[")[0].split(".")[0]
            if "KERAS_BACKEND" in target.env:
                label = f"{label}[{target.env['KERAS_BACKEND']}]"
            found[key] = Column(target.hook, env, label, target)
    return list(found.values())


@dataclass(frozen=True)
class Table:
    """The cells by option name and column (``"torch composite"``, ``"tf[jax]"``, ...), and
    the columns that could not be asked, with why."""

    options: tuple[str, ...]
    columns: tuple[str, ...]
    cells: Mapping[str, Mapping[str, Cell]]
    missing: Mapping[str, str]


_RANK: dict[str, int] = {"yes": 0, "fallback": 1, "no": 2}


def _telling(option: Option, singles: Mapping[str, Mapping[str, Cell]],
             cells: Mapping[str, Cell]) -> bool:
    """Whether a pair's row says more than its two options' rows: some implementation treats
    the pair worse than the worse of the two."""
    parts = option.name.split(" + ")
    for column, (verdict, _) in cells.items():
        worst = max(_RANK[singles[p][column][0]] if p in singles else 0 for p in parts)
        if _RANK[verdict] > worst:
            return True
    return False


def _ask(column: Column) -> tuple[dict[str, dict[str, list[str]]], str]:
    """The column's seam's answers by implementation, in a worker; or why there are none."""
    reason = column.target.missing()
    if reason is not None:
        return {}, reason
    answered: dict[str, dict[str, list[str]]] = {}

    def on_event(event: dict[str, Any]) -> None:
        answered.update(event["cells"])

    failed = workers.run("normkit.conformance.support", {"hook": column.hook}, column.env,
                         on_event)
    return answered, failed


def table(registry: Sequence[targets.Target] = targets.TARGETS) -> Table:
    """Ask every installed seam, each in its worker (all at once); a seam that is not
    installed or fails is named in ``missing``."""
    rows = options()
    by_column: dict[str, dict[str, Cell]] = {}
    missing: dict[str, str] = {}
    asked = columns(registry)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(asked)) as pool:
        answers = list(pool.map(_ask, asked))
    for column, (answered, failed) in zip(asked, answers, strict=True):
        if failed:
            missing[column.label] = failed
            continue
        for implementation, cells in answered.items():
            name = column.label if implementation == "" else f"{column.label} {implementation}"
            by_column[name] = {option: (typing.cast(Verdict, verdict), detail)
                               for option, (verdict, detail) in cells.items()}
    singles = {o.name for o in rows if " + " not in o.name}
    by_option = {o.name: {c: by_column[c][o.name] for c in by_column} for o in rows}
    kept: list[str] = []
    seen: set[tuple[tuple[str, ...], tuple[Verdict, ...]]] = set()
    for option in rows:
        row = by_option[option.name]
        if option.name not in singles:
            fields = tuple(part.split("=")[0] for part in option.name.split(" + "))
            shown = (fields, tuple(cell[0] for cell in row.values()))
            if shown in seen or not _telling(option, by_option, row):
                continue
            seen.add(shown)
        kept.append(option.name)
    return Table(tuple(kept), tuple(by_column), {o: by_option[o] for o in kept}, missing)


def _serve_one(job: Mapping[str, Any], emit: workers.Emit) -> None:
    """The worker: the hook's ``support`` for every option, as one event."""
    import importlib

    hook = importlib.import_module(job["hook"])
    cells: dict[str, dict[str, Cell]] = {}
    for option in options():
        for implementation, cell in hook.support(option.spec, option.argument).items():
            cells.setdefault(implementation, {})[option.name] = cell
    emit({"cells": cells})


_MARKS = {"yes": "yes", "fallback": "→ {}", "no": "no"}


PAGE_HEAD = """\
# What each implementation computes

<!-- Generated by `python -m normkit.conformance.support --markdown > docs/support.md`
from the code that decides each cell; tests/conformance/test_support.py fails when it is out of
date. Do not edit by hand. -->

Every option of `NormSpec` (each kind, each value of the fields beyond the original spec) and
the call arguments only one framework takes, against normkit's implementations. Each cell is
asked of the adapter's own code (`normkit.conformance.support`): the torch kernels'
`unsupported` predicate, the adapters' refusals on a small input, the Pallas kernels present in
the traced program, the call's signature. `normkit info --support` prints the same table for
the frameworks installed here.

- **yes**: that implementation computes it.
- **→ composite**, **→ xla**: the backend computes it with another of its implementations,
  chosen silently (`kernel="auto"` in normkit.torch: docs/torch.md; `implementation="pallas"`
  in normkit.jax: docs/jax.md). In normkit.torch, naming that kernel (`kernel="cpu"`) is
  then an error; normkit.jax's `implementation="pallas"` takes the XLA program.
- **no (N)**: refused with the error numbered under the table.

Columns: `torch composite`, `torch cpu`, `torch triton` are normkit.torch's `kernel=` choices
(docs/cpu-kernel.md, docs/triton.md), `torch sharded` is
`normkit.torch.distributed.normalize_sharded` (a normalized dim split across ranks:
docs/distributed.md); `tf[...]` is normkit.tf on each Keras backend (docs/tf.md); `jax xla`
and `jax pallas` are normkit.jax's `implementation=` choices (its linen and nnx modules call
the same functions). A pair of options is listed where some implementation treats the pair
worse than either option alone, once per pair of fields whose values it treats alike.

"""


def page(found: Table) -> str:
    """docs/support.md: `PAGE_HEAD`, then `markdown`."""
    return PAGE_HEAD + markdown(found)


def markdown(found: Table) -> str:
    """The table as Markdown, the refusals' reasons numbered under it."""
    reasons: dict[str, int] = {}
    lines = [
        "| option | " + " | ".join(found.columns) + " |",
        "|---|" + "---|" * len(found.columns),
    ]
    for option in found.options:
        shown = []
        for column in found.columns:
            verdict, detail = found.cells[option][column]
            if verdict == "no":
                number = reasons.setdefault(detail, len(reasons) + 1)
                shown.append(f"no ({number})")
            elif verdict == "fallback":
                shown.append(f"→ {detail}")
            else:
                shown.append("yes")
        lines.append(f"| `{option}` | " + " | ".join(shown) + " |")
    lines.append("")
    lines += [f"{number}. {reason}" for reason, number in reasons.items()]
    for label, why in found.missing.items():
        lines.append(f"\nNot asked: {label}: {why}")
    return "\n".join(lines) + "\n"


def text(found: Table) -> str:
    """The table in a terminal: one line per option, a column of one character per
    implementation (``+`` computes it, ``~`` another implementation of the backend does, ``-``
    refused), the columns numbered in a legend above."""
    width = max(len(o) for o in found.options)
    marks = {"yes": "+", "fallback": "~", "no": "-"}
    lines = ["  " + "  ".join(f"{i + 1}:{c}" for i, c in enumerate(found.columns))]
    header = " ".join(f"{i + 1:>2}" for i in range(len(found.columns)))
    lines.append(f"  {'':<{width}} {header}")
    for option in found.options:
        row = " ".join(f"{marks[found.cells[option][c][0]]:>2}" for c in found.columns)
        lines.append(f"  {option:<{width}} {row}")
    lines.append("  + computes it, ~ falls back to another implementation, - refuses it")
    lines += [f"  {label}: not asked ({why})" for label, why in found.missing.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``--markdown``: print docs/support.md; no argument: serve as a worker."""
    parser = argparse.ArgumentParser(prog="python -m normkit.conformance.support")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(page(table()))
    else:
        workers.serve(_serve_one)
    return 0


if __name__ == "__main__":
    sys.exit(main())
