"""Keras 3 layers that compute a `NormSpec`, written with ``keras.ops`` for every Keras backend."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, NormSpec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "from_spec"]

_HALF = ("float16", "bfloat16")


class _Norm(keras.layers.Layer):
    """The shared machinery: weights, dtype policy, shape checks and the spec's arithmetic.

    Dtypes: the statistic and the normalized value are computed in float32 (float64 for a
    float64 input). Under a policy whose compute dtype is float16 or bfloat16 (``mixed_float16``,
    ``mixed_bfloat16``), floating inputs are first cast to the compute dtype, so the output is the
    compute dtype. Under a float32 or float64 policy nothing is cast: the output has the input's
    dtype, as the spec says (a bfloat16 input gives a bfloat16 output). Variables have the
    policy's variable dtype and are never autocast.
    """

    def __init__(self, spec: NormSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._spec = spec
        self.autocast = False
        self.supports_masking = True
        self._param_shape: tuple[int, ...] | None = None

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this layer computes."""
        return self._spec

    def _axes(self, shape: tuple[int | None, ...]) -> tuple[int, ...]:
        try:
            return self._spec.resolve_axes(len(shape))
        except ValueError as err:
            raise ValueError(f"{self.name}: input of shape {shape}: {err}") from None

    def _output_dtype(self, dtype: Any) -> str:
        dtype = keras.backend.standardize_dtype(dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise TypeError(
                f"{self.name}: the input has dtype {dtype}; {type(self).__name__} needs a "
                "floating input (float16, bfloat16, float32 or float64)"
            )
        return self.compute_dtype if self.compute_dtype in _HALF else dtype

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        shape = tuple(input_shape)
        axes = self._axes(shape)
        param_shape = tuple(shape[a] for a in axes)
        if any(d is None for d in param_shape):
            raise ValueError(
                f"{self.name}: the normalized axes {axes} of input shape {shape} must have known "
                "sizes to create the weights"
            )
        self._param_shape = param_shape
        self.scale = None
        self.bias = None
        if self._spec.scale:
            self.scale = self.add_weight(
                name="scale",
                shape=param_shape,
                initializer=keras.initializers.Constant(self._spec.scale_init),
                autocast=False,
            )
        if self._spec.bias:
            self.bias = self.add_weight(
                name="bias", shape=param_shape, initializer="zeros", autocast=False
            )

    def _broadcast_shape(self, shape: tuple[int | None, ...]) -> tuple[tuple[int, ...], list[int]]:
        """The normalized axes of ``shape``, checked against the built sizes, and the shape that
        broadcasts a parameter over the input (1 on the other axes)."""
        axes = self._axes(shape)
        assert self._param_shape is not None
        for a, size in zip(axes, self._param_shape, strict=True):
            if shape[a] is not None and shape[a] != size:
                raise ValueError(
                    f"{self.name}: axis {a} of the input (shape {shape}) has size {shape[a]}, but "
                    f"the layer was built for size {size} there (normalized sizes "
                    f"{self._param_shape} over axis {self._spec.axis})"
                )
        target = [1] * len(shape)
        for a, size in zip(axes, self._param_shape, strict=True):
            target[a] = size
        return axes, target

    def call(self, inputs: Any) -> Any:
        """The spec applied to ``inputs`` (a floating tensor), in the output dtype above."""
        spec = self._spec
        dtype = self._output_dtype(inputs.dtype)
        axes, target = self._broadcast_shape(tuple(inputs.shape))
        # Parameters broadcast as they are over trailing axes; elsewhere they are reshaped.
        param_target = None if axes[0] == len(target) - len(axes) else target
        work = "float64" if dtype == "float64" else "float32"
        x = ops.cast(ops.cast(inputs, dtype), work)
        n = int(np.prod(self._param_shape))
        # Rows whose normalized output has a single direction left (n = 1 for the RMS kinds,
        # n = 2 for LayerNorm) are handled below; n is static, so is the choice.
        degenerate = n == (2 if spec.kind == "layer" else 1)
        if spec.kind == "layer" and n == 2:
            # c = +-(x0 - x1) / 2 from one subtraction, exact when x0 and x1 are close (Sterbenz);
            # x - mean(x) would carry the rounding of x0 + x1, an absolute error of ulp(x) that
            # is a large relative error of a small c. Linear in x with the Jacobian of
            # x - mean(x), [[1, -1], [-1, 1]] / 2, since the sign pattern is (1, -1).
            sign = ops.cast(np.array([1.0, -1.0]).reshape(target), work)
            x = sign * (ops.sum(x * sign, axis=axes, keepdims=True) * 0.5)
        elif spec.kind == "layer":
            x = x - ops.mean(x, axis=axes, keepdims=True)
        k = spec.stat_size(n)
        if k < n:
            # The first k of the n normalized elements in row-major order, as a 0/1 mask.
            first_k = (np.arange(n) < k).reshape(target)
            s = ops.sum(ops.square(x) * ops.cast(first_k, work), axis=axes, keepdims=True) / k
        else:
            s = ops.mean(ops.square(x), axis=axes, keepdims=True)
        if spec.eps_placement == "inside":
            r = ops.rsqrt(s + spec.eps)
        else:
            # sqrt has an infinite derivative at 0; where s == 0 every x in the statistic is 0,
            # and the reference takes the term as 0, which the inner where gives.
            positive = s > 0
            root = ops.where(positive, ops.sqrt(ops.where(positive, s, ops.ones_like(s))), 0.0)
            r = 1.0 / (root + spec.eps)
        y = x * r
        if degenerate:
            # With c the centered row (x for the RMS kinds), y_hat = f(c) = c r(c^2) per element:
            #   inside:  f'(c) = r - c^2 r^3 = eps r^3     (r = 1 / sqrt(c^2 + eps))
            #   outside: f'(c) = r - |c| r^2 = eps r^2     (r = 1 / (|c| + eps); 1 / eps at c = 0)
            # Autodiff of c * r forms the difference of the two nearly equal terms, a quantity of
            # order eps lost in float32 cancellation. So the value is taken as it is, without a
            # gradient, and the gradient from the closed form on a zero-valued term:
            #   y_hat = stop(c r) + (c - stop(c)) * stop(eps rho),  rho = r^3 or r^2,
            # whose value is c r exactly and whose dy_hat/dx is eps rho dc/dx: the identity for
            # the RMS kinds (n = 1), [[1, -1], [-1, 1]] / 2 for LayerNorm (n = 2), which is the
            # Jacobian of y_hat there (y_hat = (f(delta), -f(delta)), delta = (x0 - x1) / 2).
            # eps r is formed first so that no intermediate overflows for a small eps.
            slope = spec.eps * r * r
            if spec.eps_placement == "inside":
                slope = slope * r
            y = ops.stop_gradient(y) + (x - ops.stop_gradient(x)) * ops.stop_gradient(slope)
        if spec.cast == "before_scale" and dtype in _HALF:
            # y_hat is rounded to the input dtype before the affine step, but the gradient is
            # that of the exact function, as in the reference (differentiating the casts would
            # round the cotangent and use the rounded y_hat for the weights' gradient).
            rounded = self._affine(ops.cast(ops.cast(y, dtype), work), param_target, work)
            y = self._affine(y, param_target, work)
            y = y + ops.stop_gradient(rounded - y)
        else:
            y = self._affine(y, param_target, work)
        return ops.cast(y, dtype)

    def _affine(self, y: Any, target: list[int] | None, work: str) -> Any:
        """``y * (scale_offset + w) + b`` in the ``work`` dtype; the weights reshaped to
        ``target`` unless it is None."""

        def param(v: Any) -> Any:
            v = ops.cast(v, work)
            return v if target is None else ops.reshape(v, target)

        if self.scale is not None:
            g = param(self.scale)
            y = y * (g + self._spec.scale_offset if self._spec.scale_offset else g)
        if self.bias is not None:
            y = y + param(self.bias)
        return y

    def compute_output_spec(self, inputs: Any) -> keras.KerasTensor:
        dtype = self._output_dtype(inputs.dtype)
        shape = tuple(inputs.shape)
        if self.built:
            self._broadcast_shape(shape)
        else:
            self._axes(shape)
        return keras.KerasTensor(shape, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **_spec_kwargs(self._spec)}


def _spec_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The constructor arguments (JSON-compatible) of the layer that computes ``spec``."""
    kwargs: dict[str, Any] = {
        "axis": spec.axis[0] if len(spec.axis) == 1 else list(spec.axis),
        "epsilon": spec.eps,
        "eps_placement": spec.eps_placement,
        "scale": spec.scale,
        "scale_offset": spec.scale_offset,
        "bias": spec.bias,
        "cast": spec.cast,
    }
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    return kwargs


@keras.saving.register_keras_serializable(package="normkit")
class RMSNorm(_Norm):
    """RMSNorm over ``axis``: ``y = x * r(mean(x**2)) * (scale_offset + w) + b``.

    Statistics in float32; under a float32 policy the output has the input's dtype, under a
    mixed policy the compute dtype (see docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-6``.
      eps_placement: ``"inside"``: ``r(s) = 1 / sqrt(s + eps)`` (default); ``"outside"``:
        ``r(s) = 1 / (sqrt(s) + eps)``.
      scale: whether there is a weight ``w`` ("scale", the input's shape over ``axis``,
        initialized to ``1 - scale_offset``). Default ``True``.
      scale_offset: the constant added to ``w``; ``1.0`` is Gemma's ``(1 + w)``. Default ``0.0``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``False``.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` rounds once at the end (default);
        ``"before_scale"`` rounds ``y_hat`` to the input dtype before the affine step (Llama).
      **kwargs: `keras.layers.Layer` arguments: ``name``, ``dtype`` (policy), ``trainable``.

    Examples:
      >>> import numpy as np
      >>> layer = RMSNorm()
      >>> y = layer(np.array([[3.0, 4.0]], dtype="float32"))  # [3, 4] / sqrt(12.5)
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [0.8485, 1.1314]
      >>> [tuple(w.shape) for w in layer.get_weights()]
      [(2,)]
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = DEFAULT_EPS,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        **kwargs: Any,
    ) -> None:
        spec = NormSpec(
            kind="rms", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=bias, cast=cast,
        )
        super().__init__(spec, **kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class PartialRMSNorm(_Norm):
    """Partial RMSNorm over ``axis``: ``y = x * r(mean(x[:k]**2)) * (scale_offset + w) + b``.

    ``x[:k]`` are the first ``k = max(1, floor(n * p))`` of a row's ``n`` normalized elements, in
    row-major order over ``axis``; ``y`` normalizes and scales all ``n``.

    Statistics in float32; under a float32 policy the output has the input's dtype, under a
    mixed policy the compute dtype (see docs/tf.md).

    Args:
      p: the fraction read by the statistic, ``0 < p <= 1``.
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-6``.
      eps_placement: ``"inside"``: ``r(s) = 1 / sqrt(s + eps)`` (default); ``"outside"``:
        ``r(s) = 1 / (sqrt(s) + eps)``.
      scale: whether there is a weight ``w`` ("scale", the input's shape over ``axis``,
        initialized to ``1 - scale_offset``). Default ``True``.
      scale_offset: the constant added to ``w``; ``1.0`` is Gemma's ``(1 + w)``. Default ``0.0``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``False``.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` rounds once at the end (default);
        ``"before_scale"`` rounds ``y_hat`` to the input dtype before the affine step (Llama).
      **kwargs: `keras.layers.Layer` arguments: ``name``, ``dtype`` (policy), ``trainable``.
    """

    def __init__(
        self,
        p: float,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = DEFAULT_EPS,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        **kwargs: Any,
    ) -> None:
        spec = NormSpec(
            kind="partial_rms", eps=epsilon, eps_placement=eps_placement, p=p, axis=axis,
            scale=scale, scale_offset=scale_offset, bias=bias, cast=cast,
        )
        super().__init__(spec, **kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class LayerNorm(_Norm):
    """LayerNorm over ``axis``: ``y = c * r(mean(c**2)) * (scale_offset + w) + b``.

    ``c = x - mean(x)``, computed first (two-pass statistics). Keras' LayerNormalization defaults
    to ``epsilon=1e-3``: pass it to match.

    Statistics in float32; under a float32 policy the output has the input's dtype, under a
    mixed policy the compute dtype (see docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-6``.
      eps_placement: ``"inside"``: ``r(s) = 1 / sqrt(s + eps)`` (default); ``"outside"``:
        ``r(s) = 1 / (sqrt(s) + eps)``.
      scale: whether there is a weight ``w`` ("scale", the input's shape over ``axis``,
        initialized to ``1 - scale_offset``). Default ``True``.
      scale_offset: the constant added to ``w``; ``1.0`` is Gemma's ``(1 + w)``. Default ``0.0``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``True``.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` rounds once at the end (default);
        ``"before_scale"`` rounds ``y_hat`` to the input dtype before the affine step (Llama).
      **kwargs: `keras.layers.Layer` arguments: ``name``, ``dtype`` (policy), ``trainable``.
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = DEFAULT_EPS,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = True,
        cast: Cast = "after_scale",
        **kwargs: Any,
    ) -> None:
        spec = NormSpec(
            kind="layer", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=bias, cast=cast,
        )
        super().__init__(spec, **kwargs)


_LAYERS: dict[str, type[_Norm]] = {
    "rms": RMSNorm,
    "partial_rms": PartialRMSNorm,
    "layer": LayerNorm,
}


def from_spec(spec: NormSpec, **kwargs: Any) -> RMSNorm | PartialRMSNorm | LayerNorm:
    """The layer that computes ``spec``; ``kwargs`` go to `keras.layers.Layer` (name, dtype)."""
    if not isinstance(spec, NormSpec):
        raise TypeError(f"from_spec needs a normkit.NormSpec, got {type(spec).__name__}")
    spec.require_defaults("normkit.tf")
    return _LAYERS[spec.kind](**_spec_kwargs(spec), **kwargs)  # type: ignore[return-value]
