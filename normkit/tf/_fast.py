"""``variance="fast"``: LayerNorm's ``y_hat`` from the moments ``mean(x)`` and ``mean(x**2)``,
each step rounded once to the input's dtype as `normkit.reference` says, whatever order a
compiler gives the operations."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from normkit import _float_pairs
from normkit.spec import NormSpec
from normkit.tf import _ops
from normkit.tf._rows import r_of

__all__ = ["fast_normalized"]


def fast_normalized(spec: NormSpec, x: Any, axes: tuple[int, ...]) -> Any:
    """``variance="fast"``'s ``y_hat`` (no gradient): ``(x - m1) r(v)`` with the moments of
    `fast_moments`."""
    assert spec.eps is not None
    x = ops.stop_gradient(x)
    m1, v = fast_moments(x, axes)
    return (x - m1) * r_of(v, spec.eps, spec.eps_placement == "outside")


def fast_moments(x: Any, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """``variance="fast"``'s ``(m1, v)`` over ``axes`` (kept), each step rounded once to ``x``'s
    dtype ``c`` as `normkit.reference` says::

        m1 = c(mean(x))    m2 = c(mean(c(x^2)))    v = max(0, c(m2 - c(m1^2)))

    A float32 ``x`` cannot take these as written where a compiler reorders them: XLA (under
    ``jit_compile`` and ``jax.jit``) divides by ``n`` as a product by ``1 / n`` (float16 rows of
    a large mean came out 32 ulps off) and contracts ``m2 - m1 * m1`` into one fused
    multiply-add, which leaves ``m1^2`` unrounded (and turned ``inf - inf`` into ``inf``). On
    JAX the steps are normkit.jax's (`normkit._jax_exact`); elsewhere the float32 squares are
    summed in float64, each mean is rounded from float64 (correct but within about ``2**-29``
    ulp of a halfway point), and ``m1^2`` is `_rounded_square`. float64 inputs take the steps
    as written."""
    if keras.backend.standardize_dtype(x.dtype) == "float64":
        m1 = _ops.mean(x, axes)
        v = _ops.mean(ops.square(x), axes) - m1 * m1
        return m1, _ops.maximum(v, ops.zeros_like(v))
    if keras.backend.backend() == "jax":
        from normkit import _jax_exact

        return _jax_exact.fast_moments(x, axes, math.prod(x.shape[a] for a in axes))
    m1 = ops.cast(_ops.mean(ops.cast(x, "float64"), axes), x.dtype)
    m2 = ops.cast(_ops.mean(ops.cast(x * x, "float64"), axes), x.dtype)
    v = m2 - _rounded_square(m1)
    return m1, _ops.maximum(v, ops.zeros_like(v))


def _rounded_square(m: Any) -> Any:
    """``m * m`` of float32 ``m``, rounded once: on TensorFlow from halves of 12 bits
    (`normkit._float_pairs`), whose products XLA's contraction into a following subtraction
    cannot change (a float64 square cast to float32 becomes the float32 product it equals);
    on torch, whose eager ops are not fused, the float64 square rounded to float32."""
    if keras.backend.backend() != "tensorflow":
        wide = ops.cast(m, "float64")
        return ops.cast(wide * wide, m.dtype)
    import tensorflow as tf

    def split(a: Any) -> tuple[Any, Any]:
        bits = tf.bitwise.bitwise_and(tf.bitcast(a, tf.int32), _float_pairs.LOW_HALF)
        high = tf.bitcast(bits, a.dtype)
        return high, a - high

    plain = m * m
    return tf.where(tf.math.is_inf(plain), plain, _float_pairs.exact_product(m, m, split)[0])
