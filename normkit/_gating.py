"""The steps of the gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) that every
adapter takes alike, written with ``*``, ``+`` and the functions every array namespace names
alike (``exp``, ``where``, ``zeros_like``, ``ones_like``, ``full_like`` of ``torch``,
``jax.numpy`` and ``keras.ops``), so that they serve any array type::

    v = x * a(z)  (gate="before")  else x            in the compute dtype
    y_hat = per-group normalization of v             rounded to x's dtype for "before_scale"
    u = y_hat * (scale_offset + w) + b               rounded to the affine dtype for
                                                      "before_scale" with gate="after"
    y = u * a(z)  (gate="after")   else u            rounded to the output dtype

Each adapter computes the per-group normalization with its own ops, and ``a(z)`` with
`activation`, differentiated as its framework allows (flush-to-zero arithmetic, below, needs
``a'(z)`` from `activation` too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from normkit.spec import NormSpec

__all__ = ["activation", "affine_and_gate", "group_spec"]

# Where `activation` forms sigmoid(z) in units of e^-shift: below -shift (float32, float64).
_SHIFT = {False: 64.0, True: 512.0}


def group_spec(spec: NormSpec) -> NormSpec:
    """The norm ``spec`` applies to each group: its statistic and eps over the last axis, without
    a gate or parameters."""
    return NormSpec(
        spec.kind, eps=spec.eps, eps_placement=spec.eps_placement, p=spec.p, axis=-1,
        scale=False, bias=False, variance=spec.variance,
    )


def activation(z: Any, name: str, xp: Any, wide: bool = False) -> tuple[Any, Any]:
    """``(a(z), a'(z))`` of the gate's activation ``name`` on ``z`` in float32 (float64 where
    ``wide``), ``xp`` the array namespace::

        sigmoid(z) = 1 / (1 + e^-z)     sigmoid' = sigmoid(z) sigmoid(-z)
        silu(z) = z sigmoid(z)          silu' = sigmoid(z) (1 + z sigmoid(-z))

    with ``sigmoid(z)`` and ``sigmoid(-z)`` both from ``e^-|z|``, as `normkit.reference` does:
    ``1 / (1 + e^-z)`` is 0 below z = -88.7 (e^-z overflows), where silu is still about
    -1e-37. Below ``-S`` (S = 64 in float32, 512 in float64) ``e^-|z|`` is formed as
    ``e^(z + S)`` (``z + S`` exact there) and the results as ``(z sigmoid(z) e^S) e^-S``: their
    factors stay normal numbers wherever the result is one (down to z = -92 in float32, -715
    in float64), so arithmetic that flushes subnormals to zero (TensorFlow's and XLA's on a
    CPU) keeps them. Above ``-S`` the values are the reference formula's, times 1.
    """
    shift = _SHIFT[wide]
    negative = z < 0
    far = z < -shift
    # e^-|z|, and e^(shift - |z|) where far (e^-|z| is below 1e-27 there: 1 + it is 1).
    e = xp.exp(xp.where(far, z + shift, xp.where(negative, z, -z)))
    total = 1 + xp.where(far, xp.zeros_like(z), e)
    near, tail = 1 / total, e / total  # sigmoid(|z|), sigmoid(-|z|) (times e^shift where far)
    sig = xp.where(negative, tail, near)
    sig_neg = xp.where(negative, near, tail)
    unit = xp.where(far, xp.full_like(z, math.exp(-shift)), xp.ones_like(z))
    if name == "sigmoid":
        return sig * unit, sig * sig_neg * unit
    return z * sig * unit, sig * (1 + z * sig_neg) * unit


def affine_and_gate(
    y_hat: Any,
    g: Any,
    b: Any,
    a: Any,
    spec: NormSpec,
    dtype: Any,
    affine_dtype: Any,
    rounded: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """``u = y_hat g + b`` (``g`` the effective scale ``scale_offset + w``, ``g`` or ``b`` None
    where the spec has none), times ``a = a(z)`` for ``gate="after"``.

    ``rounded(t, to)``, where given, rounds at the before-scale points: ``y_hat`` to the input
    ``dtype``, and ``u`` to ``affine_dtype`` before the gate multiplies it."""
    u = y_hat if rounded is None else rounded(y_hat, dtype)
    if g is not None:
        u = u * g
    if b is not None:
        u = u + b
    if spec.gate == "after":
        u = (u if rounded is None else rounded(u, affine_dtype)) * a
    return u
