"""The reference's gradient where the statistic's squares underflow float64, eps outside the root.

There ``c_i r'(s) = -r^2 c_i / (2 sqrt(s))`` and its factor ``c_i / sqrt(s)`` is scale-free;
where the statistic reads only tiny elements and the row has ordinary ones, the term is huge,
and dropping it (s flushed to 0) leaves ``r d_i`` alone. Checked against the same derivative
taken in 60-digit arithmetic (mpmath), where nothing underflows.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

from normkit import NormSpec, reference


def _exact_dx(x: np.ndarray, dy: np.ndarray, spec: NormSpec, k: int) -> np.ndarray:
    """``d/dx sum(dy * y_hat)`` for one row whose statistic reads its first ``k`` elements,
    eps outside, in 60-digit arithmetic."""
    with mpmath.workdps(60):
        row = [mpmath.mpf(float(v)) for v in x]
        d = [mpmath.mpf(float(v)) for v in dy]
        n = len(row)
        if spec.kind == "layer":
            mean = mpmath.fsum(row) / n
            row = [v - mean for v in row]
        s = mpmath.fsum(v * v for v in row[:k]) / k
        r = 1 / (mpmath.sqrt(s) + spec.eps)
        dot = mpmath.fsum(a * b for a, b in zip(d, row))
        slope = -r * r / (2 * mpmath.sqrt(s))
        dx = [r * d[i] + (2 * row[i] / k * slope * dot if i < k else 0) for i in range(n)]
        if spec.kind == "layer":
            mean_dx = mpmath.fsum(dx) / n
            dx = [v - mean_dx for v in dx]
        return np.array([float(v) for v in dx])


def _row(tiny: float, k: int, n: int = 16) -> np.ndarray:
    x = np.ones(n)
    x[:k] = 0.0
    x[0], x[1] = tiny, -0.5 * tiny
    return x


@pytest.mark.parametrize("tiny", [1e-170, 1e-200, 1e-310])
@pytest.mark.parametrize("masked", [False, True], ids=["partial_rms", "rms with a mask"])
def test_a_statistic_of_tiny_elements_keeps_its_term(tiny: float, masked: bool) -> None:
    n, k = 16, 4
    x, dy = _row(tiny, k, n), np.linspace(-1.0, 2.0, n)
    if masked:
        spec = NormSpec("rms", eps=1e-5, eps_placement="outside")
        dx = reference.normalize_vjp(x[None], dy[None], spec, mask=(np.arange(n) < k)[None]).dx[0]
    else:
        spec = NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside")
        dx = reference.normalize_vjp(x[None], dy[None], spec).dx[0]
    expected = _exact_dx(x, dy, spec, k)
    np.testing.assert_allclose(dx, expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
    assert abs(dx[0]) > 1e3 / spec.eps  # the term is there, and it dominates r d_0


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("tiny", [1e-170, 1e-310])
def test_a_row_of_tiny_elements_has_finite_exact_gradients(kind: str, tiny: float) -> None:
    spec = NormSpec(kind, eps=1e-5, eps_placement="outside")
    x = np.zeros(16)
    x[0], x[1], x[5] = tiny, -0.5 * tiny, 0.25 * tiny
    dy = np.linspace(-1.0, 2.0, 16)
    dx = reference.normalize_vjp(x[None], dy[None], spec).dx[0]
    expected = _exact_dx(x, dy, spec, 16)
    np.testing.assert_allclose(dx, expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
