"""The gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) on rows (rows, n).

The statistic is `NormFunction`'s (its exact backward and its rescaling of rows that overflow
or underflow) taken over groups of ``group_size`` elements; the gate and the affine step are
torch ops around it, so autograd carries the gradients of x, the gate and the parameters
through them in the compute dtype, rounded once to each input's dtype. The roundings of the
dtype policy shape the forward value only (`WithValue`), as in the reference. In a graph being
recorded (``eager``) the statistic is the eager op sequence of `normkit.torch._eager` and the
roundings are plain casts, which autograd differentiates::

    v = x * a(z)  (gate="before")  else x            in the compute dtype
    y_hat = per-group normalization of v             rounded to x's dtype for "before_scale"
    u = y_hat * g + b                                 rounded to the affine dtype for
                                                      "before_scale" with gate="after"
    y = u * a(z)  (gate="after")   else u            rounded to the output dtype
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from normkit.spec import NormSpec
from normkit.torch import _eager
from normkit.torch._autograd import NormFunction, _acc_dtype, _rounded_to


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    """``silu(z) = z sigmoid(z)`` or ``sigmoid(z)``."""
    return torch.nn.functional.silu(z) if name == "silu" else torch.sigmoid(z)


class WithValue(torch.autograd.Function):
    """``value`` in the forward pass, the gradient of ``exact`` in the backward: the rounded
    result of the dtype policy, differentiated as the reference does, without its roundings."""

    generate_vmap_rule = True

    @staticmethod
    def forward(exact: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def norm_rows(
    values: torch.Tensor,
    gate: torch.Tensor | None,
    spec: NormSpec,
    k: int,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    dtype: torch.dtype,
    affine_dtype: torch.dtype,
    out: torch.dtype,
    *,
    eager: bool,
) -> torch.Tensor:
    """``spec`` (gated or grouped) on rows ``values`` of inputs of ``dtype``, y in ``out``.

    ``gate`` has the rows' shape (None for an ungated spec); ``g`` is the effective scale
    ``scale_offset + w`` and ``b`` the bias, (n,) in the compute dtype, or None; ``k`` the
    statistic's size within a group (the group for grouped specs); ``affine_dtype`` the dtype
    of the affine step (x's promoted with the parameters'), where ``"before_scale"`` rounds it
    before a gate after the norm.
    """
    acc = _acc_dtype(dtype)
    v = values.to(acc)
    a = None if gate is None else activation(gate.to(acc), spec.gate_activation or "silu")
    if spec.gate == "before":
        assert a is not None
        v = v * a
    rows, n = v.shape
    group = spec.group_size or n
    groups = v.reshape(rows * (n // group), group)
    if eager:
        y_hat = _eager._normalized(groups, _eager.eager_spec(spec), k, None)
    else:
        y_hat, _ = NormFunction.apply(
            groups, None, None, spec.kind, k, spec.eps, spec.eps_placement == "outside",
            "after_scale", acc, acc, spec.variance == "fast",
        )
    y_hat = y_hat.reshape(v.shape)

    def affine_and_gate(rounded: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None):
        """u = y_hat g + b, and u a(z) after the norm; ``rounded`` at the rounding points."""
        u = y_hat if rounded is None else rounded(y_hat, dtype)
        if g is not None:
            u = u * g
        if b is not None:
            u = u + b
        if spec.gate == "after":
            assert a is not None
            u = (u if rounded is None else rounded(u, affine_dtype)) * a
        return u

    if spec.cast != "before_scale" or dtype == acc:
        return affine_and_gate(None).to(out)
    if eager:
        return affine_and_gate(lambda t, to: t.to(to).to(acc)).to(out)
    with torch.no_grad():
        value = affine_and_gate(_rounded_to)
    return WithValue.apply(affine_and_gate(None), value).to(out)
