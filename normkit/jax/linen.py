"""Flax linen modules that compute a `NormSpec` exactly (via `normkit.jax.functional`)."""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from normkit.jax import functional
from normkit.jax._fields import module_kwargs
from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, Kind, NormSpec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "from_spec"]


class _Norm(nn.Module):
    """The fields and ``__call__`` the three linen norms share; see `RMSNorm` for the arguments."""

    kind: ClassVar[Kind]

    epsilon: float = DEFAULT_EPS
    eps_placement: EpsPlacement = "inside"
    axis: int | tuple[int, ...] = -1
    use_scale: bool = True
    scale_offset: float = 0.0
    use_bias: bool = False
    cast: Cast = "after_scale"
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    axis_name: str | None = None

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module computes."""
        return NormSpec(
            kind=self.kind,
            eps=self.epsilon,
            eps_placement=self.eps_placement,
            p=getattr(self, "p", None),
            axis=self.axis,
            scale=self.use_scale,
            scale_offset=self.scale_offset,
            bias=self.use_bias,
            cast=self.cast,
        )

    def _param(self, name: str, shape: tuple[int, ...], value: float, x: jax.Array) -> jax.Array:
        """Parameter ``name`` (initially ``value``), checked against x's size over ``axis``."""
        if self.has_variable("params", name):
            have = jnp.shape(self.get_variable("params", name))
            if have != shape:
                raise ValueError(
                    f"{type(self).__name__}: x of shape {x.shape} has {shape} features over "
                    f"axis {self.spec.axis}, but the layer's {name!r} has shape {have}"
                )
        return self.param(name, nn.initializers.constant(value), shape, self.param_dtype)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalize ``x`` over ``axis``; returns ``x``'s dtype (or ``dtype`` when set)."""
        spec = self.spec
        x = jnp.asarray(x)
        shape = spec.param_shape(x.shape)
        scale = self._param("scale", shape, spec.scale_init, x) if spec.scale else None
        bias = self._param("bias", shape, 0.0, x) if spec.bias else None
        return functional.normalize(
            x, spec, scale, bias, dtype=self.dtype, axis_name=self.axis_name
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
      dtype: the dtype to compute in and return (the input is cast to it); None: the input's.
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

    The variance is computed in two passes (``mean((x - mean(x))**2)``), which stays accurate
    when the mean is large against the spread. Attributes are `RMSNorm`'s; ``use_bias`` defaults
    to True.
    """

    kind: ClassVar[Kind] = "layer"
    use_bias: bool = True


_CLASSES: dict[Kind, type[RMSNorm | PartialRMSNorm | LayerNorm]] = {
    "rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm,
}


def from_spec(spec: NormSpec, **kwargs: Any) -> RMSNorm | PartialRMSNorm | LayerNorm:
    """The linen module that computes ``spec``.

    ``kwargs`` go to the module: ``dtype``, ``param_dtype``, ``axis_name``, ``name``, ``parent``.
    """
    spec.require_defaults("normkit.jax")
    return _CLASSES[spec.kind](**module_kwargs(spec), **kwargs)
