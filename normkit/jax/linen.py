"""Flax linen modules that compute a `NormSpec` exactly (via `normkit.jax.functional`).

They are drop-in replacements for ``flax.linen.RMSNorm`` and ``flax.linen.LayerNorm``: the same
arguments with the same defaults (``epsilon=1e-6``, ``use_fast_variance=True``, the output dtype
``result_type(x, params)``), the same parameters (``scale``, ``bias``, from ``scale_init`` and
``bias_init``) and the same ``mask=`` at call time. normkit's own options are keyword extras; an
explicit one wins over the Flax argument it refines (a contradicting pair is a ValueError).
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from normkit.jax._fields import (
    SHARED_FIELDS,
    Axes,
    Initializer,
    Params,
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


class _Layer(nn.Module):
    """The parameters, options and ``__call__`` every linen layer here shares."""

    kind: ClassVar[Kind]

    axis: int | tuple[int, ...] | None = None
    use_scale: bool = True
    scale_offset: float = 0.0
    use_bias: bool = False
    cast: Cast = "after_scale"
    residual: Residual | None = None
    offset_dtype: OffsetDtype = "float32"
    output_dtype: OutputDtype | None = None
    backward: Backward = "exact"
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    scale_init: Initializer | None = None
    bias_init: Initializer | None = None
    implementation: Implementation | None = None

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        raise NotImplementedError

    def _axes(self) -> tuple[int | tuple[int, ...], tuple[int, ...]]:
        """``(spec axis, feature axes)``: both ``axis`` (default -1) for DyT."""
        axis = -1 if self.axis is None else self.axis
        return axis, (axis,) if isinstance(axis, int) else tuple(axis)

    def _spec(self, **fields: Any) -> NormSpec:
        """The `NormSpec` of the fields every module here has, and ``fields`` (its kind's, by
        the modules' names: `flax_spec`)."""
        return flax_spec(
            self.kind, axis=self._axes()[0], output_dtype=self.output_dtype, dtype=self.dtype,
            **{name: getattr(self, name) for name in SHARED_FIELDS}, **fields,
        )

    def _param(
        self,
        name: str,
        init: Initializer | None,
        shape: tuple[int, ...],
        value: float,
        x: jax.Array,
    ) -> jax.Array:
        """Parameter ``name`` from ``init`` (None: the constant ``value``), checked against x's
        size over the feature axes."""
        if self.has_variable("params", name):
            have = jnp.shape(self.get_variable("params", name))
            if have != shape:
                raise ValueError(
                    f"{type(self).__name__}: x of shape {x.shape} has {shape} features over "
                    f"axis {self._axes()[1]}, but the layer's {name!r} has shape {have}"
                )
        initializer = nn.initializers.constant(value) if init is None else init
        return self.param(name, initializer, shape, self.param_dtype)

    def _params(self, x: jax.Array, features: tuple[int, ...]) -> Params:
        """``scale`` and ``bias`` (Flax's, over the feature axes) and DyT's ``alpha``, after
        checking x's dtype against Flax's ``dtype`` (`_check_flax_dtype`)."""
        self._check_flax_dtype(x)
        spec = self.spec
        shape = tuple(x.shape[a] for a in features)
        scale = bias = alpha = None
        if spec.scale:
            scale = self._param("scale", self.scale_init, shape, spec.scale_init, x)
        if spec.bias:
            bias = self._param("bias", self.bias_init, shape, 0.0, x)
        if spec.kind == "dyt":
            assert spec.alpha_init is not None
            alpha = self._param("alpha", None, (1,), spec.alpha_init, x)
        return scale, bias, alpha

    def _check_flax_dtype(self, x: jax.Array) -> None:
        """With Flax's ``dtype`` (no explicit ``output_dtype``), x must convert to it exactly."""
        if self.dtype is None or self.output_dtype is not None:
            return
        wanted = jnp.dtype(self.dtype)
        if jnp.promote_types(x.dtype, wanted) != wanted:
            raise ValueError(
                f"{type(self).__name__}(dtype={wanted.name}) got x of dtype {x.dtype}: Flax "
                f"normalizes the {x.dtype} values and rounds the result to {wanted.name}, which "
                "NormSpec cannot express (its output is the input's dtype or the promoted one). "
                f"Build it without dtype and cast the output (norm(x).astype({wanted.name}) is "
                "what Flax computes), cast the input first, or pass output_dtype='input' to "
                f"normalize x rounded to {wanted.name}"
            )

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        residual: jax.Array | None = None,
        *,
        gate: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``y`` for ``x`` (over the reduction axes), or with a ``residual`` spec ``(y, h)`` for
        ``h = x + residual``. ``gate`` (keyword-only, required exactly with a gated spec): the
        gated norm of ``x`` and ``gate``. ``mask`` (Flax's, keyword-only): the statistics over
        the elements where it is True (`normkit.jax.functional.normalize`). ``y`` has Flax's
        dtype: ``dtype`` when set, else ``result_type(x, params)`` (``output_dtype``
        overrides)."""
        return module_output(
            self, self.spec, x, residual, self._axes()[1], self._params, gate=gate, mask=mask,
            dtype=self.dtype, axis_name=getattr(self, "axis_name", None),
            implementation=self.implementation,
        )


class _Norm(_Layer):
    """The fields of the normalization kinds; see `RMSNorm` for the arguments."""

    epsilon: float = DEFAULT_EPS
    eps_placement: EpsPlacement = "inside"
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    gate: Gate | None = None
    gate_activation: GateActivation | None = None
    group_size: int | None = None

    def _axes(self) -> tuple[int | tuple[int, ...], tuple[int, ...]]:
        return flax_axis(self.axis, self.reduction_axes, self.feature_axes)

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        return self._spec(
            epsilon=self.epsilon,
            eps_placement=self.eps_placement,
            p=getattr(self, "p", None),
            variance=getattr(self, "variance", None),
            use_fast_variance=self.use_fast_variance,
            axis_index_groups=self.axis_index_groups,
            gate=self.gate,
            gate_activation=self.gate_activation,
            group_size=self.group_size,
        )


class RMSNorm(_Norm):
    r"""RMSNorm: ``y = x / sqrt(mean(x**2) + epsilon) * (scale_offset + scale) [+ bias]``.

    A drop-in for ``flax.linen.RMSNorm`` (its arguments and defaults), with normkit's options.

    Attributes:
      epsilon: the constant in ``r(s)``. Default 1e-6.
      dtype: Flax's: the output dtype (None: ``result_type(x, params)``); the input is
        normalized as this dtype, so it must hold x exactly (a narrower one is a ValueError
        naming the fixes) unless ``output_dtype`` is given, which makes it normkit's compute
        dtype (x cast to it first).
      param_dtype: the parameters' dtype. Default float32.
      use_scale: learn ``scale``. Default True.
      use_bias: learn ``bias``. Default False (True for `LayerNorm`).
      scale_init, bias_init: Flax initializers ``(key, shape, dtype)``; None (default): the
        constants ``1 - scale_offset`` and 0.
      reduction_axes: the normalized axes (the statistic's). Default -1.
      feature_axes: the axes ``scale`` and ``bias`` span, among the reduction axes (repeated
        over the others). Default -1.
      axis_name: the mesh axis the normalized axes are sharded over (inside ``shard_map``); the
        statistics are reduced across it. Default None.
      axis_index_groups: only None (reduction across the whole ``axis_name``).
      use_fast_variance: Flax's flag; no effect on RMS (no mean), `LayerNorm`'s ``variance``.
      axis: normkit's: sets both ``reduction_axes`` and ``feature_axes`` (a Flax argument given
        with another value is a ValueError). Default None.
      eps_placement: ``"inside"`` the square root (default) or ``"outside"`` it.
      scale_offset: added to ``scale`` before multiplying; 1.0 is Gemma's convention. Default 0.
      cast: ``"after_scale"`` (default) or ``"before_scale"`` (Llama) for half inputs.
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``): the module is then called as
        ``module.apply(params, x, residual)`` and returns ``(y, h)``.
      offset_dtype: ``"float32"`` (default) or ``"param"``: ``scale_offset + scale`` rounded
        to ``param_dtype`` first.
      output_dtype: None (default: Flax's rule, ``"promote"`` without ``dtype`` and
        ``"input"`` with it), ``"input"`` or ``"promote"``.
      backward: ``"exact"`` (default: the analytic VJP) or ``"autograd"`` (JAX differentiates
        the eager formula, rounding as eager model code does in half precision).
      gate, gate_activation, group_size: the `NormSpec` fields of the gated and grouped norms
        (default None: no gate, the whole row); a gated module is called as
        ``module(x, gate=z)``.
      implementation: ``"xla"`` or ``"pallas"`` (experimental: normkit's Pallas kernels on
        NVIDIA GPUs, `normkit.jax.functional.normalize`); None (default): the environment
        variable ``NORMKIT_JAX_KERNELS``, else ``"xla"``. Not a field of the spec: the result
        is the same.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> norm = RMSNorm()
      >>> x = jnp.array([[3.0, 4.0]])
      >>> params = norm.init(jax.random.key(0), x)  # {"params": {"scale": ones(2)}}
      >>> [round(float(v), 4) for v in norm.apply(params, x)[0]]  # [3, 4] / sqrt(12.5)
      [0.8485, 1.1314]
    """

    kind: ClassVar[Kind] = "rms"


class PartialRMSNorm(_Norm):
    r"""Partial RMSNorm: the statistic over the first ``k = spec.stat_size(n)`` elements of a row.

    ``k = max(1, floor(n * p))``; normalization, scale and bias apply to all ``n`` elements.
    With ``axis_name`` the first ``k`` of the global (unsharded) row are read; that needs a
    single normalized axis. No ``mask``.

    Attributes:
      p: the fraction, ``0 < p <= 1``. Required.
      The other attributes are `RMSNorm`'s.
    """

    kind: ClassVar[Kind] = "partial_rms"
    p: float | None = None


class LayerNorm(_Norm):
    r"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + epsilon) * (scale_offset + scale) + bias``.

    A drop-in for ``flax.linen.LayerNorm`` (its arguments and defaults), with normkit's options.

    Attributes:
      use_fast_variance: Flax's: True (default) computes ``var`` as ``max(0, mean(x**2) -
        mean(x)**2)``, each step rounded to float32 (``variance="fast"``), False in two passes,
        ``mean((x - mean(x))**2)`` (``variance="two_pass"``, accurate when the mean is large
        against the spread).
      variance: normkit's name for the same choice, None (default) or ``"fast"`` /
        ``"two_pass"``; when given it wins (``"fast"`` with ``use_fast_variance=False`` is a
        ValueError).
      The other attributes are `RMSNorm`'s; ``use_bias`` defaults to True.
    """

    kind: ClassVar[Kind] = "layer"
    use_bias: bool = True
    variance: Variance | None = None


class DyT(_Layer):
    r"""Dynamic Tanh: ``y = tanh(alpha * x) * (scale_offset + scale) + bias``, elementwise.

    ``alpha`` is a learned parameter of shape ``(1,)``, initially ``alpha_init``; ``scale`` and
    ``bias`` have the input's shape over ``axis``. For half inputs ``tanh`` is computed in
    float32. Flax has no DyT; its dtype conventions (``dtype``, the promoted output) apply.

    Attributes:
      alpha_init: the initial ``alpha``. Default 0.5 (the paper's; x-transformers uses 1.0).
      The others are `RMSNorm`'s, with ``axis`` (default -1) for the parameters' axes (no
      epsilon, eps_placement, reduction and feature axes, axis_name, use_fast_variance, mask);
      ``use_bias`` defaults to True.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> dyt = DyT()
      >>> x = jnp.array([[1.0, -2.0]])
      >>> params = dyt.init(jax.random.key(0), x)  # scale ones(2), bias zeros(2), alpha [0.5]
      >>> [round(float(v), 4) for v in dyt.apply(params, x)[0]]  # tanh(0.5 x)
      [0.4621, -0.7616]
    """

    kind: ClassVar[Kind] = "dyt"
    use_bias: bool = True
    alpha_init: float = DEFAULT_ALPHA_INIT

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        return self._spec(alpha_init=self.alpha_init)


_CLASSES: dict[Kind, type[RMSNorm | PartialRMSNorm | LayerNorm | DyT]] = {
    "rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm, "dyt": DyT,
}


def from_spec(spec: NormSpec, **kwargs: Any) -> RMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The linen module that computes ``spec`` (every field given explicitly, so Flax's
    defaults do not apply).

    ``kwargs`` go to the module: ``dtype``, ``param_dtype``, ``axis_name`` (not for DyT),
    ``scale_init``, ``bias_init``, ``implementation``, ``name``, ``parent``.
    """
    return _CLASSES[spec.kind](**module_kwargs(spec), **kwargs)
