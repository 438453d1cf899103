"""Where an identified spec departs from a claimed one: the fields identify determined that
differ, each with the finding behind it."""

from __future__ import annotations

from collections.abc import Iterable

from normkit.identify.forward import Identification
from normkit.spec import NormSpec

__all__ = ["EPS_AGREEMENT", "differences"]

EPS_AGREEMENT = 0.1
"""identify measures eps to within a few percent: a relative difference up to this is none."""

# How identify's finding on a field begins (a note, or a clause of one between "; ").
_NOTED = {"eps": "eps ", "eps_placement": "eps ", "variance": "variance", "kind": "kind ",
          "p": "partial statistic", "alpha_init": "kind dyt", "gate": "gate:",
          "gate_activation": "gate:", "group_size": "groups:", "cast": "cast ",
          "offset_dtype": "offset_dtype ", "output_dtype": "output dtype", "scale": "scale",
          "scale_offset": "scale:", "bias": "bias:"}


def differences(
    found: Identification, claimed: NormSpec, ignore: Iterable[str] = ()
) -> list[str]:
    """One line per field of ``claimed`` that ``found`` determined otherwise (fields in
    ``found.undetermined`` or ``ignore`` left out; eps within `EPS_AGREEMENT`), e.g.
    ``eps_placement='outside', not 'inside' (identify: eps 1e-06 (outside the sqrt))``."""
    skipped = set(found.undetermined) | set(ignore)
    lines = []
    mine, theirs = found.spec.to_dict(), claimed.to_dict()
    for name, value in mine.items():
        wanted = theirs[name]
        if name in skipped or value == wanted:
            continue
        if (
            name == "eps" and isinstance(value, float) and isinstance(wanted, float)
            and abs(value - wanted) <= EPS_AGREEMENT * wanted
        ):
            continue
        line = f"{name}={value!r}, not {wanted!r}"
        note = _note(found, name)
        lines.append(f"{line} (identify: {note})" if note else line)
    return lines


def _note(found: Identification, name: str) -> str:
    """The first clause of identify's finding on ``name`` (up to its figures), or ""."""
    start = _NOTED.get(name)
    if start is None:
        return ""
    for note in found.notes:
        for clause in note.split("; "):
            clause = clause.split(" input: ")[-1]  # "bfloat16 input: output dtype ..."
            if clause.startswith(start):
                return clause.split(" from ")[0]
    return ""
