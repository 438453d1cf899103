"""The support table (`normkit.conformance.support`): its rows come from NormSpec, its cells
agree with what the adapters do, and docs/support.md is the table the code gives today."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from normkit import cli
from normkit.conformance import support, targets
from normkit.spec import ALL_KINDS, EXTENDED_DEFAULTS, NormSpec

DOC = Path(__file__).parents[2] / "docs" / "support.md"


def test_rows_cover_every_kind_and_every_option_of_the_spec():
    names = {o.name for o in support.options(pairs=False)}
    assert {f"kind={k!r}" for k in ALL_KINDS} <= names
    for field in EXTENDED_DEFAULTS:
        assert any(n.startswith(f"{field}=") for n in names), field
    assert "residual='float32_normalized'" in names and "group_size=4" in names
    assert set(support.ARGUMENTS) <= names


def test_every_probed_spec_is_the_option_it_names():
    for option in support.options():
        for part in option.name.split(" + "):
            if part in support.ARGUMENTS:
                assert option.argument == part
                continue
            field, value = part.split("=", 1)
            assert repr(getattr(option.spec, field)) == value, option


def test_columns_are_one_per_seam_and_keras_backend():
    labels = [c.label for c in support.columns()]
    assert labels == ["torch", "tf[tensorflow]", "tf[jax]", "tf[torch]", "jax"]
    hooks = {t.hook for t in targets.TARGETS}
    assert {c.hook for c in support.columns()} == hooks


def test_import_normkit_and_the_support_module_import_no_framework():
    code = (
        "import sys, normkit, normkit.conformance.support\n"
        "loaded = [m for m in ('torch', 'jax', 'tensorflow', 'keras', 'flax') if m in sys.modules]\n"
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_cells_match_the_kernels_refusals():
    """A kernel the table says falls back refuses the spec when named; one it says computes
    the spec accepts it (on meta tensors, which need no compiled kernel)."""
    import torch

    from normkit.conformance import targets_torch
    from normkit.torch.functional import add_norm, normalize

    x = torch.ones(support.PROBE_SHAPE, device="meta")
    checked = 0
    for option in support.options(pairs=False):
        if option.argument is not None:
            continue
        cells = targets_torch.support(option.spec, None)
        assert cells["composite"] == ("yes", ""), option
        for kernel in ("cpu", "triton"):
            if option.spec.residual is not None:
                call = lambda k=kernel, o=option: add_norm(x, x, o.spec, kernel=k)  # noqa: E731
            else:
                gate = x if option.spec.gate is not None else None
                call = lambda k=kernel, o=option, g=gate: normalize(  # noqa: E731
                    x, o.spec, gate=g, kernel=k
                )
            if cells[kernel] == ("fallback", "composite"):
                with pytest.raises(ValueError, match="does not compute"):
                    call()
            elif kernel == "cpu":
                assert cells[kernel] == ("yes", "")
                call()
            checked += 1
    assert checked > 20
    residual = targets_torch.support(NormSpec(residual="rounded"), None)
    assert residual["cpu"] == ("fallback", "composite") and residual["triton"] == ("yes", "")
    assert targets_torch.support(NormSpec(), "mask")["composite"][0] == "no"


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax not installed")
def test_jax_cells_are_its_refusals_and_its_kernels():
    from normkit.conformance import targets_jax

    grouped = targets_jax.support(NormSpec(residual="rounded", group_size=4), None)
    assert grouped["xla"][0] == "no" and "group_size=4" in grouped["xla"][1]
    assert targets_jax.support(NormSpec(), "mask") == {"xla": ("yes", ""), "pallas": ("yes", "")}
    assert targets_jax.support(NormSpec(), "axis_name")["pallas"] == ("fallback", "xla")
    assert targets_jax.support(NormSpec(backward="autograd"), None)["pallas"] == (
        "fallback", "xla"
    )


def _table() -> support.Table:
    cells = {
        "mask": {"torch composite": ("no", "no mask="), "jax xla": ("yes", "")},
        "kind='dyt'": {"torch composite": ("yes", ""), "jax xla": ("fallback", "xla")},
    }
    return support.Table(
        ("mask", "kind='dyt'"), ("torch composite", "jax xla"), cells, {"tf[jax]": "no keras"}
    )


def test_text_and_markdown_show_every_cell_and_reason():
    shown = support.text(_table())
    assert "1:torch composite" in shown and "2:jax xla" in shown
    assert any(line.split()[:3] == ["mask", "-", "+"] for line in shown.splitlines())
    assert any(line.split()[:3] == ["kind='dyt'", "+", "~"] for line in shown.splitlines())
    assert "tf[jax]: not asked (no keras)" in shown
    page = support.markdown(_table())
    assert "| `mask` | no (1) | yes |" in page and "1. no mask=" in page
    assert "| `kind='dyt'` | yes | → xla |" in page


def test_info_support_prints_the_table(capsys, monkeypatch):
    monkeypatch.setattr(support, "table", _table)
    assert cli.main(["info", "--no-devices", "--support"]) == 0
    out = capsys.readouterr().out
    assert "support (docs/support.md):" in out and "1:torch composite" in out
    assert cli.main(["info", "--json", "--no-devices", "--support"]) == 0
    assert '"mask"' in capsys.readouterr().out


def test_info_help_documents_support(capsys):
    with pytest.raises(SystemExit):
        cli.main(["info", "--help"])
    assert "--support" in capsys.readouterr().out


def test_docs_page_is_the_table_the_code_gives():
    """docs/support.md is regenerated by ``python -m normkit.conformance.support --markdown >
    docs/support.md``; it needs every framework of the table installed."""
    found = support.table()
    if found.missing:
        pytest.skip(f"not every backend is installed: {dict(found.missing)}")
    assert DOC.read_text() == support.page(found), (
        "docs/support.md is out of date: python -m normkit.conformance.support --markdown "
        "> docs/support.md"
    )
