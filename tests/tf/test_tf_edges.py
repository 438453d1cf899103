"""normkit.tf (Keras, TensorFlow backend) at the edges: overflowing statistics, NaN under eps
outside, the partial statistic's mask, k = 1, degenerate rows' second derivatives, eps range."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from normkit import NormSpec, reference, tolerances
from normkit.conformance.targets_keras import evaluate
from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm, from_spec

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)
KINDS = [
    pytest.param({"kind": "rms"}, id="rms"),
    pytest.param({"kind": "partial_rms", "p": 0.5}, id="partial"),
    pytest.param({"kind": "layer"}, id="layer"),
]
PLACEMENTS = ["inside", "outside"]
SCALES = np.array([1.0, 1e20, 3e38, 1e15, 1e-30, 1.0])


def check(spec: NormSpec, x: np.ndarray, dy: np.ndarray, what: str, jit: bool = True) -> None:
    y, dx, _, _ = evaluate(spec, x, dy, jit=jit)
    tolerances.assert_close(y, reference.normalize(x, spec), what=f"{what} y")
    expected = reference.normalize_vjp(x, dy, spec)[0]
    tolerances.assert_close(dx, expected, quantity="grad", what=f"{what} dx")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_far_from_unit_scale(kind: dict, placement: str, jit: bool) -> None:
    """Rows whose x**2 overflows float32 (or whose r**3 would) are rescaled: reference answers,
    forward and gradient (dy scaled so that the gradients are normal numbers), and ordinary rows
    in the batch are unaffected."""
    rng = np.random.default_rng(0)
    spec = NormSpec(**kind, eps_placement=placement)
    x = rng.standard_normal((len(SCALES), 16)) * SCALES[:, None]
    x[2] = np.sign(x[2]) * 3e38
    dy = rng.standard_normal(x.shape) * np.minimum(SCALES, 1e30)[:, None]
    check(spec, x.astype(np.float32), dy.astype(np.float32), f"{spec}", jit)


def test_smallest_eps_on_zero_and_tiny_rows() -> None:
    """eps = 2**-126: r = 2**63 on a zero row, whose r**3 autodiff would overflow."""
    for placement in PLACEMENTS:
        spec = NormSpec(eps=2.0**-126, eps_placement=placement)
        x = np.zeros((3, 6), np.float32)
        x[1], x[2] = 1e-30, np.linspace(-1, 1, 6)
        check(spec, x, np.ones_like(x), f"smallest eps {placement}")


@pytest.mark.parametrize("kind", KINDS)
def test_nan_under_eps_outside_gives_a_nan_row(kind: dict) -> None:
    """A NaN statistic is not mistaken for zero: the row is NaN, forward and dx."""
    spec = NormSpec(**kind, eps_placement="outside", eps=1e-6)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    x[1, 0] = np.nan
    y, dx, _, _ = evaluate(spec, x, np.ones_like(x))
    assert np.isnan(y[1]).all() and np.isnan(dx[1]).all()
    assert np.isfinite(y[[0, 2]]).all() and np.isfinite(dx[[0, 2]]).all()
    tolerances.assert_close(y, reference.normalize(x, spec), what="NaN row")


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e20])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_partial_statistic_ignores_what_follows_the_first_k(value: float, placement: str) -> None:
    spec = NormSpec("partial_rms", p=0.25, eps_placement=placement)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    x[:, 9] = value
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, dx, _, _ = evaluate(spec, x, dy)
    tolerances.assert_close(y, reference.normalize(x, spec), what=f"{value} after k")
    assert np.isfinite(np.delete(y, 9, axis=1)).all()
    if np.isfinite(value):
        tolerances.assert_close(
            dx, reference.normalize_vjp(x, dy, spec)[0], quantity="grad", what="dx"
        )


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_large_mean_layer_norm_float32(placement: str) -> None:
    rng = np.random.default_rng(3)
    spec = NormSpec("layer", eps_placement=placement)
    x = (rng.standard_normal((4, 256)) + 1e6).astype(np.float32)
    check(spec, x, rng.standard_normal(x.shape).astype(np.float32), "mean 1e6")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("n", [1, 8])
def test_partial_rms_with_one_statistic_element(placement: str, n: int) -> None:
    """k = 1: element 0's gradient in closed form (dy zero elsewhere: nothing hides an error)."""
    spec = NormSpec("partial_rms", p=1 / 16, eps_placement=placement)
    x = np.linspace(0.5, 3.0, 3 * n).reshape(3, n).astype(np.float32)
    dy = np.zeros_like(x)
    dy[:, 0] = 1.0
    check(spec, x, dy, f"k = 1, n = {n}")


def _second_derivative(spec: NormSpec, x: np.ndarray, dy: np.ndarray, v: np.ndarray) -> np.ndarray:
    """d/dt of <dy, d normalize / dx (x + t v)> at t = 0, by nested tapes (float64 policy)."""
    layer = from_spec(spec, dtype="float64")
    xt = tf.constant(x)
    with tf.GradientTape() as outer:
        outer.watch(xt)
        with tf.GradientTape() as inner:
            inner.watch(xt)
            y = layer(xt)
        dx = inner.gradient(y, xt, output_gradients=tf.constant(dy))
    return outer.gradient(dx, xt, output_gradients=tf.constant(v)).numpy()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "spec, n",
    [(NormSpec("rms"), 1), (NormSpec("layer"), 2), (NormSpec("partial_rms", p=0.1), 6)],
    ids=["rms-n1", "layer-n2", "partial-k1"],
)
def test_degenerate_rows_have_exact_second_derivatives(
    spec: NormSpec, n: int, placement: str
) -> None:
    """Against central differences of the reference gradient (float64, error ~h**2)."""
    spec = spec.replace(eps_placement=placement, eps=1e-2)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, n))
    dy, v = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    h = 1e-5
    plus = reference.normalize_vjp(x + h * v, dy, spec)[0]
    minus = reference.normalize_vjp(x - h * v, dy, spec)[0]
    expected = (plus - minus) / (2 * h)
    actual = _second_derivative(spec, x, dy, v)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize(
    "layer, dtype",
    [(lambda: RMSNorm(epsilon=1e-46), "float32"), (lambda: LayerNorm(epsilon=1e-39), "float32"),
     (lambda: PartialRMSNorm(0.5, epsilon=1e-320, dtype="float64"), "float64")],
    ids=["1e-46", "1e-39", "1e-320"],
)
def test_eps_out_of_range_for_the_dtype_is_refused(layer, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"out of range for a {dtype} input"):
        layer()(np.zeros((2, 4), dtype))
    with pytest.raises(ValueError, match=f"out of range for a {dtype} input"):
        layer()(keras.Input((4,), dtype=dtype))


def test_tiny_statistic_under_eps_outside_keeps_its_gradient_term() -> None:
    """The issue's row: the statistic reads [1e-12, 0, 0, 0]; x_0 r'(s) sum(dy x) =
    -6 r**2 = -6e10 does not shrink with x_0, also where x_0**2 underflows float32 (1e-25)."""
    spec = NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside")
    for value in (1e-12, 1e-25):
        x = np.array([[value, 0, 0, 0] + [1] * 12], np.float32)
        expected = reference.normalize_vjp(x, np.ones_like(x), spec)[0]
        assert expected[0, 0] < -5.9e10
        for jit in (False, True):
            check(spec, x, np.ones_like(x), f"x0 = {value}, jit={jit}", jit)


def _underflowing_rows(tiny: list[float]) -> np.ndarray:
    """Rows tiny in their first half only (where partial RMS's statistic reads; the ordinary
    second half makes r'(s) x_i sum(dy x) large), rows tiny throughout, a zero row and an
    ordinary one."""
    head = np.array(tiny * 2 + [0.0, 1.0])[:, None]
    tail = np.array([1.0] * len(tiny) + tiny + [0.0, 1.0])[:, None]
    x = np.random.default_rng(7).standard_normal((len(head), 16))
    return x * np.concatenate([np.repeat(head, 8, axis=1), np.repeat(tail, 8, axis=1)], axis=1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_whose_squares_underflow_under_eps_outside(kind: dict, jit: bool) -> None:
    """Float32 rows of normal numbers whose squares underflow (or lose digits as subnormals)
    are taken in units of their largest magnitude: forward and dx as the reference's."""
    spec = NormSpec(**kind, eps=1e-5, eps_placement="outside")
    x = _underflowing_rows([1e-12, 1e-20, 1e-25, 1e-30]).astype(np.float32)
    dy = np.random.default_rng(8).standard_normal(x.shape).astype(np.float32)
    check(spec, x, dy, f"{spec}", jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", KINDS)
def test_float64_rows_whose_squares_underflow_under_eps_outside(kind: dict, jit: bool) -> None:
    """The same in float64, where the reference's own float64 squares underflow too: it is
    evaluated on the rows scaled by 2**266 (with eps), as y(x; eps) = y(t x; t eps) and
    dx(x; eps) = t dx(t x; t eps)."""
    spec = NormSpec(**kind, eps=1e-5, eps_placement="outside")
    t = 2.0**266
    x = _underflowing_rows([1e-160, 1e-170, 1e-200, 1e-230])
    dy = np.random.default_rng(8).standard_normal(x.shape)
    y, dx, _, _ = evaluate(spec, x, dy, jit=jit)
    scaled = spec.replace(eps=spec.eps * t)
    tolerances.assert_close(y, reference.normalize(x * t, scaled), what="y")
    expected = t * reference.normalize_vjp(x * t, dy, scaled)[0]
    tolerances.assert_close(dx, expected, quantity="grad", what="dx")
