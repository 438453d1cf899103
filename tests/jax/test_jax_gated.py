"""normkit.jax's gated and grouped norms against the reference: every gate position,
activation, grouping, cast order and output dtype, forward and the gradients of x, the gate and
the parameters; the linen and NNX modules, and the errors."""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from normkit import NormSpec, reference, tolerances
from normkit.jax import functional, linen
from normkit.jax import nnx as nk_nnx
from tests.helpers import gated

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _check(name, got, want, spec, x_dtype, magnitude=None):
    gated.check(name, np.asarray(got, np.float64), np.dtype(got.dtype).name, want, spec, x_dtype,
                magnitude)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("output_dtype", ["input", "promote"])
@pytest.mark.parametrize("spec", gated.specs(), ids=gated.spec_id)
def test_functional_matches_the_reference(spec, dtype, output_dtype):
    spec = spec.replace(output_dtype=output_dtype)
    seed = zlib.crc32(f"{gated.spec_id(spec)}-{dtype}-{output_dtype}".encode())
    rng = np.random.default_rng(seed)
    x = (2 * rng.standard_normal((6, 16)) + 0.5).astype(DTYPES[dtype])
    z = (2 * rng.standard_normal((6, 16))).astype(DTYPES[dtype])
    w = (1 + 0.2 * rng.standard_normal(16)).astype(np.float32)
    b = (0.2 * rng.standard_normal(16)).astype(np.float32) if spec.bias else None
    has_gate = spec.gate is not None

    def f(x, z, w, b):
        return functional.normalize(x, spec, w, b, gate=z if has_gate else None)

    y, vjp = jax.vjp(f, x, z, w, b)
    dy = rng.standard_normal(y.shape).astype(np.dtype(y.dtype))
    dx, dz, dw, db = vjp(jnp.asarray(dy))
    if has_gate:
        want = reference.gated_normalize(x, z, spec, w, b)
        grads = reference.gated_normalize_vjp(x, z, dy, spec, w, b)
        _check("dgate", dz, grads.dgate, spec, x.dtype)
    else:
        want = reference.normalize(x, spec, w, b)
        grads = reference.normalize_vjp(x, dy, spec, w, b)
    magnitude = reference.scaled_magnitude(x, spec, w, gate=z if has_gate else None)
    _check("y", y, want, spec, x.dtype, magnitude)
    _check("dx", dx, grads.dx, spec, x.dtype)
    _check("dscale", dw, grads.dscale, spec, x.dtype)
    if b is not None:
        _check("dbias", db, grads.dbias, spec, x.dtype)


def test_leading_axes_and_the_modules():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    z = rng.standard_normal((3, 5, 8)).astype(np.float32)
    spec = NormSpec("layer", gate="before", gate_activation="sigmoid", axis=(0, 2))
    want = reference.gated_normalize(x, z, spec)
    tolerances.assert_close(np.asarray(functional.normalize(x, spec, gate=z)), want)
    jitted = jax.jit(lambda x, z: functional.normalize(x, spec, gate=z))
    tolerances.assert_close(np.asarray(jitted(x, z)), want)
    rows = x.reshape(15, 8)
    for spec in (NormSpec(gate="after", group_size=4), NormSpec(group_size=2, cast="before_scale")):
        gate = z.reshape(15, 8) if spec.gate else None
        want = (reference.gated_normalize(rows, gate, spec) if spec.gate
                else reference.normalize(rows, spec))
        module = linen.from_spec(spec)
        assert module.spec == spec
        params = module.init(jax.random.key(0), rows, gate=gate)
        tolerances.assert_close(np.asarray(module.apply(params, rows, gate=gate)), want)
        layer = nk_nnx.from_spec(spec, 8, rngs=nnx.Rngs(0))
        assert layer.spec == spec
        tolerances.assert_close(np.asarray(layer(rows, gate=gate)), want)


def test_gate_missing_or_unexpected_and_unsupported_options_are_refused():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="needs the gate array"):
        functional.normalize(x, NormSpec(gate="after"))
    with pytest.raises(ValueError, match="spec has gate=None"):
        functional.normalize(x, NormSpec(), gate=x)
    with pytest.raises(ValueError, match="gate has shape"):
        functional.normalize(x, NormSpec(gate="after"), gate=jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="gate"):
        functional.normalize(x, NormSpec(gate="after"), gate=jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        functional.normalize(x, NormSpec(group_size=3))
    with pytest.raises(ValueError, match="neither axis_name nor mask"):
        functional.normalize(x, NormSpec(group_size=4), mask=jnp.ones((2, 8), bool))
    with pytest.raises(ValueError, match="does not compute a residual with group_size"):
        functional.add_norm(x, x, NormSpec(group_size=4, residual="rounded"))
