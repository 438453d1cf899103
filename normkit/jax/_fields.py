"""The translation between a `NormSpec` and the modules' Flax-style keyword arguments, and the
check of a module's residual argument against its spec."""

from __future__ import annotations

from typing import Any

from normkit.spec import NormSpec


def module_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The keyword arguments that make a linen or NNX module of ``spec.kind`` compute ``spec``."""
    kwargs: dict[str, Any] = dict(
        axis=spec.axis,
        use_scale=spec.scale,
        scale_offset=spec.scale_offset,
        use_bias=spec.bias,
        cast=spec.cast,
        residual=spec.residual,
        offset_dtype=spec.offset_dtype,
        output_dtype=spec.output_dtype,
        backward=spec.backward,
    )
    if spec.kind == "dyt":
        kwargs["alpha_init"] = spec.alpha_init
        return kwargs
    kwargs.update(epsilon=spec.eps, eps_placement=spec.eps_placement)
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    if spec.kind == "layer":
        kwargs["variance"] = spec.variance
    return kwargs


def check_residual(layer: str, spec: NormSpec, residual: object) -> None:
    """A residual exactly when ``spec`` has one: TypeError for a missing one, ValueError for one
    the spec has no rounding for."""
    if spec.residual is not None and residual is None:
        raise TypeError(
            f"{layer} has residual={spec.residual!r}: call it with the residual, "
            "layer(x, residual), and it returns (y, h)"
        )
    if spec.residual is None and residual is not None:
        raise ValueError(
            f"{layer} was given a residual but its spec has residual=None; build it with "
            "residual='rounded', 'float32' or 'float32_normalized' to add one before the norm"
        )
