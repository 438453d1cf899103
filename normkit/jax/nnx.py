"""Flax NNX modules that compute a `NormSpec` exactly (via `normkit.jax.functional`).

They are drop-in replacements for ``flax.nnx.RMSNorm`` and ``flax.nnx.LayerNorm``: the same
arguments with the same defaults (``epsilon=1e-6``, ``use_fast_variance=True``, Flax's output
dtype), ``num_features`` first, ``rngs`` used as Flax uses it (one ``rngs.params()`` key per
parameter, scale then bias, so the layers built after one get the same initial weights), the
parameters ``scale`` and ``bias`` (`flax.nnx.Param`, or None when the spec lacks them; their
state loads with `flax.nnx.update`) and ``mask=`` at call time. `DyT` adds ``alpha``, of shape
``(1,)``. normkit's own options are keyword extras; an explicit one wins over the Flax argument
it refines (a contradicting pair is a ValueError).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from normkit.jax._fields import (
    Axes,
    Initializer,
    Params,
    as_axes,
    flax_axis,
    flax_spec,
    module_kwargs,
    module_output,
)
from normkit.jax.functional import Implementation
from normkit.spec import (
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    Backward,
    Cast,
    EpsPlacement,
    Gate,
    GateActivation,
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
        num_features: int | Sequence[int],
        *,
        feature_axes: Axes,
        dtype: DTypeLike | None,
        param_dtype: DTypeLike,
        flax_dtype: bool,
        scale_init: Initializer | None,
        bias_init: Initializer | None,
        axis_name: str | None,
        rngs: nnx.Rngs | None,
        implementation: Implementation | None,
    ) -> None:
        self.spec = spec
        self.implementation = implementation
        self.shape = (num_features,) if isinstance(num_features, int) else tuple(num_features)
        sizes_valid = all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape
        )
        if len(self.shape) != len(as_axes(feature_axes)) or not sizes_valid:
            raise ValueError(
                f"shape={num_features!r} must give one positive size per normalized axis "
                f"{as_axes(feature_axes)} (ints, not bools): num_features is the input's size "
                "over the feature axes"
            )
        self.num_features = num_features
        self.feature_axes = feature_axes
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.flax_dtype = flax_dtype
        self.axis_name = axis_name
        self.use_scale = spec.scale
        self.use_bias = spec.bias
        self.scale = (
            nnx.Param(self._initial("scale_init", scale_init, spec.scale_init, rngs))
            if spec.scale
            else None
        )
        self.bias = (
            nnx.Param(self._initial("bias_init", bias_init, 0.0, rngs)) if spec.bias else None
        )
        self.alpha = (
            nnx.Param(jnp.full((1,), spec.alpha_init, param_dtype))
            if spec.alpha_init is not None
            else None
        )

    def _initial(
        self, name: str, init: Initializer | None, value: float, rngs: nnx.Rngs | None
    ) -> jax.Array:
        """A parameter's initial value: ``init(rngs.params(), shape, param_dtype)``, or the
        constant ``value`` when ``init`` is None. A key is drawn whenever ``rngs`` is given, as
        Flax draws one per parameter."""
        key = None if rngs is None else rngs.params()
        if init is None:
            return jnp.full(self.shape, value, self.param_dtype)
        if key is None:
            raise ValueError(
                f"{type(self).__name__}: {name} needs rngs to draw its key from; pass "
                "rngs=nnx.Rngs(...)"
            )
        return jnp.asarray(init(key, self.shape, self.param_dtype))

    def __call__(
        self,
        x: jax.Array,
        residual: jax.Array | None = None,
        *,
        gate: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``y`` for ``x`` (over ``spec.axis``), or with a ``residual`` spec ``(y, h)`` for
        ``h = x + residual``. ``gate`` (keyword-only, required exactly with a gated spec): the
        gated norm of ``x`` and ``gate``. ``mask`` (Flax's, keyword-only): the statistics over
        the elements where it is True (`normkit.jax.functional.normalize`). With Flax's
        ``dtype``, x and the parameters are cast to it first (Flax's ``promote_dtype``) and
        ``y`` has it; without, ``y`` has ``result_type(x, params)`` (``output_dtype``
        overrides)."""
        return module_output(
            self, self.spec, x, residual, as_axes(self.feature_axes), self._params, gate=gate,
            mask=mask, dtype=self.dtype, axis_name=self.axis_name,
            implementation=self.implementation,
        )

    def _params(self, x: jax.Array, features: tuple[int, ...]) -> Params:
        """``scale``, ``bias`` and ``alpha``; cast to Flax's ``dtype`` where it applies."""
        scale, bias, alpha = (
            None if p is None else p[...] for p in (self.scale, self.bias, self.alpha)
        )
        if self.flax_dtype and self.dtype is not None:
            scale, bias, alpha = (
                None if p is None else p.astype(self.dtype) for p in (scale, bias, alpha)
            )
        return scale, bias, alpha


class _Statistic(_Norm):
    """The normalization kinds, Flax's arguments mapped onto the spec (`flax_spec`); the public
    classes below fix ``kind`` and document the arguments (`RMSNorm`). ``use_bias`` None is the
    kind's Flax default: True for LayerNorm, else False; ``p`` is partial RMS's and
    ``variance`` LayerNorm's (the spec refuses ``p`` and ``variance="fast"`` elsewhere)."""

    kind: ClassVar[Kind]

    def __init__(
        self,
        num_features: int | Sequence[int],
        *,
        p: float | None = None,
        epsilon: float = DEFAULT_EPS,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        use_scale: bool = True,
        use_bias: bool | None = None,
        scale_init: Initializer | None = None,
        bias_init: Initializer | None = None,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        rngs: nnx.Rngs | None = None,
        axis: int | tuple[int, ...] | None = None,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        cast: Cast = "after_scale",
        variance: Variance | None = None,
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype | None = None,
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        implementation: Implementation | None = None,
    ) -> None:
        spec_axis = flax_axis(axis, reduction_axes, feature_axes)[0]
        if axis is not None:
            reduction_axes = feature_axes = axis
        spec = flax_spec(
            self.kind, axis=spec_axis, output_dtype=output_dtype, dtype=dtype, p=p,
            epsilon=epsilon, eps_placement=eps_placement, variance=variance,
            use_fast_variance=use_fast_variance, axis_index_groups=axis_index_groups,
            use_scale=use_scale, scale_offset=scale_offset,
            use_bias=self.kind == "layer" if use_bias is None else use_bias, cast=cast,
            residual=residual, offset_dtype=offset_dtype, backward=backward, gate=gate,
            gate_activation=gate_activation, group_size=group_size,
        )
        super().__init__(
            spec, num_features, feature_axes=feature_axes, dtype=dtype, param_dtype=param_dtype,
            flax_dtype=output_dtype is None, scale_init=scale_init, bias_init=bias_init,
            axis_name=axis_name, rngs=rngs, implementation=implementation,
        )
        self.epsilon = epsilon
        self.reduction_axes = reduction_axes
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance


class RMSNorm(_Statistic):
    r"""RMSNorm: ``y = x / sqrt(mean(x**2) + epsilon) * (scale_offset + scale) [+ bias]``.

    A drop-in for ``flax.nnx.RMSNorm`` (its arguments and defaults), with normkit's options.

    Args:
      num_features: the input's size over ``feature_axes`` (an int, or a tuple for several
        axes): the shape of ``scale`` and ``bias``.
      epsilon: the constant in ``r(s)``. Default 1e-6.
      dtype: Flax's: x and the parameters are cast to it (Flax's ``promote_dtype``) and the
        output has it; None (default): the output has ``result_type(x, params)``. With an
        explicit ``output_dtype`` it is normkit's compute dtype (x cast to it, the parameters
        as they are).
      param_dtype: the parameters' dtype. Default float32.
      use_scale: learn ``scale``. Default True.
      use_bias: learn ``bias``. Default False (True for `LayerNorm`).
      scale_init, bias_init: Flax initializers ``(key, shape, dtype)``, drawn with
        ``rngs.params()``; None (default): the constants ``1 - scale_offset`` and 0.
      reduction_axes: the normalized axes (the statistic's). Default -1.
      feature_axes: the axes ``scale`` and ``bias`` span, among the reduction axes (repeated
        over the others). Default -1.
      axis_name: the mesh axis the normalized axes are sharded over (inside ``shard_map``).
      axis_index_groups: only None (reduction across the whole ``axis_name``).
      use_fast_variance: Flax's flag; no effect on RMS (no mean), `LayerNorm`'s ``variance``.
      rngs: one key per parameter is drawn from ``rngs.params()`` (scale, then bias), as Flax
        does; optional while ``scale_init`` and ``bias_init`` are None.
      axis: normkit's: sets both ``reduction_axes`` and ``feature_axes`` (a Flax argument given
        with another value is a ValueError). Default None.
      eps_placement: ``"inside"`` the square root (default) or ``"outside"`` it.
      scale_offset: added to ``scale`` before multiplying; 1.0 is Gemma's convention. Default 0.
      cast: ``"after_scale"`` (default) or ``"before_scale"`` (Llama) for half inputs.
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``): the module is then called as
        ``module(x, residual)`` and returns ``(y, h)``.
      offset_dtype: ``"float32"`` (default) or ``"param"``: ``scale_offset + scale`` rounded
        to ``param_dtype`` first.
      output_dtype: None (default: Flax's rule, ``"promote"`` without ``dtype``, ``"input"``
        with it), ``"input"`` or ``"promote"``.
      backward: ``"exact"`` (default: the analytic VJP) or ``"autograd"`` (JAX differentiates
        the eager formula, rounding as eager model code does in half precision).
      gate, gate_activation, group_size: the `NormSpec` fields of the gated and grouped norms
        (default None: no gate, the whole row); a gated module is called as
        ``module(x, gate=z)``.
      implementation: ``"xla"`` or ``"pallas"`` (experimental: normkit's Pallas kernels on
        NVIDIA GPUs, `normkit.jax.functional.normalize`); None (default): the environment
        variable ``NORMKIT_JAX_KERNELS``, else ``"xla"``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> norm = RMSNorm(2, rngs=nnx.Rngs(0))
      >>> [round(float(v), 4) for v in norm(jnp.array([[3.0, 4.0]]))[0]]  # [3, 4] / sqrt(12.5)
      [0.8485, 1.1314]
    """

    kind: ClassVar[Kind] = "rms"


class PartialRMSNorm(_Statistic):
    r"""Partial RMSNorm: the statistic over the first ``k = spec.stat_size(n)`` elements of a row.

    Args:
      num_features: as in `RMSNorm`.
      p: the fraction, ``0 < p <= 1``; ``k = max(1, floor(n * p))``. Required.
      The other arguments are `RMSNorm`'s. With ``axis_name`` the first ``k`` of the global row
      are read (a single normalized axis only). No ``mask``.
    """

    kind: ClassVar[Kind] = "partial_rms"


class LayerNorm(_Statistic):
    r"""LayerNorm: ``y = (x - mean) / sqrt(var + epsilon) * (scale_offset + scale) + bias``.

    A drop-in for ``flax.nnx.LayerNorm`` (its arguments and defaults), with normkit's options.

    Args:
      use_fast_variance: Flax's: True (default) computes ``var`` as ``max(0, mean(x**2) -
        mean(x)**2)``, each step rounded to float32 (``variance="fast"``), False in two passes,
        ``mean((x - mean(x))**2)`` (``variance="two_pass"``).
      variance: normkit's name for the same choice, None (default) or ``"fast"`` /
        ``"two_pass"``; when given it wins (``"fast"`` with ``use_fast_variance=False`` is a
        ValueError).
      The other arguments are `RMSNorm`'s; ``use_bias`` defaults to True.
    """

    kind: ClassVar[Kind] = "layer"


class DyT(_Norm):
    r"""Dynamic Tanh: ``y = tanh(alpha * x) * (scale_offset + scale) + bias``, elementwise.

    ``alpha`` is a learned `flax.nnx.Param` of shape ``(1,)``, initially ``alpha_init``; for
    half inputs ``tanh`` is computed in float32. Flax has no DyT; its dtype conventions apply.

    Args:
      num_features: as in `RMSNorm`: the shape of ``scale`` and ``bias`` over ``axis``.
      alpha_init: the initial ``alpha``. Default 0.5 (the paper's; x-transformers uses 1.0).
      The other arguments are `RMSNorm`'s, with ``axis`` (default -1) for the parameters' axes
      (no epsilon, eps_placement, reduction and feature axes, axis_name, use_fast_variance,
      mask); ``use_bias`` defaults to True.

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
        num_features: int | Sequence[int],
        *,
        alpha_init: float = DEFAULT_ALPHA_INIT,
        axis: int | tuple[int, ...] = -1,
        use_scale: bool = True,
        scale_offset: float = 0.0,
        use_bias: bool = True,
        scale_init: Initializer | None = None,
        bias_init: Initializer | None = None,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype | None = None,
        backward: Backward = "exact",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None = None,
        implementation: Implementation | None = None,
    ) -> None:
        spec = flax_spec(
            "dyt", axis=axis, output_dtype=output_dtype, dtype=dtype, alpha_init=alpha_init,
            use_scale=use_scale, scale_offset=scale_offset, use_bias=use_bias, cast=cast,
            residual=residual, offset_dtype=offset_dtype, backward=backward,
        )
        super().__init__(
            spec, num_features, feature_axes=spec.axis, dtype=dtype, param_dtype=param_dtype,
            flax_dtype=output_dtype is None, scale_init=scale_init, bias_init=bias_init,
            axis_name=None, rngs=rngs, implementation=implementation,
        )


def from_spec(
    spec: NormSpec,
    shape: int | Sequence[int],
    *,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = jnp.float32,
    axis_name: str | None = None,
    rngs: nnx.Rngs | None = None,
    implementation: Implementation | None = None,
) -> RMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The NNX module (`RMSNorm`, `PartialRMSNorm`, `LayerNorm` or `DyT`) that computes
    ``spec`` (every field given explicitly, so Flax's defaults do not apply).

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
        return DyT(shape, **kwargs, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                   implementation=implementation)
    cls = _CLASSES[spec.kind]
    return cls(  # type: ignore[no-any-return]
        shape, **kwargs, dtype=dtype, param_dtype=param_dtype, axis_name=axis_name, rngs=rngs,
        implementation=implementation,
    )


_CLASSES: dict[Kind, type[RMSNorm | PartialRMSNorm | LayerNorm]] = {
    "rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm,
}
