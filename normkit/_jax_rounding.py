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
import numpy as np
from jax import lax
from jax.typing import DTypeLike

__all__ = ["round_to", "offset_in_dtype", "round_bits"]


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


def round_bits(value: jax.Array, dtype: DTypeLike) -> jax.Array:
    """float32 ``value`` rounded to the half dtype ``dtype`` (nearest even, overflowing to
    infinity, float16's subnormals as multiples of ``2**-24``), kept in float32, by integer
    arithmetic on its bits: for Pallas kernels, where ``reduce_precision`` has no Triton
    lowering and a pair of casts is what XLA's interpreter of the kernel may drop."""
    info = jnp.finfo(dtype)
    drop = 23 - int(info.nmant)  # the fraction bits float32 has beyond dtype's
    bits = lax.bitcast_convert_type(value, jnp.int32)
    odd = lax.shift_right_arithmetic(bits, np.int32(drop)) & np.int32(1)
    kept = (bits + np.int32((1 << (drop - 1)) - 1) + odd) & np.int32(-(1 << drop))
    rounded = lax.bitcast_convert_type(kept, jnp.float32)
    if info.nexp != 8:  # float16: its range, and its subnormals as multiples of 2**-24
        magnitude = jnp.abs(value)
        rounded = jnp.where(magnitude < float(info.smallest_normal),
                            _subnormal(bits, value), rounded)
        rounded = jnp.where(jnp.abs(rounded) > float(info.max),
                            jnp.where(value < 0, -jnp.inf, jnp.inf), rounded)
    return jnp.where(value == value, rounded, value)  # NaN as it is


def _subnormal(bits: jax.Array, value: jax.Array) -> jax.Array:
    """A float32 ``value`` below float16's smallest normal number (``bits``, its bits) rounded
    to a multiple of ``2**-24`` (nearest even): its 24-bit significand shifted right, with the
    bits shifted out deciding the rounding (no float arithmetic, which XLA may simplify)."""
    biased = lax.shift_right_logical(bits, np.int32(23)) & np.int32(255)
    significand = (bits & np.int32((1 << 23) - 1)) | np.int32(1 << 23)
    shift = jnp.clip(np.int32(126) - biased, 14, 25)  # |value| = significand 2**(biased-150)
    kept = lax.shift_right_logical(significand, shift)
    rest = significand - lax.shift_left(kept, shift)
    half = lax.shift_left(np.int32(1), shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    magnitude = (kept + up.astype(jnp.int32)).astype(jnp.float32) * 2.0**-24
    return jnp.where(value < 0, -magnitude, magnitude)
