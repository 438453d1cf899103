"""normkit.torch on every field beyond the original spec, against normkit.reference.

Residual add, fast variance, the offset in the parameter's dtype, the promoted output dtype,
DyT and the autograd backward, through the conformance hook (modules and functions), in every
dtype; the DyT module; add_norm's h; the error messages.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402
from normkit.torch import conformance  # noqa: E402

ALL_DTYPES = [dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16]


def inputs(spec, shape, dtype, param_dtype, seed=0):
    """x, dy, scale, bias, residual, dh, alpha for ``spec``, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    x = dtypes.round_to(rng.standard_normal(shape), dtype)
    dy = rng.standard_normal(shape)
    pshape = spec.param_shape(shape)
    scale = bias = residual = dh = alpha = None
    if spec.scale:
        scale = dtypes.round_to(spec.scale_init + 0.1 * rng.standard_normal(pshape), param_dtype)
    if spec.bias:
        bias = dtypes.round_to(0.1 * rng.standard_normal(pshape), param_dtype)
    if spec.kind == "dyt":
        alpha = dtypes.round_to(np.array([0.75]), param_dtype)
    if spec.residual is not None:
        residual = dtypes.round_to(rng.standard_normal(shape), dtype)
        dh = rng.standard_normal(shape)
    return x, dy, scale, bias, residual, dh, alpha


def expected(spec, x, dy, scale, bias, residual, dh, alpha):
    """The reference's outputs, named as the hook names its own."""
    out = reference.output_dtype(x.dtype, spec, scale, bias, alpha)
    if spec.residual is None:
        y = reference.normalize(x, spec, scale, bias, alpha)
        grads = reference.normalize_vjp(x, dy.astype(out), spec, scale, bias, alpha)
        values = x
        named = {"y": y, "dx": grads.dx, "dscale": grads.dscale, "dbias": grads.dbias}
    else:
        y, h = reference.add_normalize(x, residual, spec, scale, bias, alpha)
        dh = dh.astype(h.dtype)
        grads = reference.add_normalize_vjp(
            x, residual, dy.astype(out), dh, spec, scale, bias, alpha
        )
        values = x.astype(np.float64) + residual.astype(np.float64)
        if spec.residual == "rounded":
            values = h
        elif dtypes.is_half(x.dtype):
            values = dtypes.round_to(values, np.float32)
        named = {
            "y": y, "dx": grads.dx, "dscale": grads.dscale, "dbias": grads.dbias, "h": h,
            "dresidual": grads.dresidual,
        }
    if spec.kind == "dyt":
        named["dalpha"] = grads.dalpha
    return named, values


def check(spec, dtype, param_dtype=np.float32, shape=(3, 16), seed=0, **variant):
    """The hook's outputs on ``spec`` against the reference, through normkit.tolerances."""
    x, dy, scale, bias, residual, dh, alpha = inputs(spec, shape, dtype, param_dtype, seed)
    want, values = expected(spec, x, dy, scale, bias, residual, dh, alpha)
    got = conformance.evaluate(
        spec, x, dy.astype(want["y"].dtype), scale, bias, residual=residual,
        dh=None if dh is None else dh.astype(want["h"].dtype), alpha=alpha, **variant
    )
    assert len(got) == len(want)
    half_before = dtypes.is_half(x.dtype) and spec.cast == "before_scale"
    for (name, w), g in zip(want.items(), got, strict=True):
        assert (g is None) == (w is None), name
        if w is None:
            continue
        parameter = {"dscale": scale, "dbias": bias, "dalpha": alpha}.get(name)
        want_dtype = {
            "y": w.dtype, "h": w.dtype, "dx": x.dtype, "dresidual": x.dtype,
        }.get(name, np.dtype(np.float32) if parameter is None else parameter.dtype)
        assert g.dtype == want_dtype, f"{name}: {g.dtype} != {want_dtype}"
        assert g.shape == w.shape, name
        if name == "h":
            np.testing.assert_array_equal(g, w)
        elif name == "y":
            magnitude = None
            measured = w.dtype
            if half_before:
                # y_hat is rounded to x's dtype first: its ulps are those of x's dtype
                magnitude = reference.scaled_magnitude(values, spec.replace(residual=None),
                                                       scale, alpha)
                measured = x.dtype
            tolerances.assert_close(g, w, measured, cast=spec.cast, what=name,
                                    magnitude=magnitude)
        else:
            tolerances.assert_close(g, w, quantity="grad", cast=spec.cast, what=name)


KINDS = [dict(kind="rms"), dict(kind="partial_rms", p=0.5), dict(kind="layer"),
         dict(kind="dyt")]
FIELDS = [
    (dict(residual="rounded"), np.float32),
    (dict(residual="rounded", cast="before_scale"), np.float32),
    (dict(residual="float32"), np.float32),
    (dict(residual="float32_normalized", cast="before_scale"), np.float32),
    (dict(scale_offset=1.0, offset_dtype="param"), dtypes.bfloat16),
    (dict(output_dtype="promote"), np.float32),
    (dict(output_dtype="promote", cast="before_scale"), np.float32),
    (dict(backward="autograd"), np.float32),
    (dict(backward="autograd", cast="before_scale", bias=True), dtypes.bfloat16),
    (dict(backward="autograd", cast="before_scale", residual="rounded"), np.float32),
    (dict(backward="autograd", residual="float32_normalized", scale_offset=1.0), np.float32),
]


def _id(value):
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return np.dtype(value).name


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
@pytest.mark.parametrize("field, param_dtype", FIELDS, ids=_id)
@pytest.mark.parametrize("kind", KINDS, ids=_id)
def test_every_field_every_kind_and_dtype(kind, field, param_dtype, dtype):
    check(NormSpec(**kind, **field), dtype, param_dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_id)
def test_fast_variance(dtype):
    check(NormSpec("layer", variance="fast"), dtype)
    check(NormSpec("layer", variance="fast", residual="float32", cast="before_scale"), dtype,
          api="functional")
    check(NormSpec("layer", variance="fast", backward="autograd"), dtype)
