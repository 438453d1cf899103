"""The translation between a `NormSpec` and the modules' Flax-style keyword arguments."""

from __future__ import annotations

from typing import Any

from normkit.spec import NormSpec


def module_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The keyword arguments that make a linen or NNX norm of ``spec.kind`` compute ``spec``."""
    kwargs: dict[str, Any] = dict(
        epsilon=spec.eps,
        eps_placement=spec.eps_placement,
        axis=spec.axis,
        use_scale=spec.scale,
        scale_offset=spec.scale_offset,
        use_bias=spec.bias,
        cast=spec.cast,
    )
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    return kwargs
