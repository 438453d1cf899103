"""normkit.jax's rounding points survive XLA's excess precision.

On a GPU, XLA drops a pair of casts such as ``bfloat16 -> float32`` after ``float32 ->
bfloat16`` (``xla_allow_excess_precision``), and skips the rounding of a half-precision result
that feeds float32 work: the spec's roundings inside float32 work (before-scale cast, rounded
residual, the offset in the parameter's dtype, the gate's before-scale points) then vanish, and
an H200 gave half-precision LayerNorm outputs 105 ulp from the reference. normkit.jax rounds
with `round_to` (``lax.reduce_precision``), which XLA keeps. The CPU compiler keeps the casts,
so here the guard reads the program handed to XLA: no half-precision value made by arithmetic
or a cast goes back to a wider float, except one cast from an already rounded value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from normkit import NormSpec
from normkit._jax_rounding import round_to
from normkit.jax import functional as F
from tests.helpers.hlo import dropped_roundings

HALF = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_round_to_rounds_as_the_cast_does(dtype) -> None:
    """Bit for bit the cast there and back, value and gradient, on random float32 bit patterns
    and the edges: subnormals of the narrow dtype, halfway points, overflow, infinities, NaN,
    signed zeros."""
    bits = np.random.default_rng(0).integers(0, 2**32, size=200_000, dtype=np.uint64)
    info = ml_dtypes.finfo(dtype)
    tiny, top = float(info.smallest_subnormal), float(info.max)
    edges = [tiny * k for k in np.arange(-40, 40, 0.25)]
    edges += [top * (1 + e) for e in (2.0**-12, 2.0**-9, 2.0**-8, -(2.0**-12))]
    edges += [float(info.smallest_normal) * (1 - 2.0**-12), np.inf, -np.inf, np.nan, 0.0, -0.0]
    values = np.concatenate([bits.astype(np.uint32).view(np.float32),
                             np.array(edges, np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(dtype).astype(np.float32)
    # the value, and the gradient (the cotangent rounded), each against the cast pair's
    value_and_gradient = jax.jit(lambda v: (round_to(v, dtype), jax.vjp(
        lambda u: round_to(u, dtype), jnp.ones_like(v))[1](v)[0]))
    for got in map(np.asarray, value_and_gradient(values)):
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (values[~same][:5], got[~same][:5], want[~same][:5])


def test_round_to_a_dtype_as_wide_is_the_value_itself() -> None:
    value = jnp.asarray([1 + 2.0**-20, 3.0], jnp.float32)
    assert round_to(value, jnp.float32) is value


ROUNDING_SPECS = {
    "layer before_scale bias": (NormSpec(kind="layer", eps=1e-6, cast="before_scale"), {}),
    "layer before_scale autograd": (
        NormSpec(kind="layer", eps=1e-6, cast="before_scale", backward="autograd"), {}),
    "rms offset in the param dtype": (
        NormSpec(kind="rms", eps=1e-6, scale_offset=1.0, offset_dtype="param",
                 cast="after_scale"), {"params": jnp.bfloat16}),
    "rms offset in the param dtype, before_scale": (
        NormSpec(kind="rms", eps=1e-6, scale_offset=1.0, offset_dtype="param",
                 cast="before_scale"), {"params": jnp.bfloat16}),
    "rms residual rounded": (NormSpec(kind="rms", eps=1e-6, residual="rounded"), {}),
    "layer residual float32_normalized": (
        NormSpec(kind="layer", eps=1e-6, residual="float32_normalized"), {}),
    "rms gate after, before_scale": (
        NormSpec(kind="rms", eps=1e-6, gate="after", cast="before_scale"), {}),
    "rms gate before, groups, offset in the param dtype": (
        NormSpec(kind="rms", eps=1e-6, gate="before", group_size=4, scale_offset=1.0,
                 offset_dtype="param", cast="before_scale"), {"params": jnp.bfloat16}),
}


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
@pytest.mark.parametrize("case", ROUNDING_SPECS)
def test_no_rounding_point_is_a_pair_of_casts_xla_may_drop(case: str, dtype) -> None:
    spec, options = ROUNDING_SPECS[case]
    x = jnp.ones((4, 8), dtype)
    params = options.get("params", jnp.float32)
    scale = jnp.ones(8, params)
    bias = jnp.zeros(8, params) if spec.bias else None

    def norm(x, scale, bias, gate):
        if spec.residual is not None:
            return F.add_norm(x, x, spec, scale=scale, bias=bias)
        return F.normalize(x, spec, scale=scale, bias=bias, gate=gate)

    def forward_and_backward(x, scale, bias, gate, cotangent):
        y, backward = jax.vjp(norm, x, scale, bias, gate)
        return y, backward(cotangent)

    gate = x if spec.gate is not None else None
    cotangent = (x, x) if spec.residual is not None else x
    hlo = jax.jit(forward_and_backward).lower(x, scale, bias, gate, cotangent).as_text(
        dialect="hlo")
    assert "reduce-precision" in hlo
    assert dropped_roundings(hlo) == []
