"""Flax NNX modules that compute a `NormSpec` exactly (via `normkit.jax.functional`).

The parameters are ``scale`` and ``bias`` (`flax.nnx.Param`, or None when the spec lacks them),
as in ``flax.nnx.RMSNorm``/``LayerNorm``, so their state loads with `flax.nnx.update`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from normkit.jax import functional
from normkit.jax._fields import module_kwargs
from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, Kind, NormSpec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "from_spec"]


class _Norm(nnx.Module):
    """A norm computing ``spec``; the public classes below fix its kind."""

    def __init__(
        self,
        spec: NormSpec,
        shape: int | Sequence[int],
        *,
        dtype: DTypeLike | None,
        param_dtype: DTypeLike,
        axis_name: str | None,
    ) -> None:
        self.spec = spec
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        sizes_valid = all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape
        )
        if len(self.shape) != len(spec.axis) or not sizes_valid:
            raise ValueError(
                f"shape={shape!r} must give one positive size per normalized axis {spec.axis} "
                "(ints, not bools)"
            )
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.axis_name = axis_name
        self.scale = (
            nnx.Param(jnp.full(self.shape, spec.scale_init, param_dtype)) if spec.scale else None
        )
        self.bias = nnx.Param(jnp.zeros(self.shape, param_dtype)) if spec.bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalize ``x`` over ``spec.axis``; returns ``x``'s dtype (or ``dtype`` when set)."""
        return functional.normalize(
            x,
            self.spec,
            None if self.scale is None else self.scale[...],
            None if self.bias is None else self.bias[...],
            dtype=self.dtype,
            axis_name=self.axis_name,
        )


class RMSNorm(_Norm):
    r"""RMSNorm: ``y = x / sqrt(mean(x**2) + epsilon) * (scale_offset + scale) [+ bias]``.

    Args:
      shape: the input's size over ``axis`` (an int, or a tuple for several axes): the shape of
        ``scale`` and ``bias``. Flax's ``num_features`` for one axis.
      epsilon: the constant in ``r(s)``. Default 1e-6.
      eps_placement: ``"inside"`` the square root (default) or ``"outside"`` it.
      axis: the normalized axes (Flax's ``reduction_axes`` = ``feature_axes``). Default -1.
      use_scale: learn ``scale`` (initialised to ``1 - scale_offset``). Default True.
      scale_offset: added to ``scale`` before multiplying; 1.0 is Gemma's convention. Default 0.
      use_bias: learn ``bias`` (initialised to 0). Default False.
      cast: ``"after_scale"`` (default) or ``"before_scale"`` (Llama) for half inputs.
      dtype: the dtype to compute in and return (the input is cast to it); None: the input's.
      param_dtype: the parameters' dtype. Default float32.
      axis_name: the mesh axis the normalized axes are sharded over (inside ``shard_map``).
      rngs: accepted for Flax's calling convention and unused: the initial values are constants.

    Examples:
      >>> import jax.numpy as jnp
      >>> norm = RMSNorm(2)
      >>> [round(float(v), 4) for v in norm(jnp.array([[3.0, 4.0]]))[0]]  # [3, 4] / sqrt(12.5)
      [0.8485, 1.1314]
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        *,
        epsilon: float = DEFAULT_EPS,
        eps_placement: EpsPlacement = "inside",
        axis: int | tuple[int, ...] = -1,
        use_scale: bool = True,
        scale_offset: float = 0.0,
        use_bias: bool = False,
        cast: Cast = "after_scale",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="rms", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=use_scale,
            scale_offset=scale_offset, bias=use_bias, cast=cast,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name)


class PartialRMSNorm(_Norm):
    r"""Partial RMSNorm: the statistic over the first ``k = spec.stat_size(n)`` elements of a row.

    Args:
      shape: as in `RMSNorm`.
      p: the fraction, ``0 < p <= 1``; ``k = max(1, floor(n * p))``. Required.
      The other arguments are `RMSNorm`'s. With ``axis_name`` the first ``k`` of the global row
      are read (a single normalized axis only).
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        *,
        p: float,
        epsilon: float = DEFAULT_EPS,
        eps_placement: EpsPlacement = "inside",
        axis: int | tuple[int, ...] = -1,
        use_scale: bool = True,
        scale_offset: float = 0.0,
        use_bias: bool = False,
        cast: Cast = "after_scale",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="partial_rms", p=p, eps=epsilon, eps_placement=eps_placement, axis=axis,
            scale=use_scale, scale_offset=scale_offset, bias=use_bias, cast=cast,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name)


class LayerNorm(_Norm):
    r"""LayerNorm with a two-pass variance: ``y = (x - mean) / sqrt(var + epsilon) * g + bias``.

    ``g = scale_offset + scale``. Arguments are `RMSNorm`'s; ``use_bias`` defaults to True.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        *,
        epsilon: float = DEFAULT_EPS,
        eps_placement: EpsPlacement = "inside",
        axis: int | tuple[int, ...] = -1,
        use_scale: bool = True,
        scale_offset: float = 0.0,
        use_bias: bool = True,
        cast: Cast = "after_scale",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="layer", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=use_scale,
            scale_offset=scale_offset, bias=use_bias, cast=cast,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name)


def from_spec(
    spec: NormSpec,
    shape: int | Sequence[int],
    *,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = jnp.float32,
    axis_name: str | None = None,
    rngs: nnx.Rngs | None = None,
) -> RMSNorm | PartialRMSNorm | LayerNorm:
    """The NNX module (`RMSNorm`, `PartialRMSNorm` or `LayerNorm`) that computes ``spec``.

    ``shape`` is the input's size over ``spec.axis``; the other arguments are `RMSNorm`'s.
    """
    spec.require_defaults("normkit.jax")
    cls = _CLASSES[spec.kind]
    return cls(
        shape, **module_kwargs(spec), dtype=dtype, param_dtype=param_dtype, axis_name=axis_name,
        rngs=rngs,
    )


_CLASSES: dict[Kind, type[RMSNorm | PartialRMSNorm | LayerNorm]] = {
    "rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm,
}
