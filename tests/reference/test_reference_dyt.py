"""kind="dyt": y = (scale_offset + w) * tanh(alpha * x) + b, forward and VJP (alpha included)."""

import math

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference


def dyt_by_hand(x, alpha, scale, bias, offset=0.0):
    out = np.empty(x.shape)
    for index in np.ndindex(x.shape):
        j = index[-1]
        g = offset + (1.0 if scale is None else float(scale[j]))
        b = 0.0 if bias is None else float(bias[j])
        out[index] = g * math.tanh(alpha * float(x[index])) + b
    return out


@pytest.mark.parametrize("alpha", [None, 0.5, np.array([1.7]), np.array(-0.3)])
def test_forward_matches_math_tanh(alpha):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5)) * 3
    w, b = rng.normal(size=5), rng.normal(size=5)
    spec = NormSpec("dyt", alpha_init=0.8)
    value = 0.8 if alpha is None else float(np.asarray(alpha).reshape(()))
    got = reference.normalize(x, spec, w, b, alpha)
    np.testing.assert_allclose(got, dyt_by_hand(x, value, w, b), rtol=1e-14, atol=1e-15)


def test_initial_parameters_and_offset():
    x = np.array([[0.5, -2.0, 4.0]])
    np.testing.assert_allclose(
        reference.normalize(x, NormSpec("dyt")),
        dyt_by_hand(x, 0.5, None, None),
        rtol=1e-15,
    )
    spec = NormSpec("dyt", scale_offset=1.0, alpha_init=1.0)
    w = np.array([0.0, 0.5, -1.0])
    np.testing.assert_allclose(
        reference.normalize(x, spec, w),
        dyt_by_hand(x, 1.0, w, None, offset=1.0),
        rtol=1e-15,
    )


def test_axis_selects_the_parameter_shape():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 4))
    spec = NormSpec("dyt", axis=1, bias=False)
    w = rng.normal(size=3)
    want = np.tanh(0.5 * x) * w[None, :, None]
    np.testing.assert_allclose(reference.normalize(x, spec, w), want, rtol=1e-15)


@pytest.mark.parametrize("dtype, bits", [(dtypes.bfloat16, 8), (np.float16, 11)])
def test_half_inputs_tanh_in_float32_and_the_cast_points(dtype, bits):
    def rounded(v):
        _, e = math.frexp(v)
        return 0.0 if v == 0 else math.ldexp(round(math.ldexp(v, bits - e)), e - bits)

    x = np.array([[0.3, -1.1, 2.5, 0.01]], dtype=dtype)
    w = np.array([1.5, 0.7, -2.0, 3.0], dtype=dtype)
    xs = x.astype(np.float64)[0]
    after = reference.normalize(x, NormSpec("dyt", bias=False), w)
    before = reference.normalize(x, NormSpec("dyt", bias=False, cast="before_scale"), w)
    assert after.dtype == before.dtype == dtype
    want_after = [
        rounded(math.tanh(0.5 * v) * float(g)) for v, g in zip(xs, w.astype(np.float64))
    ]
    want_before = [
        rounded(rounded(math.tanh(0.5 * v)) * float(g))
        for v, g in zip(xs, w.astype(np.float64))
    ]
    assert after.astype(np.float64)[0].tolist() == want_after
    assert before.astype(np.float64)[0].tolist() == want_before


def numerical(f, array, step=1e-6):
    out = np.zeros_like(array, dtype=np.float64)
    for i in np.ndindex(array.shape):
        plus, minus = array.astype(np.float64), array.astype(np.float64)
        plus[i] += step
        minus[i] -= step
        out[i] = (f(plus) - f(minus)) / (2 * step)
    return out


@pytest.mark.parametrize("alpha_shape", [(), (1,)])
def test_vjp_matches_central_differences_alpha_included(alpha_shape):
    rng = np.random.default_rng(2)
    x, dy = rng.normal(size=(3, 4)) * 2, rng.normal(size=(3, 4))
    w, b = rng.normal(size=4), rng.normal(size=4)
    alpha = np.full(alpha_shape, 0.7)
    spec = NormSpec("dyt", scale_offset=0.5)
    grads = reference.normalize_vjp(x, dy, spec, w, b, alpha)
    assert isinstance(grads, reference.DytGrads) and len(grads) == 4

    def loss(x_=x, w_=w, b_=b, a_=alpha):
        return float(np.sum(dy * reference.normalize(x_, spec, w_, b_, a_)))

    np.testing.assert_allclose(
        grads.dx, numerical(lambda v: loss(x_=v), x), rtol=1e-6, atol=1e-8
    )
    np.testing.assert_allclose(
        grads.dscale, numerical(lambda v: loss(w_=v), w), rtol=1e-6, atol=1e-8
    )
    np.testing.assert_allclose(
        grads.dbias, numerical(lambda v: loss(b_=v), b), rtol=1e-6, atol=1e-8
    )
    assert grads.dalpha.shape == alpha_shape
    np.testing.assert_allclose(
        grads.dalpha, numerical(lambda v: loss(a_=v), alpha), rtol=1e-6
    )


def test_norm_kinds_keep_their_three_gradients():
    x = np.ones((2, 4))
    grads = reference.normalize_vjp(x, x, NormSpec("layer"))
    assert isinstance(grads, reference.NormGrads) and len(grads) == 3
    dx, dscale, dbias = grads
    assert dx.shape == x.shape and dscale is not None and dbias is not None


def test_errors_name_the_problem():
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match="alpha was given but the spec has kind='rms'"):
        reference.normalize(x, NormSpec(), None, None, 0.5)
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected a scalar"):
        reference.normalize(x, NormSpec("dyt"), None, None, np.ones(2))
    with pytest.raises(TypeError, match="alpha has dtype int64"):
        reference.normalize(x, NormSpec("dyt"), None, None, np.array(1))


def _sech_squared(u: float) -> float:
    """sech(u)^2 to 50 digits (mpmath), independent of normkit's form."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        return float(mpmath.sech(mpmath.mpf(u)) ** 2)


U = [0.0, 1e-8, 0.3, 2.0, 9.0, 15.0, 18.0, 20.0, 37.5, 100.0, 250.0, 350.0]


@pytest.mark.parametrize("alpha", [0.5, 1.0, -2.0])
def test_the_slope_is_sech_squared_to_a_few_ulps_however_large_alpha_x(alpha):
    """``1 - tanh(u)^2`` lost the answer for large |u| = |alpha x|: relative error 1.7e-4 at
    u = 15, 4 % at 18, and 0 at u = 20 (where sech(u)^2 is 8.5e-18); the gradients now read
    sech(u)^2 from e^-2|u| (``normkit._dyt``), within a few ulps up to u = 350 (1e-304)."""
    u = np.array(U) * np.sign(alpha)
    x = np.concatenate([u, -u]).reshape(2, -1) / alpha
    dy = np.ones_like(x)
    grads = reference.normalize_vjp(x, dy, NormSpec("dyt", bias=False), alpha=np.array(alpha))
    want = np.array([[alpha * _sech_squared(v * alpha) for v in row] for row in x])
    np.testing.assert_allclose(grads.dx, want, rtol=8 * np.finfo(np.float64).eps, atol=0)
    dalpha = sum(v * _sech_squared(v * alpha) for v in x.ravel())
    assert grads.dalpha == pytest.approx(dalpha, rel=1e-14)
