"""``keras.ops`` where Keras' backends fall short of the dtype they are given: means, maxima and
``tanh`` of float64 tensors, and an exact reciprocal power of two.

Keras 3 computes some float64 operations in float32 on its JAX and torch backends
(``BIT64_TO_BIT32_DTYPE``, or a dtype promotion that does not read torch's dtypes); these keep
the input's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

__all__ = ["maximum", "mean", "reciprocal_power_of_two", "tanh"]


def mean(u: Any, axes: tuple[int, ...]) -> Any:
    """The mean of ``u`` over ``axes`` (kept): `ops.mean`, or for float64 the sum over the
    count, since Keras 3 (``BIT64_TO_BIT32_DTYPE``) makes ``ops.mean`` sum a float64 tensor in
    float32 on its JAX and torch backends (a row of 1e-200s has mean 0 there)."""
    if keras.backend.standardize_dtype(u.dtype) != "float64":
        return ops.mean(u, axis=axes, keepdims=True)
    return ops.sum(u, axis=axes, keepdims=True) / math.prod(u.shape[a] for a in axes)


def maximum(a: Any, b: Any) -> Any:
    """``max(a, b)`` elementwise in ``a``'s dtype, NaN where ``a`` is NaN: `ops.maximum` for
    float64, which Keras' torch backend computes in float32 (its dtype promotion does not read
    torch's dtypes)."""
    return ops.where(a < b, b, a)


def tanh(u: Any) -> Any:
    """``tanh(u)`` in ``u``'s dtype: `ops.tanh`, which on Keras' JAX backend computes a float64
    ``u`` in float32 (as `mean`), so ``jnp.tanh`` there."""
    if keras.backend.backend() != "jax" or keras.backend.standardize_dtype(u.dtype) != "float64":
        return ops.tanh(u)
    import jax.numpy as jnp

    return jnp.tanh(u)


def reciprocal_power_of_two(m: Any) -> Any:
    """``2**-e`` with ``m 2**-e`` in [1, 2), for positive normal ``m`` below ``2**127``
    (``2**1023`` in float64), from ``m``'s exponent bits: scaling by it is exact, where
    ``1 / m`` rounds every value it scales, by ``2**-24`` of ``|x|``, which centering a large
    mean turns into ``|mean| / std`` times that of the centered values (rows of 1e25 (10 +
    N(0, 1)) were 1.05e-6 of their max|y| off with a gate after the norm)."""
    wide = keras.backend.standardize_dtype(m.dtype) == "float64"
    ints, shift, top = ("int64", 52, 2046) if wide else ("int32", 23, 254)
    biased = ops.bitwise_and(ops.right_shift(ops.view(m, ints), shift), top + 1)
    return ops.view(ops.left_shift(top - biased, shift), m.dtype)
