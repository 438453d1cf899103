"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) in JAX.

The statistic is `normkit.jax.functional.normalize`'s (its analytic VJP and its guards for
rows that overflow or underflow) over groups of ``group_size`` elements, in the compute dtype;
the gate and the affine step are jnp ops around it, so JAX differentiates them, in the compute
dtype, with one rounding to each input's dtype. The roundings of the dtype policy shape the
forward value only (`_with_value`), as in the reference::

    v = x * a(z)  (gate="before")  else x            in the compute dtype
    y_hat = per-group normalization of v             rounded to x's dtype for "before_scale"
    u = y_hat * (scale_offset + w) + b               rounded to the affine dtype for
                                                      "before_scale" with gate="after"
    y = u * a(z)  (gate="after")   else u            rounded to the output dtype
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from normkit.spec import NormSpec

__all__ = ["gated_or_grouped"]


def activation(z: jax.Array, name: str) -> jax.Array:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``."""
    return jax.nn.silu(z) if name == "silu" else jax.nn.sigmoid(z)


@jax.custom_vjp
def _with_value(exact: jax.Array, value: jax.Array) -> jax.Array:
    """``value`` in the forward pass, the gradient of ``exact`` in the backward."""
    return value


def _with_value_fwd(exact: jax.Array, value: jax.Array) -> tuple[jax.Array, None]:
    return value, None


def _with_value_bwd(_: None, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, jnp.zeros_like(g)


_with_value.defvjp(_with_value_fwd, _with_value_bwd)


def gated_or_grouped(
    x: jax.Array,
    gate: jax.Array | None,
    spec: NormSpec,
    scale: jax.Array | None,
    bias: jax.Array | None,
    out: jnp.dtype,
    normalize: Callable[[jax.Array, NormSpec], jax.Array],
) -> jax.Array:
    """``spec`` with a gate or groups on ``x`` (already checked and in its compute-policy
    dtype), y in ``out``; ``normalize(v, spec)`` is the ungated norm of rows over the last axis.
    """
    axes = spec.resolve_axes(x.ndim)
    lead = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*lead, *axes))
    lead_shape = moved.shape[: len(lead)]
    n = math.prod(moved.shape[len(lead):])
    rows = moved.reshape((*lead_shape, n))
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    v = rows.astype(acc)
    a = None
    if gate is not None:
        a = activation(jnp.transpose(gate, (*lead, *axes)).reshape(rows.shape).astype(acc),
                       spec.gate_activation or "silu")
    if spec.gate == "before":
        assert a is not None
        v = v * a
    group = spec.group_size or n
    inner = NormSpec(
        spec.kind, eps=spec.eps, eps_placement=spec.eps_placement, p=spec.p, axis=-1,
        scale=False, bias=False, variance=spec.variance,
    )
    y_hat = normalize(v.reshape((*lead_shape, n // group, group)), inner).reshape(v.shape)
    g = None  # no scale, or its initial value: an effective scale of 1
    if scale is not None:
        w = scale.reshape(n)
        g = (w + spec.scale_offset).astype(acc) if spec.offset_dtype == "param" else (
            w.astype(acc) + spec.scale_offset
        )
    b = None if bias is None else bias.reshape(n).astype(acc)
    # The affine step's dtype, as the reference's: x's promoted with the effective scale's (w's,
    # at least float32 where the offset is added in float32) and b's; None takes no part.
    kinds = [x.dtype]
    if scale is not None:
        kinds.append(scale.dtype)
        if spec.scale_offset and spec.offset_dtype == "float32":
            kinds.append(jnp.float32)
    if bias is not None:
        kinds.append(bias.dtype)
    affine_dtype = jnp.result_type(*kinds)

    def affine_and_gate(rounded: Callable[[jax.Array, jnp.dtype], jax.Array] | None) -> jax.Array:
        u = y_hat if rounded is None else rounded(y_hat, x.dtype)
        if g is not None:
            u = u * g
        if b is not None:
            u = u + b
        if spec.gate == "after":
            assert a is not None
            u = (u if rounded is None else rounded(u, affine_dtype)) * a
        return u

    y = affine_and_gate(None)
    if spec.cast == "before_scale" and x.dtype != acc:
        value = affine_and_gate(lambda t, to: t.astype(to).astype(acc))
        y = _with_value(y, jax.lax.stop_gradient(value))
    y = y.astype(out).reshape(moved.shape)
    order = (*lead, *axes)
    return jnp.transpose(y, tuple(order.index(i) for i in range(x.ndim)))
