"""normkit.tf's own at the edges: exact second derivatives on degenerate rows (nested
GradientTapes), the eps its layers refuse for a dtype, and RMSNorm's row whose gradient in
Keras' order overflows (under jit too, beside rows that keep Keras' gradient bit for bit).

The values at the edges (overflowing statistics, NaN under eps outside, the partial statistic's
mask, k = 1, underflowing squares in float32 and float64, the smallest eps) are cases of
tests/conformance/test_every_target.py, on every target."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm, from_spec  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)
PLACEMENTS = ["inside", "outside"]


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


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rms_norm_row_whose_keras_gradient_overflows_gets_the_reference_dx(jit: bool) -> None:
    """|x| 1e9 with |dy| 1e29: autodiff's sum(dy w x) overflows float32 on that row, which
    gets the reference's dx (finite, ~1e20); the other rows keep the gradient of Keras' own
    layer bit for bit (eager: XLA fuses Keras' program otherwise)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 16)) * np.array([[1e9], [1.0], [3.0]])).astype(np.float32)
    dy = (rng.standard_normal(x.shape) * np.array([[1e29], [1.0], [1.0]])).astype(np.float32)
    w = np.linspace(0.5, 1.5, 16, dtype=np.float32)

    def dx_of(layer: keras.layers.Layer) -> np.ndarray:
        layer.build(x.shape)
        layer.set_weights([w])

        def run(x: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
            return tape.gradient(y, x, output_gradients=tf.constant(dy))

        return (tf.function(run, jit_compile=True) if jit else run)(tf.constant(x)).numpy()

    dx = dx_of(RMSNorm())
    expected = reference.normalize_vjp(x, dy, NormSpec(), w).dx
    tolerances.assert_close(dx[0], expected[0], np.float32, "grad", what="dx of the 1e29 row")
    if not jit:
        np.testing.assert_array_equal(dx[1:], dx_of(keras.layers.RMSNormalization())[1:])
