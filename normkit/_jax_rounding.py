"""A value rounded to a narrower dtype and kept in its own, on JAX: the spec's rounding points
inside float32 work, for normkit.jax and normkit.tf on Keras' JAX backend (it imports JAX).

``x.astype(bfloat16).astype(float32)`` states such a rounding, but XLA may drop a pair of casts
like that (``xla_allow_excess_precision``, on by default, does so on GPUs), and so may it the
rounding of a half-precision operation whose result feeds float32 work. ``lax.reduce_precision``
is an operation of its own that XLA keeps. It rounds to nearest even and overflows to infinity
as the cast does, but flushes the narrower dtype's subnormals to zero; float16's (below
``2**-14``) are rounded here as multiples of ``2**-24`` instead. bfloat16 has float32's exponent
range, so its subnormals are float32's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

__all__ = ["round_to", "offset_in_dtype"]


def round_to(value: jax.Array, dtype: DTypeLike) -> jax.Array:
    """``value`` rounded to ``dtype`` (nearest even), in ``value``'s dtype; itself where
    ``dtype`` is not narrower. Its gradient rounds the cotangent the same way, as the cast
    pair's does (reverse mode only: a `jax.custom_vjp`)."""
    narrow = jnp.dtype(dtype)
    if jnp.finfo(narrow).bits >= jnp.finfo(value.dtype).bits:
        return value
    return _rounded(value, narrow)


def offset_in_dtype(scale: jax.Array, offset: float, at_least: DTypeLike) -> jax.Array:
    """``offset + scale`` rounded once to ``scale``'s dtype (``offset_dtype="param"``), summed
    and held in ``scale``'s dtype promoted with ``at_least`` (the sum of a half ``scale`` and
    the offset rounds there as the exact one does)."""
    wide = jnp.promote_types(scale.dtype, at_least)
    return round_to(scale.astype(wide) + offset, scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rounded(value: jax.Array, dtype: jnp.dtype) -> jax.Array:
    info, own = jnp.finfo(dtype), jnp.finfo(value.dtype)
    rounded = lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp == own.nexp:  # same exponent range: no subnormal of dtype is flushed
        return rounded
    quantum = float(info.smallest_subnormal)
    subnormal = jnp.round(value / quantum) * quantum  # exact scaling by a power of two
    return lax.select(jnp.abs(value) < float(info.smallest_normal), subnormal, rounded)


def _rounded_fwd(value: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, None]:
    return _rounded(value, dtype), None


def _rounded_bwd(dtype: jnp.dtype, _: None, cotangent: jax.Array) -> tuple[jax.Array]:
    return (_rounded(cotangent, dtype),)


_rounded.defvjp(_rounded_fwd, _rounded_bwd)
