"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) in ``keras.ops``, in
the order of steps of `normkit._gating`.

The statistic is an inner normkit layer's (its guards for rows that overflow or underflow, its
exact gradient) over groups of ``group_size`` elements, in the compute dtype; the gate and the
affine step are ops around it, differentiated by the backend in the compute dtype. The roundings
of the dtype policy shape the forward value only (``y + stop_gradient(value - y)``, as the
layers' before-scale cast does), so the gradient is the reference's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from normkit import _gating
from normkit.spec import NormSpec
from normkit.tf._rounding import rounded

__all__ = ["gated_or_grouped"]


def activation(z: Any, name: str, recording: bool) -> Any:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``, from ``e^-|z|`` (`_gating.activation`:
    ``ops.sigmoid`` is 0 below z = -88.7). Where a gradient may be taken (``recording``), it is
    ``a'(z)`` formed there too: TensorFlow's and XLA's CPU code flush subnormals, which
    autodiff's products would pass through."""
    wide = keras.backend.standardize_dtype(z.dtype) == "float64"
    if not recording:
        return _gating.activation(z, name, ops, wide)[0]

    @ops.custom_gradient
    def activated(z: Any) -> Any:
        a, slope = _gating.activation(z, name, ops, wide)

        def grad(*args: Any, upstream: Any = None) -> Any:
            return (args[0] if upstream is None else upstream) * slope

        return a, grad

    return activated(z)


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
    recording: bool = True,
) -> Any:
    """``spec`` on ``x`` (in ``work``, with the policy of ``dtype`` inputs) and ``gate`` (None
    without one), y in ``out``. ``scale`` is ``scale_offset + w`` and ``bias`` ``b``, both in
    ``work`` and shaped as the normalized axes, or None; ``normalize(v)`` is the norm of
    `normkit._gating.group_spec` on ``v`` (in ``work``) over its last axis; ``recording``:
    whether a gradient may be taken for ``gate``."""
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
        a = activation(z, spec.gate_activation or "silu", recording)
    if spec.gate == "before":
        v = v * a
    group = spec.group_size or n
    y_hat = ops.reshape(normalize(ops.reshape(v, (*lead_shape, n // group, group))), v.shape)
    g = None if scale is None else ops.reshape(scale, (n,))
    b = None if bias is None else ops.reshape(bias, (n,))

    affine_and_gate = functools.partial(
        _gating.affine_and_gate, y_hat, g, b, a, spec, dtype, affine_dtype
    )
    y = affine_and_gate()
    if spec.cast == "before_scale" and dtype != work:
        value = affine_and_gate(lambda t, to: rounded(ops.cast(t, work), to))
        y = y + ops.stop_gradient(value - y)
    y = ops.reshape(ops.cast(y, out), moved.shape)
    return ops.transpose(y, tuple(order.index(i) for i in range(len(x.shape))))
