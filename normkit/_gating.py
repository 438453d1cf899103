"""The steps of the gated and grouped norms (`NormSpec.gate`, `NormSpec.group_size`) that every
adapter takes alike, written with ``*`` and ``+`` only, so that they serve any array type::

    v = x * a(z)  (gate="before")  else x            in the compute dtype
    y_hat = per-group normalization of v             rounded to x's dtype for "before_scale"
    u = y_hat * (scale_offset + w) + b               rounded to the affine dtype for
                                                      "before_scale" with gate="after"
    y = u * a(z)  (gate="after")   else u            rounded to the output dtype

Each adapter computes ``a(z)`` and the per-group normalization with its own ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from normkit.spec import NormSpec

__all__ = ["affine_and_gate", "group_spec"]


def group_spec(spec: NormSpec) -> NormSpec:
    """The norm ``spec`` applies to each group: its statistic and eps over the last axis, without
    a gate or parameters."""
    return NormSpec(
        spec.kind, eps=spec.eps, eps_placement=spec.eps_placement, p=spec.p, axis=-1,
        scale=False, bias=False, variance=spec.variance,
    )


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
