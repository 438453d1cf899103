"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) in JAX, in the order
of steps of `normkit._gating`.

The statistic is `normkit.jax.functional.normalize`'s (its analytic VJP and its guards for
rows that overflow or underflow) over groups of ``group_size`` elements, in the compute dtype;
the gate and the affine step are jnp ops around it, so JAX differentiates them, in the compute
dtype, with one rounding to each input's dtype. The roundings of the dtype policy shape the
forward value only (`_with_value`), as in the reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from normkit import _gating
from normkit._jax_rounding import offset_in_dtype, round_to
from normkit.spec import NormSpec

__all__ = ["gated_or_grouped"]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def activation(z: jax.Array, name: str) -> jax.Array:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``, from ``e^-|z|`` (`_gating.activation`:
    ``jax.nn.silu`` is 0 below z = -88.7), with the derivative formed there too: XLA's CPU code
    flushes subnormals, which autodiff's products would pass through."""
    return _gating.activation(z, name, jnp, z.dtype == jnp.float64)[0]


@activation.defjvp
def _activation_jvp(
    name: str, primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (z,), (dz,) = primals, tangents
    a, slope = _gating.activation(z, name, jnp, z.dtype == jnp.float64)
    return a, slope * dz


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
    groups = v.reshape((*lead_shape, n // group, group))
    y_hat = normalize(groups, _gating.group_spec(spec)).reshape(v.shape)
    g = None  # no scale, or its initial value: an effective scale of 1
    if scale is not None:
        w = scale.reshape(n)
        if spec.offset_dtype == "param":
            g = offset_in_dtype(w, spec.scale_offset, acc).astype(acc)
        else:
            g = w.astype(acc) + spec.scale_offset
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

    affine_and_gate = functools.partial(
        _gating.affine_and_gate, y_hat, g, b, a, spec, x.dtype, affine_dtype
    )
    y = affine_and_gate()
    if spec.cast == "before_scale" and x.dtype != acc:
        value = affine_and_gate(round_to)
        y = _with_value(y, jax.lax.stop_gradient(value))
    y = y.astype(out).reshape(moved.shape)
    order = (*lead, *axes)
    return jnp.transpose(y, tuple(order.index(i) for i in range(x.ndim)))
