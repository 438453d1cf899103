"""Correctly rounded float32 means and products, for the rounding model of the fast variance.

`NormSpec(variance="fast")` rounds each step to float32: ``m1 = c(mean(x))``, ``c(x_i^2)``,
``m2 = c(mean(c(x_i^2)))`` and ``c(m2 - c(m1^2))``. Plain XLA arithmetic misses that model where
it matters most (rows with a large mean, where ``m2 - m1^2`` cancels): its float32 reductions add
an error that depends on their order, and it contracts a product feeding a subtraction into one
fused multiply-add (rounded once). Here products are formed from 12-bit halves, exact in
float32 whatever XLA fuses, and sums are carried as unevaluated pairs ``hi + lo``, so each
result is the float32 rounding of the exact value (but within about ``2**-24`` ulp of a halfway
point, where the pair's own rounding may decide).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["fast_moments", "mean", "product"]

_LOW_HALF = np.int32(-(1 << 12))  # clears the 12 low bits of a float32's 23-bit fraction


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` exactly, each with at most 12 significant bits."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.int32) & _LOW_HALF, a.dtype)
    return hi, a - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _exact_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(p, e)``: ``p`` the float32 rounding of ``a * b`` and ``e`` what it leaves."""
    ah, al = _split(a)
    bh, bl = _split(b)
    s, e1 = _two_sum(ah * bh, ah * bl)
    s, e2 = _two_sum(s, al * bh)
    rest = (e1 + e2) + al * bl
    total = s + rest
    return total, rest - (total - s)


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` rounded once to float32, never fused with a following addition."""
    return _exact_product(a, b)[0]


def _add_pairs(
    p: tuple[jax.Array, jax.Array], q: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    s, e = _two_sum(p[0], q[0])
    e = e + (p[1] + q[1])
    hi = s + e
    return hi, e - (hi - s)


def _pair_sum(values: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    zero = np.zeros((), values.dtype)
    hi, lo = lax.reduce((values, jnp.zeros_like(values)), (zero, zero), _add_pairs, axes)
    shape = [1 if a in axes else d for a, d in enumerate(values.shape)]
    return hi.reshape(shape), lo.reshape(shape)


def mean(
    values: jax.Array, axes: tuple[int, ...], n: int | jax.Array, axis_name: str | None = None
) -> jax.Array:
    """The mean over ``axes`` (keepdims) of float32 ``values``, rounded once to float32.

    ``n`` is the number of elements a row has in all (across ``axis_name``'s shards, whose
    partial sums are gathered and added in mesh order), or per row (keepdims; a masked mean,
    the values outside the mask zero). The quotient of the pair sum by ``n`` is corrected by
    its exact remainder.
    """
    hi, lo = _pair_sum(values, axes)
    if axis_name is not None:
        gathered = lax.all_gather(hi, axis_name), lax.all_gather(lo, axis_name)
        zero = np.zeros((), values.dtype)
        hi, lo = lax.reduce(gathered, (zero, zero), _add_pairs, (0,))
    q = hi / n
    p, e = _exact_product(q, jnp.full_like(q, n))
    return q + (((hi - p) - e) + lo) / n


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
    read, the others not (NaN or not)."""
    if where is not None:
        values = jnp.where(where, values, 0)
    m1 = mean(values, axes, n, axis_name)
    variance = mean(product(values, values), axes, n, axis_name) - product(m1, m1)
    return m1, jnp.maximum(variance, 0)
