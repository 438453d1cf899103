"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) in ``keras.ops``.

The statistic is an inner normkit layer's (its guards for rows that overflow or underflow, its
exact gradient) over groups of ``group_size`` elements, in the compute dtype; the gate and the
affine step are ops around it, differentiated by the backend in the compute dtype. The roundings
of the dtype policy shape the forward value only (``y + stop_gradient(value - y)``, as the
layers' before-scale cast does), so the gradient is the reference's::

    v = x * a(z)  (gate="before")  else x            in the compute dtype
    y_hat = per-group normalization of v             rounded to x's dtype for "before_scale"
    u = y_hat * (scale_offset + w) + b               rounded to the affine dtype for
                                                      "before_scale" with gate="after"
    y = u * a(z)  (gate="after")   else u            rounded to the output dtype
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from keras import ops

from normkit.spec import NormSpec

__all__ = ["gated_or_grouped", "inner_spec"]


def activation(z: Any, name: str) -> Any:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``."""
    return z * ops.sigmoid(z) if name == "silu" else ops.sigmoid(z)


def inner_spec(spec: NormSpec) -> NormSpec:
    """The ungated norm without parameters that normalizes each group, over the last axis."""
    return NormSpec(
        spec.kind, eps=spec.eps, eps_placement=spec.eps_placement, p=spec.p, axis=-1,
        scale=False, bias=False, variance=spec.variance,
    )


def gated_or_grouped(
    x: Any,
    gate: Any,
    spec: NormSpec,
    dtype: str,
    work: str,
    scale: Any,
    bias: Any,
    affine_dtype: str,
    out: str,
    normalize: Callable[[Any], Any],
) -> Any:
    """``spec`` on ``x`` (in ``work``, with the policy of ``dtype`` inputs) and ``gate`` (None
    without one), y in ``out``. ``scale`` is ``scale_offset + w`` and ``bias`` ``b``, both in
    ``work`` and shaped as the normalized axes, or None; ``normalize(v)`` is `inner_spec`'s norm
    of ``v`` (in ``work``) over its last axis."""
    axes = spec.resolve_axes(len(x.shape))
    lead = [a for a in range(len(x.shape)) if a not in axes]
    order = (*lead, *axes)
    moved = ops.transpose(x, order)
    lead_shape = tuple(moved.shape[: len(lead)])
    n = math.prod(moved.shape[len(lead):])
    rows = ops.reshape(moved, (*lead_shape, n))
    v = rows
    a = None
    if gate is not None:
        z = ops.reshape(ops.transpose(ops.cast(gate, work), order), (*lead_shape, n))
        a = activation(z, spec.gate_activation or "silu")
    if spec.gate == "before":
        v = v * a
    group = spec.group_size or n
    y_hat = ops.reshape(normalize(ops.reshape(v, (*lead_shape, n // group, group))), v.shape)
    g = None if scale is None else ops.reshape(scale, (n,))
    b = None if bias is None else ops.reshape(bias, (n,))

    def affine_and_gate(rounded: Callable[[Any, str], Any] | None) -> Any:
        u = y_hat if rounded is None else rounded(y_hat, dtype)
        if g is not None:
            u = u * g
        if b is not None:
            u = u + b
        if spec.gate == "after":
            u = (u if rounded is None else rounded(u, affine_dtype)) * a
        return u

    y = affine_and_gate(None)
    if spec.cast == "before_scale" and dtype != work:
        value = affine_and_gate(lambda t, to: ops.cast(ops.cast(t, to), work))
        y = y + ops.stop_gradient(value - y)
    y = ops.reshape(ops.cast(y, out), moved.shape)
    return ops.transpose(y, tuple(order.index(i) for i in range(len(x.shape))))
