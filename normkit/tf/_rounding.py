"""A value rounded to a narrower dtype and kept in its own: the spec's rounding points inside
float32 work, kept under XLA.

A pair of casts (float32 -> bfloat16 -> float32) states such a rounding, but XLA may drop it
(``xla_allow_excess_precision``: on GPUs always, and on the CPU where the pair feeds a
reduction, jaxlib 0.10). On the JAX backend the rounding is therefore
`normkit._jax_rounding.round_to`, built on ``lax.reduce_precision``, an operation XLA keeps.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

__all__ = ["rounded"]


def rounded(u: Any, dtype: str) -> Any:
    """``u`` rounded to ``dtype`` and back to its own dtype; its gradient rounds the cotangent
    to ``dtype`` the same way (the identity when ``dtype`` is not narrower)."""
    own = keras.backend.standardize_dtype(u.dtype)
    if dtype in (own, "float64"):
        return u
    if keras.backend.backend() != "jax":
        return ops.cast(ops.cast(u, dtype), own)
    from normkit._jax_rounding import round_to

    return round_to(u, dtype)
