"""Reading XLA's HLO text in tests."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import NamedTuple

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = ([a-z0-9]+)\[[^\]]*\](?:\{[^}]*\})? ([\w\-]+)\(([^)]*)\)"
)
#: Operations that move or pick values without computing new ones.
_MOVES = {"parameter", "reshape", "transpose", "broadcast", "bitcast", "slice", "copy",
          "get-tuple-element", "constant", "concatenate", "select", "dynamic-slice", "pad",
          "opt-barrier"}


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


_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "conditional"}
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def _computations(text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name (``ENTRY`` for the entry one)."""
    found: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            name = "ENTRY" if header.group(1) else header.group(2)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            found[name].append(line)
    return found


class _Instruction(NamedTuple):
    name: str
    shape: str
    op: str
    rest: str
    size: int  # the elements of its result's largest array
    operand_sizes: list[int]  # the same of each operand defined before it here (0 otherwise)
    result_sizes: list[int]  # the elements of each array of its result (a tuple's each)


def _instructions(lines: list[str]) -> Iterator[_Instruction]:
    """A computation's instructions, in order, with the sizes of their results and operands."""
    numel: dict[str, int] = {}
    for line in lines:
        match = _LINE.match(line)
        if not match:
            continue
        result, shape, op, rest = match.groups()
        shapes = re.findall(r"\[([\d,]*)\]", shape)
        sizes = [math.prod(int(d) for d in s.split(",") if d) for s in shapes or [""]]
        numel[result] = max(sizes)
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        yield _Instruction(result, shape, op, rest, numel[result],
                           [numel.get(o, 0) for o in operands], sizes)


def _passes_in(
    computations: dict[str, list[str]], name: str, size: int, writes: bool = False
) -> int:
    """Instructions of ``name`` touching an array of at least ``size`` elements (with
    ``writes``: the arrays of that size they write, each of a tuple), conditionals counted by
    their cheapest branch."""
    count = 0
    for instruction in _instructions(computations[name]):
        if instruction.op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", instruction.rest)
            assert branches is not None
            count += min(
                _passes_in(computations, b.strip().lstrip("%"), size, writes)
                for b in branches.group(1).split(",")
            )
        elif instruction.op in _FREE:
            continue
        elif writes:
            count += sum(1 for s in instruction.result_sizes if s >= size)
        elif max([instruction.size, *instruction.operand_sizes]) >= size:
            count += 1
    return count


def passes(hlo: str, size: int) -> int:
    """The passes over arrays of at least ``size`` elements that a compiled program's entry
    computation makes: instructions reading or writing one, a conditional counted by its
    cheapest branch (the common case's, which must not recompute or copy what the branch
    skips)."""
    return _passes_in(_computations(hlo), "ENTRY", size)


def writes(hlo: str, size: int) -> int:
    """The arrays of at least ``size`` elements that a compiled program's entry computation
    writes, a conditional counted by its cheapest branch (as in `passes`)."""
    return _passes_in(_computations(hlo), "ENTRY", size, writes=True)


def float32_copies(hlo: str, size: int) -> list[str]:
    """The entry computation's instructions that write a float32 array of ``size`` elements
    from an operand that size: a conversion of a half input written out, with whatever
    elementwise work it carries (a broadcast of a row or column vector reads no such operand)."""
    return [
        instruction.name
        for instruction in _instructions(_computations(hlo)["ENTRY"])
        if instruction.op not in _FREE and instruction.shape.startswith("f32[")
        and instruction.size == size and size in instruction.operand_sizes
    ]
