"""Reading XLA's HLO text in tests."""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = ([a-z0-9]+)\[[^\]]*\](?:\{[^}]*\})? ([\w\-]+)\(([^)]*)\)"
)
#: Operations that move or pick values without computing new ones.
_MOVES = {"parameter", "reshape", "transpose", "broadcast", "bitcast", "slice", "copy",
          "get-tuple-element", "constant", "concatenate", "select", "dynamic-slice", "pad"}


def dropped_roundings(hlo: str) -> list[str]:
    """The instructions that cast a half-precision value made by arithmetic or a cast (not one
    cast from a ``reduce-precision`` result) back to a wider float."""
    made: set[str] = set()
    exact: set[str] = set()
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, dtype, op, operands = match.groups()
        names = [o.strip().lstrip("%") for o in operands.split(",")]
        first = names[0]
        if op == "reduce-precision" or (op in _MOVES and exact.intersection(names)):
            exact.add(name)
        if op == "convert" and first in exact:
            exact.add(name)
        elif dtype in ("bf16", "f16") and op not in _MOVES:
            made.add(name)
        elif op in _MOVES and first in made:
            made.add(name)
        if op == "convert" and dtype in ("f32", "f64") and first in made:
            found.append(line.strip())
    return found
