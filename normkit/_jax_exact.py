"""Correctly rounded float32 means and products, for the rounding model of the fast variance.

`NormSpec(variance="fast")` rounds each step to float32: ``m1 = c(mean(x))``, ``c(x_i^2)``,
``m2 = c(mean(c(x_i^2)))`` and ``c(m2 - c(m1^2))``. Plain XLA arithmetic misses that model where
it matters most (rows with a large mean, where ``m2 - m1^2`` cancels): its float32 reductions add
an error that depends on their order, and it contracts a product feeding a subtraction into one
fused multiply-add (rounded once). Here products are formed from 12-bit halves, exact in
float32 whatever XLA fuses, and sums are carried as unevaluated pairs ``hi + lo``, so each
result is the float32 rounding of the exact value (but within about ``2**-24`` ulp of a halfway
point, where the pair's own rounding may decide). A product that overflows float32 is the
infinity a float32 operation gives, and so is a mean of infinities; a mean whose sum alone
overflows is taken from the sum in units of 2**64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from normkit import _float_pairs

__all__ = ["fast_moments", "mean", "product"]

_LOW_HALF = np.int32(_float_pairs.LOW_HALF)


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` exactly, each with at most 12 significant bits."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.int32) & _LOW_HALF, a.dtype)
    return hi, a - hi


def _exact_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(p, e)``: ``p`` the float32 rounding of ``a * b`` and ``e`` what it leaves."""
    return _float_pairs.exact_product(a, b, _split)


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` rounded once to float32 (infinity where it overflows), never fused with a
    following addition."""
    plain = a * b
    return jnp.where(jnp.isinf(plain), plain, _exact_product(a, b)[0])


def _add_pair(
    p: tuple[jax.Array, jax.Array], q: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    s, e = _float_pairs.two_sum(p[0], q[0])
    e = jnp.where(jnp.isinf(s), 0, e + (p[1] + q[1]))  # no error term beside an infinity
    hi = s + e
    return hi, jnp.where(jnp.isinf(hi), 0, e - (hi - s))


def _add_pairs(p: tuple[jax.Array, ...], q: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Two pair sums side by side: of the values, and of the values in units of `_UNIT`."""
    return (*_add_pair((p[0], p[1]), (q[0], q[1])), *_add_pair((p[2], p[3]), (q[2], q[3])))


# A sum of finite float32 values overflows only above 2**128: it is also taken in units of
# 2**64, where values below 2**-62 (which flush to zero there) are far below its rounding.
_UNIT = 2.0**64


def _pair_sums(values: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    zero = np.zeros((), values.dtype)
    nothing = jnp.zeros_like(values)
    sums = lax.reduce((values, nothing, values * (1 / _UNIT), nothing), (zero,) * 4,
                      _add_pairs, axes)
    shape = [1 if a in axes else d for a, d in enumerate(values.shape)]
    return tuple(v.reshape(shape) for v in sums)


def mean(
    values: jax.Array, axes: tuple[int, ...], n: int | jax.Array, axis_name: str | None = None
) -> jax.Array:
    """The mean over ``axes`` (keepdims) of float32 ``values``, rounded once to float32.

    ``n`` is the number of elements a row has in all (across ``axis_name``'s shards, whose
    partial sums are gathered and added in mesh order), or per row (keepdims; a masked mean,
    the values outside the mask zero). The quotient of the pair sum by ``n`` is corrected by
    its exact remainder. Where the sum of finite values overflows float32, the mean is that
    of the sum in units of 2**64 (the rounding commutes with that power of two).
    """
    sums = _pair_sums(values, axes)
    if axis_name is not None:
        gathered = tuple(lax.all_gather(v, axis_name) for v in sums)
        zero = np.zeros((), values.dtype)
        sums = lax.reduce(gathered, (zero,) * 4, _add_pairs, (0,))
    hi, lo, hi_units, lo_units = sums
    overflowed = jnp.isinf(hi) & jnp.isfinite(hi_units)
    hi, lo = jnp.where(overflowed, hi_units, hi), jnp.where(overflowed, lo_units, lo)
    q = hi / n
    p, e = _exact_product(q, jnp.full_like(q, n))
    quotient = jnp.where(jnp.isinf(hi), q, q + (((hi - p) - e) + lo) / n)
    return jnp.where(overflowed, quotient * _UNIT, quotient)


def fast_moments(
    values: jax.Array,
    axes: tuple[int, ...],
    n: int | jax.Array,
    axis_name: str | None = None,
    where: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``variance="fast"``'s ``(m1, v)`` of float32 ``values`` over ``axes`` (keepdims), each
    step rounded once to float32 as `normkit.reference` says::

        m1 = c(mean(x))    m2 = c(mean(c(x^2)))    v = max(0, c(m2 - c(m1^2)))

    ``n`` and ``axis_name`` as in `mean`; ``where`` (broadcastable to ``values``): the elements
    read, the others not (NaN or not). Squares that overflow make ``m2`` infinite, as in
    float32 (``v`` is then infinite, or NaN where ``m1^2`` overflows too); squares whose sum
    alone overflows do not."""
    if where is not None:
        values = jnp.where(where, values, 0)
    m1 = mean(values, axes, n, axis_name)
    variance = mean(product(values, values), axes, n, axis_name) - product(m1, m1)
    return m1, jnp.maximum(variance, 0)
