"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) on rows (rows, n), in
the order of steps of `normkit._gating`.

The statistic is `NormFunction`'s (its exact backward and its rescaling of rows that overflow
or underflow) taken over groups of ``group_size`` elements; the gate and the affine step are
torch ops around it, so autograd carries the gradients of x, the gate and the parameters
through them in the compute dtype, rounded once to each input's dtype. The roundings of the
dtype policy shape the forward value only (`WithValue`), as in the reference. In a graph being
recorded (``eager``) the statistic is the eager op sequence of `normkit.torch._eager` and the
roundings are plain casts, which autograd differentiates.
"""

from __future__ import annotations

import functools
import typing

import torch
import torch.nn.functional as F

from normkit import _gating
from normkit.spec import NormSpec
from normkit.torch import _eager
from normkit.torch._autograd import NormFunction, WithValue, _acc_dtype, _rounded_to, apply
from normkit.torch._cached import cached
from normkit.torch._spec import RowSpec

#: Below these z, torch's own ``F.silu`` and ``torch.sigmoid`` lose their value (``e^-z``
#: overflows at -88.7 in float32, -709.8 in float64); above them they are accurate.
_OWN_ABOVE = {torch.float32: -80.0, torch.float64: -700.0}


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``: torch's own where they are accurate, so
    that gated norms keep the bits of model code that calls them (Hugging Face's gated
    classes), and below from ``e^-|z|`` (`_gating.activation`), where torch's are 0. Autograd
    differentiates both (torch keeps subnormals)."""
    own = F.silu(z) if name == "silu" else torch.sigmoid(z)
    far = _gating.activation(z, name, torch, z.dtype == torch.float64)[0]
    return torch.where(z < _OWN_ABOVE.get(z.dtype, -80.0), far, own)


def norm_rows(
    values: torch.Tensor,
    gate: torch.Tensor | None,
    rows: RowSpec,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    dtype: torch.dtype,
    affine_dtype: torch.dtype,
    out: torch.dtype,
    *,
    eager: bool,
) -> torch.Tensor:
    """``rows`` (gated or grouped) on rows ``values`` of inputs of ``dtype``, y in ``out``.

    ``gate`` has the rows' shape (None for an ungated spec); ``g`` is the effective scale
    ``scale_offset + w`` and ``b`` the bias, (n,) in the compute dtype, or None;
    ``affine_dtype`` the dtype of the affine step (x's promoted with the parameters'), where
    ``"before_scale"`` rounds it before a gate after the norm.
    """
    acc = _acc_dtype(dtype)
    v = values.to(acc)
    a = None if gate is None else activation(gate.to(acc), rows.activation)
    if rows.gate == "before":
        assert a is not None
        v = v * a
    count, n = v.shape
    groups = v.reshape(count * (n // rows.group), rows.group)
    if eager:
        y_hat = _eager._normalized(groups, rows, rows.k, None)
    else:
        y_hat, _ = apply(NormFunction, groups, None, None, _statistic(rows), acc, acc)
    y_hat = y_hat.reshape(v.shape)

    # `_gating.affine_and_gate` reads the spec's ``gate`` only, which RowSpec has alike.
    affine_and_gate = functools.partial(
        _gating.affine_and_gate, y_hat, g, b, a, typing.cast(NormSpec, rows), dtype, affine_dtype
    )
    if not rows.before_scale or dtype == acc:
        return affine_and_gate().to(out)
    if eager:
        return affine_and_gate(lambda t, to: t.to(to).to(acc)).to(out)
    with torch.no_grad():
        value = affine_and_gate(_rounded_to)
    return apply(WithValue, affine_and_gate(), value).to(out)


@cached(256)
def _statistic(rows: RowSpec) -> RowSpec:
    """The per-group normalization of ``rows``: its statistic on rows of one group, without
    the before-scale rounding (applied after the affine step's inputs are formed)."""
    return rows._replace(n=rows.group, before_scale=False, gate="", residual="")
