"""LayerNorm's variance="fast": E[x^2] - E[x]^2 with the float32 roundings of the spec."""

import math

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference

FAST = NormSpec("layer", variance="fast", eps=1e-6)


def fast_by_hand(row, eps, compute=np.float32):
    """Each step in numpy scalars of the compute dtype, the means from math.fsum."""
    n = len(row)
    m1 = compute(math.fsum(row) / n)
    m2 = compute(math.fsum(float(compute(v * v)) for v in row) / n)
    var = max(compute(0.0), compute(float(m2) - float(compute(float(m1) * float(m1)))))
    r = 1 / math.sqrt(float(var) + eps)
    return [(v - float(m1)) * r for v in row]


def test_hand_case_where_the_variance_cancels_to_zero():
    # Row (1e4, 1e4 + 1): mean 10000.5 (exact in float32), exact variance 0.25. In float32,
    # mean(x^2) = 100010000.5 and mean^2 = 100010000.25 both round to 100010000 (float32's
    # spacing there is 8), so the variance is 0 and y_hat = (x - mean) / sqrt(eps) = -+500.
    x = np.array([[1e4, 1e4 + 1]], dtype=np.float32)
    y = reference.normalize(x, FAST.replace(bias=False))
    np.testing.assert_allclose(
        y, [[-0.5 / math.sqrt(1e-6), 0.5 / math.sqrt(1e-6)]], rtol=1e-7
    )
    two_pass = reference.normalize(x, NormSpec("layer", eps=1e-6, bias=False))
    np.testing.assert_allclose(two_pass, [[-1.0, 1.0]], rtol=1e-5)


def test_float64_inputs_compute_in_float64():
    x = np.array([[1e4, 1e4 + 1]])
    np.testing.assert_allclose(reference.normalize(x, FAST), [[-1.0, 1.0]], rtol=1e-5)


def test_negative_difference_is_clamped_to_zero():
    # Here float32's mean(x^2) - mean^2 is -0.0625 (found by search, checked by hand below):
    # the spec clamps it to 0, so y_hat = (x - mean) / sqrt(eps).
    row = [1000 + 2.0**-13, 1000 + 2.0**-14, 1000 + 2.0**-13]
    m1 = np.float32(math.fsum(row) / 3)
    m2 = np.float32(math.fsum(float(np.float32(v * v)) for v in row) / 3)
    assert float(m2) - float(np.float32(float(m1) ** 2)) == -0.0625
    y = reference.normalize(np.array([row], dtype=np.float32), FAST.replace(bias=False))
    want = [(v - float(m1)) / math.sqrt(1e-6) for v in row]
    np.testing.assert_allclose(y[0], want, rtol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, dtypes.bfloat16])
@pytest.mark.parametrize("mean", [0.0, 30.0, 3000.0])
def test_matches_independent_float32_formula(dtype, mean):
    rng = np.random.default_rng(int(mean))
    x = (rng.normal(size=(6, 24)) + mean).astype(dtype)
    spec = FAST.replace(bias=False, scale=False)
    got = reference.normalize(x.astype(np.float32), spec).astype(np.float64)
    want = np.array(
        [
            fast_by_hand([float(v) for v in row], spec.eps)
            for row in x.astype(np.float64)
        ]
    )
    np.testing.assert_allclose(
        got, dtypes.round_to(want, np.float32).astype(np.float64), rtol=0, atol=0
    )
    half_out = reference.normalize(x, spec)
    assert half_out.dtype == x.dtype
    np.testing.assert_array_equal(half_out, dtypes.round_to(want, x.dtype))


def test_fast_differs_from_two_pass_only_on_rows_with_a_large_mean():
    rng = np.random.default_rng(4)
    spec = FAST.replace(bias=False, scale=False)
    centred = rng.normal(size=(8, 64)).astype(np.float32)
    np.testing.assert_allclose(
        reference.normalize(centred, spec),
        reference.normalize(centred, spec.replace(variance="two_pass")),
        rtol=0,
        atol=1e-6,
    )
    shifted = centred + np.float32(3000.0)
    gap = np.abs(
        reference.normalize(shifted, spec).astype(np.float64)
        - reference.normalize(shifted, spec.replace(variance="two_pass"))
    )
    assert gap.max() > 1e-3


def test_gradient_is_that_of_the_exact_function_two_pass():
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(3, 7)) + 100).astype(np.float32)
    dy = rng.normal(size=(3, 7))
    w, b = rng.normal(size=7), rng.normal(size=7)
    fast = reference.normalize_vjp(x, dy, FAST, w, b)
    exact = reference.normalize_vjp(x, dy, FAST.replace(variance="two_pass"), w, b)
    for got, want in zip(fast, exact):
        np.testing.assert_array_equal(got, want)
