"""normkit.tf's gated and grouped norms against the reference: every gate position, activation,
grouping, cast order and output dtype, forward and the gradients of x, the gate and the
weights; under jit_compile; the layers' config round trip and the errors."""

import zlib

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import from_spec  # noqa: E402
from tests.helpers import gated  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip("these tests take gradients with TensorFlow", allow_module_level=True)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _check(name, got, want, spec, x_dtype, magnitude=None):
    gated.check(name, tf.cast(got, "float64").numpy(), got.dtype.name, want, spec, x_dtype,
                magnitude)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("output_dtype", ["input", "promote"])
@pytest.mark.parametrize("spec", gated.specs(), ids=gated.spec_id)
def test_layer_matches_the_reference(spec, dtype, output_dtype):
    spec = spec.replace(output_dtype=output_dtype)
    seed = zlib.crc32(f"{gated.spec_id(spec)}-{dtype}-{output_dtype}".encode())
    rng = np.random.default_rng(seed)
    x = (2 * rng.standard_normal((6, 16)) + 0.5).astype(DTYPES[dtype])
    z = (2 * rng.standard_normal((6, 16))).astype(DTYPES[dtype])
    w = (1 + 0.2 * rng.standard_normal(16)).astype(np.float32)
    b = (0.2 * rng.standard_normal(16)).astype(np.float32) if spec.bias else None
    layer = from_spec(spec, dtype=dtype, param_dtype="float32")
    layer.build((6, 16))
    layer.gamma.assign(w)
    if b is not None:
        layer.beta.assign(b)
    xt, zt = (tf.Variable(tf.cast(tf.constant(a.astype(np.float64)), dtype)) for a in (x, z))
    with tf.GradientTape() as tape:
        y = layer(xt, gate=zt) if spec.gate else layer(xt)
        dy = rng.standard_normal(y.shape).astype(DTYPES.get(y.dtype.name, np.float32))
        loss = tf.reduce_sum(tf.cast(y, "float64") * dy.astype(np.float64))
    dx, dz, dw = tape.gradient(loss, [xt, zt, layer.gamma])
    if spec.gate:
        want = reference.gated_normalize(x, z, spec, w, b)
        grads = reference.gated_normalize_vjp(x, z, dy, spec, w, b)
        _check("dgate", dz, grads.dgate, spec, x.dtype)
    else:
        want = reference.normalize(x, spec, w, b)
        grads = reference.normalize_vjp(x, dy, spec, w, b)
    magnitude = reference.scaled_magnitude(x, spec, w, gate=z if spec.gate else None)
    _check("y", y, want, spec, x.dtype, magnitude)
    _check("dx", dx, grads.dx, spec, x.dtype)
    _check("dscale", dw, grads.dscale, spec, x.dtype)


def test_jit_compile_leading_axes_and_config():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 8, 5)).astype(np.float32)
    z = rng.standard_normal((3, 8, 5)).astype(np.float32)
    spec = NormSpec("layer", axis=1, gate="before", gate_activation="sigmoid", group_size=4)
    layer = from_spec(spec)
    jitted = tf.function(lambda x, z: layer(x, gate=z), jit_compile=True)
    tolerances.assert_close(jitted(x, z).numpy(), reference.gated_normalize(x, z, spec))
    again = type(layer).from_config(layer.get_config())
    assert again.spec == spec


def test_gate_missing_or_unexpected_is_refused():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="call it with the gate"):
        from_spec(NormSpec(gate="after"))(x)
    with pytest.raises(ValueError, match="spec has gate=None"):
        from_spec(NormSpec())(x, gate=x)
    with pytest.raises(ValueError, match="the gate has shape"):
        from_spec(NormSpec(gate="after"))(x, gate=np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        from_spec(NormSpec(group_size=3))(x)
    with pytest.raises(ValueError, match="does not compute a residual with group_size"):
        from_spec(NormSpec(group_size=4, residual="rounded"))(x, x)
