"""Flax linen modules that compute a `NormSpec` exactly (via `normkit.jax.functional`)."""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
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


class _Layer(nn.Module):
    """The parameters, options and ``__call__`` every linen layer here shares."""

    kind: ClassVar[Kind]

    axis: int | tuple[int, ...] = -1
    use_scale: bool = True
    scale_offset: float = 0.0
    use_bias: bool = False
    cast: Cast = "after_scale"
    residual: Residual | None = None
    offset_dtype: OffsetDtype = "float32"
    output_dtype: OutputDtype = "input"
    backward: Backward = "exact"
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        raise NotImplementedError

    def _spec(self, **fields: Any) -> NormSpec:
        return NormSpec(
            kind=self.kind,
            axis=self.axis,
            scale=self.use_scale,
            scale_offset=self.scale_offset,
            bias=self.use_bias,
            cast=self.cast,
            residual=self.residual,
            offset_dtype=self.offset_dtype,
            output_dtype=self.output_dtype,
            backward=self.backward,
            **fields,
        )

    def _param(
        self, name: str, shape: tuple[int, ...], value: float, x: jax.Array
    ) -> jax.Array:
        """Parameter ``name`` (initially ``value``), checked against x's size over ``axis``."""
        if self.has_variable("params", name):
            have = jnp.shape(self.get_variable("params", name))
            if have != shape:
                raise ValueError(
                    f"{type(self).__name__}: x of shape {x.shape} has {shape} features over "
                    f"axis {self.spec.axis}, but the layer's {name!r} has shape {have}"
                )
        return self.param(name, nn.initializers.constant(value), shape, self.param_dtype)

    def _params(
        self, spec: NormSpec, x: jax.Array
    ) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
        shape = spec.param_shape(x.shape)
        scale = self._param("scale", shape, spec.scale_init, x) if spec.scale else None
        bias = self._param("bias", shape, 0.0, x) if spec.bias else None
        alpha = None
        if spec.kind == "dyt":
            assert spec.alpha_init is not None
            alpha = self._param("alpha", (1,), spec.alpha_init, x)
        return scale, bias, alpha

    @nn.compact
    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``y`` for ``x`` (over ``axis``), or with a ``residual`` spec ``(y, h)`` for
        ``h = x + residual``; ``y`` has ``x``'s dtype (``dtype`` when set; the promoted one with
        ``output_dtype="promote"``)."""
        spec = self.spec
        check_residual(type(self).__name__, spec, residual)
        x = jnp.asarray(x)
        scale, bias, alpha = self._params(spec, x)
        axis_name = getattr(self, "axis_name", None)
        if residual is None:
            return functional.normalize(
                x, spec, scale, bias, alpha=alpha, dtype=self.dtype, axis_name=axis_name
            )
        return functional.add_norm(
            x, residual, spec, scale, bias, alpha=alpha, dtype=self.dtype, axis_name=axis_name
        )


class _Norm(_Layer):
    """The fields of the normalization kinds; see `RMSNorm` for the arguments."""

    epsilon: float = DEFAULT_EPS
    eps_placement: EpsPlacement = "inside"
    axis_name: str | None = None

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        return self._spec(
            eps=self.epsilon,
            eps_placement=self.eps_placement,
            p=getattr(self, "p", None),
            variance=getattr(self, "variance", None),
        )


class RMSNorm(_Norm):
    r"""RMSNorm: ``y = x / sqrt(mean(x**2) + epsilon) * (scale_offset + scale) [+ bias]``.

    Attributes:
      epsilon: the constant in ``r(s)``. Default 1e-6.
      eps_placement: ``"inside"`` the square root (default) or ``"outside"`` it.
      axis: the normalized axes (int or tuple); ``scale``/``bias`` have the input's shape over
        them. Flax's ``reduction_axes`` and ``feature_axes`` both equal to ``axis``. Default -1.
      use_scale: learn ``scale`` (initialised to ``1 - scale_offset``). Default True.
      scale_offset: added to ``scale`` before multiplying; 1.0 is Gemma's convention. Default 0.
      use_bias: learn ``bias`` (initialised to 0). Default False (True for `LayerNorm`).
      cast: ``"after_scale"`` (default) or ``"before_scale"`` (Llama) for half inputs.
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``): the module is then called as
        ``module.apply(params, x, residual)`` and returns ``(y, h)``.
      offset_dtype: ``"float32"`` (default) or ``"param"``: ``scale_offset + scale`` rounded
        to ``param_dtype`` first.
      output_dtype: ``"input"`` (default: the input's dtype, or ``dtype``) or ``"promote"``
        (Flax's ``result_type(x, params)``).
      backward: ``"exact"`` (default: the analytic VJP) or ``"autograd"`` (JAX differentiates
        the eager formula, rounding as eager model code does in half precision).
      dtype: the dtype to compute in (the input is cast to it); None: the input's.
      param_dtype: the parameters' dtype. Default float32.
      axis_name: the mesh axis the normalized axes are sharded over (inside ``shard_map``); the
        statistics are reduced across it. Default None.

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
    single normalized axis.

    Attributes:
      p: the fraction, ``0 < p <= 1``. Required.
      The other attributes are `RMSNorm`'s.
    """

    kind: ClassVar[Kind] = "partial_rms"
    p: float | None = None


class LayerNorm(_Norm):
    r"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + epsilon) * (scale_offset + scale) + bias``.

    Attributes:
      variance: ``"two_pass"`` (default: ``mean((x - mean(x))**2)``, accurate when the mean is
        large against the spread) or ``"fast"`` (``max(0, mean(x**2) - mean(x)**2)``, each
        step rounded to float32: Flax's ``use_fast_variance=True``, its default).
      The other attributes are `RMSNorm`'s; ``use_bias`` defaults to True.
    """

    kind: ClassVar[Kind] = "layer"
    use_bias: bool = True
    variance: Variance = "two_pass"


class DyT(_Layer):
    r"""Dynamic Tanh: ``y = tanh(alpha * x) * (scale_offset + scale) + bias``, elementwise.

    ``alpha`` is a learned parameter of shape ``(1,)``, initially ``alpha_init``; ``scale`` and
    ``bias`` have the input's shape over ``axis``. For half inputs ``tanh`` is computed in
    float32.

    Attributes:
      alpha_init: the initial ``alpha``. Default 0.5 (the paper's; x-transformers uses 1.0).
      The others are `RMSNorm`'s (no epsilon, eps_placement, axis_name); ``use_bias`` defaults
      to True.

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
    """The linen module that computes ``spec``.

    ``kwargs`` go to the module: ``dtype``, ``param_dtype``, ``axis_name`` (not for DyT),
    ``name``, ``parent``.
    """
    return _CLASSES[spec.kind](**module_kwargs(spec), **kwargs)
