"""docs/jax.md's table of the modules' arguments holds their defaults: each row of a spec field
names the default the linen and NNX modules built with no arguments have, and the `NormSpec`
default (`normalize`'s and the functions') where that differs (issue 51: the table gave
``output_dtype`` "input" and ``variance`` "two_pass", the modules' are "promote" and "fast")."""

from __future__ import annotations

from pathlib import Path

import pytest
from flax import nnx

import normkit.jax as nkjax
from normkit import NormSpec
from normkit.jax import nnx as nk_nnx

DOC = Path(__file__).resolve().parents[2] / "docs" / "jax.md"
# The table's first cell for each spec field, and the kinds whose modules have it.
ROWS = {
    "`epsilon` (`eps` in the functions)": ("eps", ("rms", "layer", "partial_rms")),
    "`eps_placement`": ("eps_placement", ("rms", "layer", "partial_rms")),
    "`use_scale`": ("scale", ("rms", "layer", "partial_rms", "dyt")),
    "`scale_offset`": ("scale_offset", ("rms", "layer", "partial_rms", "dyt")),
    "`use_bias`": ("bias", ("rms", "layer", "partial_rms")),
    "`cast`": ("cast", ("rms", "layer", "partial_rms", "dyt")),
    "`variance` (LayerNorm)": ("variance", ("layer",)),
    "`residual`": ("residual", ("rms", "layer", "partial_rms", "dyt")),
    "`offset_dtype`": ("offset_dtype", ("rms", "layer", "partial_rms", "dyt")),
    "`output_dtype`": ("output_dtype", ("rms", "layer", "partial_rms", "dyt")),
    "`backward`": ("backward", ("rms", "layer", "partial_rms", "dyt")),
    "`alpha_init` (DyT)": ("alpha_init", ("dyt",)),
}
CLASSES = {"rms": "RMSNorm", "layer": "LayerNorm", "partial_rms": "PartialRMSNorm", "dyt": "DyT"}


def _table() -> dict[str, str]:
    """The argument table's default column by its first cell."""
    text = DOC.read_text()
    start = text.index("| argument | meaning | default |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[-1]
    return rows


def _defaults(kind: str) -> list[NormSpec]:
    """The specs of the linen and the NNX module of ``kind`` built with no arguments."""
    extra = {"p": 0.5} if kind == "partial_rms" else {}
    linen = getattr(nkjax, CLASSES[kind])(**extra).spec
    nnx_module = getattr(nk_nnx, CLASSES[kind])(8, **extra, rngs=nnx.Rngs(0)).spec
    return [linen, nnx_module]


def _written(value: object) -> list[str]:
    """The ways the docs write ``value``."""
    if isinstance(value, str):
        return [f'`"{value}"`']
    if isinstance(value, float):
        return [f"`{value}`", f"`{value:g}`", f"`{value:.0e}`".replace("e-0", "e-")]
    return [f"`{value}`", str(value)]


@pytest.mark.parametrize("row", list(ROWS))
def test_the_argument_table_gives_the_modules_defaults(row):
    table = _table()
    assert row in table, f"docs/jax.md's argument table has no row {row}"
    cell = table[row]
    field, kinds = ROWS[row]
    for kind in kinds:
        for spec in _defaults(kind):
            value = getattr(spec, field)
            assert any(w in cell for w in _written(value)), (row, kind, value, cell)
            plain = getattr(NormSpec(kind, p=0.5 if kind == "partial_rms" else None), field)
            if plain != value:
                assert "`NormSpec`" in cell and any(w in cell for w in _written(plain)), (
                    row, kind, plain, cell
                )


def test_the_table_says_rngs_draws_a_key_per_parameter():
    """nnx's modules draw one ``rngs.params()`` key per parameter whenever ``rngs`` is given
    (the table called it unused)."""
    cell = [line for line in DOC.read_text().splitlines() if line.startswith("| `rngs` (nnx)")]
    assert len(cell) == 1 and "unused" not in cell[0] and "rngs.params()" in cell[0]
    rngs = nnx.Rngs(0)
    nk_nnx.RMSNorm(8, use_bias=True, rngs=rngs)
    assert int(rngs.params.count[...]) == 2
