"""The row math normkit.tf's programs share (`normkit.tf._rows`), in float64 against the
reference: ``r(s)`` and the closed-form backward, each written once in normkit.tf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="these tests run Keras, which is not installed")
from keras import ops  # noqa: E402

from normkit import NormSpec, reference  # noqa: E402
from normkit.tf._rows import Rows, r_of  # noqa: E402

SPECS = [
    NormSpec("rms", eps=1e-6),
    NormSpec("rms", eps=1e-2, eps_placement="outside"),
    NormSpec("partial_rms", p=0.25, eps=1e-6),
    NormSpec("partial_rms", p=0.5, eps=1e-2, eps_placement="outside"),
    NormSpec("layer", eps=1e-3),
    NormSpec("layer", eps=1e-1, eps_placement="outside"),
]
N = 12


def _numpy(u: object) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(u))


def _rows_of(spec: NormSpec) -> tuple[Rows, int]:
    k = spec.stat_size(N)
    head = None if k == N else (np.arange(N) < k).reshape(1, N)
    return Rows(spec, (1,), [1, N], N, k, head, "float64"), k


def _row_terms(spec: NormSpec, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, object, object]:
    """``(c, s, r, ratio)`` of the rows of ``x``, ``r`` and ``ratio`` from `r_of`."""
    k = spec.stat_size(N)
    c = x - x.mean(axis=1, keepdims=True) if spec.kind == "layer" else x
    s = np.mean(c[:, :k] ** 2, axis=1, keepdims=True)
    outside = spec.eps_placement == "outside"
    r = r_of(ops.convert_to_tensor(s, "float64"), spec.eps, outside)
    ratio = ops.convert_to_tensor(1 + spec.eps / np.sqrt(s), "float64") if outside else None
    return c, s, r, ratio


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.eps_placement}")
def test_r_gives_the_references_y(spec: NormSpec) -> None:
    x = np.random.default_rng(0).standard_normal((5, N)) * 3
    c, _, r, _ = _row_terms(spec, x)
    np.testing.assert_allclose(_numpy(c * r), reference.normalize(x, spec), rtol=1e-13, atol=0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.eps_placement}")
def test_closed_form_backward_gives_the_references_dx(spec: NormSpec) -> None:
    rng = np.random.default_rng(1)
    x, dy, w = rng.standard_normal((5, N)) * 3, rng.standard_normal((5, N)), rng.random(N) + 0.5
    rows, _ = _rows_of(spec)
    c, _, r, ratio = _row_terms(spec, x)
    y_hat = c * r
    d = ops.convert_to_tensor(dy * w, "float64")
    d_mean = ops.mean(d, axis=1, keepdims=True) if spec.kind == "layer" else None
    dx = rows.input_grad(d, y_hat, r, rows.statistic_share(d, y_hat, ratio), d_mean)
    expected = reference.normalize_vjp(x, dy, spec, scale=w)
    scale = float(np.abs(expected.dx).max())
    np.testing.assert_allclose(_numpy(dx), expected.dx, rtol=0, atol=1e-13 * scale)


def test_r_and_the_backward_are_written_once() -> None:
    """``r(s)``'s formulas stand in `normkit.tf._rows` alone; the programs call it."""
    folder = Path(__import__("normkit.tf").tf.__file__).parent
    sources = {path.name: path.read_text() for path in folder.glob("*.py")}
    assert [name for name, text in sources.items() if "ops.rsqrt(" in text] == ["_rows.py"]
    assert [name for name, text in sources.items() if "def input_grad" in text] == ["_rows.py"]
