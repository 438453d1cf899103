"""Flax NNX modules that compute a `NormSpec` exactly (via `normkit.jax.functional`).

The parameters are ``scale`` and ``bias`` (`flax.nnx.Param`, or None when the spec lacks them),
as in ``flax.nnx.RMSNorm``/``LayerNorm``, so their state loads with `flax.nnx.update`; `DyT`
adds ``alpha``, of shape ``(1,)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from normkit.jax import functional
from normkit.jax._fields import check_residual, module_kwargs
from normkit.spec import (
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    Backward,
    Cast,
    EpsPlacement,
    Kind,
    NormSpec,
    OffsetDtype,
    OutputDtype,
    Residual,
    Variance,
)

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec"]


class _Norm(nnx.Module):
    """A module computing ``spec``; the public classes below fix its kind."""

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
        self.alpha = (
            nnx.Param(jnp.full((1,), spec.alpha_init, param_dtype))
            if spec.alpha_init is not None
            else None
        )

    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``y`` for ``x`` (over ``spec.axis``), or with a ``residual`` spec ``(y, h)`` for
        ``h = x + residual``; ``y`` has ``x``'s dtype (``dtype`` when set; the promoted one with
        ``output_dtype="promote"``)."""
        check_residual(type(self).__name__, self.spec, residual)
        scale, bias, alpha = (
            None if p is None else p[...] for p in (self.scale, self.bias, self.alpha)
        )
        if residual is None:
            return functional.normalize(
                x, self.spec, scale, bias, alpha=alpha, dtype=self.dtype,
                axis_name=self.axis_name,
            )
        return functional.add_norm(
            x, residual, self.spec, scale, bias, alpha=alpha, dtype=self.dtype,
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
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``): the module is then called as
        ``module(x, residual)`` and returns ``(y, h)``.
      offset_dtype: ``"float32"`` (default) or ``"param"``: ``scale_offset + scale`` rounded
        to ``param_dtype`` first.
      output_dtype: ``"input"`` (default) or ``"promote"`` (Flax's ``result_type(x, params)``).
      backward: ``"exact"`` (default: the analytic VJP) or ``"autograd"`` (JAX differentiates
        the eager formula, rounding as eager model code does in half precision).
      dtype: the dtype to compute in (the input is cast to it); None: the input's.
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
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="rms", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=use_scale,
            scale_offset=scale_offset, bias=use_bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward,
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
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="partial_rms", p=p, eps=epsilon, eps_placement=eps_placement, axis=axis,
            scale=use_scale, scale_offset=scale_offset, bias=use_bias, cast=cast,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name)


class LayerNorm(_Norm):
    r"""LayerNorm: ``y = (x - mean) / sqrt(var + epsilon) * (scale_offset + scale) + bias``.

    Args:
      variance: ``"two_pass"`` (default: ``mean((x - mean(x))**2)``) or ``"fast"``
        (``max(0, mean(x**2) - mean(x)**2)``, each step rounded to float32: Flax's
        ``use_fast_variance=True``, its default).
      The other arguments are `RMSNorm`'s; ``use_bias`` defaults to True.
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
        variance: Variance = "two_pass",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="layer", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=use_scale,
            scale_offset=scale_offset, bias=use_bias, cast=cast, variance=variance,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name)


class DyT(_Norm):
    r"""Dynamic Tanh: ``y = tanh(alpha * x) * (scale_offset + scale) + bias``, elementwise.

    ``alpha`` is a learned `flax.nnx.Param` of shape ``(1,)``, initially ``alpha_init``; for
    half inputs ``tanh`` is computed in float32.

    Args:
      shape: as in `RMSNorm`: the shape of ``scale`` and ``bias``.
      alpha_init: the initial ``alpha``. Default 0.5 (the paper's; x-transformers uses 1.0).
      The other arguments are `RMSNorm`'s (no epsilon, eps_placement, axis_name); ``use_bias``
      defaults to True.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> dyt = DyT(2, rngs=nnx.Rngs(0))
      >>> dyt.alpha[...]
      Array([0.5], dtype=float32)
      >>> [round(float(v), 4) for v in dyt(jnp.array([[1.0, -2.0]]))[0]]  # tanh(0.5 x)
      [0.4621, -0.7616]
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        *,
        alpha_init: float = DEFAULT_ALPHA_INIT,
        axis: int | tuple[int, ...] = -1,
        use_scale: bool = True,
        scale_offset: float = 0.0,
        use_bias: bool = True,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        spec = NormSpec(
            kind="dyt", alpha_init=alpha_init, axis=axis, scale=use_scale,
            scale_offset=scale_offset, bias=use_bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward,
        )
        super().__init__(spec, shape, dtype=dtype, param_dtype=param_dtype, axis_name=None)


def from_spec(
    spec: NormSpec,
    shape: int | Sequence[int],
    *,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = jnp.float32,
    axis_name: str | None = None,
    rngs: nnx.Rngs | None = None,
) -> RMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The NNX module (`RMSNorm`, `PartialRMSNorm`, `LayerNorm` or `DyT`) that computes
    ``spec``.

    ``shape`` is the input's size over ``spec.axis``; the other arguments are `RMSNorm`'s
    (``axis_name`` must stay None for DyT, which has no statistic).
    """
    kwargs = module_kwargs(spec)
    if spec.kind == "dyt":
        if axis_name is not None:
            raise ValueError(
                f"axis_name={axis_name!r} is invalid for kind='dyt': DyT has no statistic to "
                "reduce across shards"
            )
        return DyT(shape, **kwargs, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    cls = _CLASSES[spec.kind]
    return cls(  # type: ignore[no-any-return]
        shape, **kwargs, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name, rngs=rngs,
    )


_CLASSES: dict[Kind, type[RMSNorm | PartialRMSNorm | LayerNorm]] = {
    "rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm,
}
