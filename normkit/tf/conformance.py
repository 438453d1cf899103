"""The conformance hook: run a `normkit.tf` layer forward and backward on numpy inputs.

It runs on the current Keras backend (`keras_backend`); the cross-framework runner starts one
process per ``KERAS_BACKEND``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from normkit import dtypes, reference
from normkit.spec import NormSpec
from normkit.tf.layers import from_spec

__all__ = ["devices", "evaluate", "keras_backend"]

_VARIANTS = ("jit", "policy")


def keras_backend() -> str:
    """The Keras backend in use: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.backend.backend()


def devices() -> list[str]:
    """The devices the current backend sees: ``"cpu"``, then ``"gpu:0"``, ``"gpu:1"``, ..."""
    backend = keras_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = len(tf.config.list_physical_devices("GPU"))
    elif backend == "jax":
        import jax

        gpus = sum(d.platform == "gpu" for d in jax.devices())
    elif backend == "torch":
        import torch

        gpus = torch.cuda.device_count()
    else:
        raise RuntimeError(
            f"normkit.tf supports the tensorflow, jax and torch Keras backends, not {backend!r}"
        )
    return ["cpu"] + [f"gpu:{i}" for i in range(gpus)]


def _to_numpy(t: Any) -> np.ndarray:
    dtype = dtypes.as_float_dtype(keras.backend.standardize_dtype(t.dtype))
    return np.asarray(ops.convert_to_numpy(t)).astype(dtype)


def _to_tensor(a: np.ndarray) -> Any:
    # torch cannot read a numpy bfloat16 array; float32 holds every half value exactly.
    dtype = dtypes.as_float_dtype(a.dtype, "x")
    exact = a.astype(np.float32) if dtypes.is_half(dtype) else a
    return ops.cast(ops.convert_to_tensor(exact), dtype.name)


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dscale, dbias)`` of ``from_spec(spec)`` at ``x`` with cotangent ``dy``.

    Args:
      spec: the norm.
      x: the input, float16, bfloat16, float32 or float64.
      dy: the cotangent of the output, of ``x``'s shape (cast to the output's dtype).
      scale, bias: the weights ``w`` and ``b`` (None: their initial values). Their dtype picks the
        variables': float64 gives the ``"float64"`` policy, anything else float32 variables
        (float16 and bfloat16 values are exact there), so ``dscale``/``dbias`` are float32.
      device: one of `devices()`.
      **variant: ``jit=True`` runs under ``tf.function(jit_compile=True)`` (TensorFlow) or
        ``jax.jit`` (JAX); the torch backend has no jit variant. ``policy=`` a Keras dtype policy
        name; under a float16/bfloat16 compute dtype ``x`` is cast to it first, and the outputs
        are in it.

    Returns numpy arrays in the dtypes the backend produced, None for weights the spec lacks.
    """
    unknown = sorted(set(variant) - set(_VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant options {unknown}; allowed: {list(_VARIANTS)}")
    if device not in devices():
        raise ValueError(
            f"device {device!r} is not seen by the {keras_backend()} backend: {devices()}"
        )
    jit = bool(variant.get("jit", False))
    backend = keras_backend()
    if backend == "jax" and np.asarray(x).dtype == np.float64:
        import jax

        if not jax.config.jax_enable_x64:
            raise TypeError("x has dtype float64, which JAX computes only with JAX_ENABLE_X64=1")
    if jit and backend == "torch":
        raise ValueError("the torch Keras backend has no jit variant (jit=True)")
    if np.shape(dy) != np.shape(x):
        raise ValueError(f"dy has shape {np.shape(dy)}, expected the shape of x, {np.shape(x)}")
    reference.check_params(np.shape(x), spec, scale, bias)
    params64 = any(v is not None and np.asarray(v).dtype == np.float64 for v in (scale, bias))
    policy = variant.get("policy") or ("float64" if params64 else "float32")

    with keras.device(device if ":" in device else f"{device}:0"):
        layer = from_spec(spec, dtype=policy)
        xt, dyt = _to_tensor(np.asarray(x)), _to_tensor(np.asarray(dy))
        layer.build(tuple(xt.shape))
        if scale is not None:
            layer.scale.assign(np.asarray(scale, dtype=np.float64).astype(layer.scale.dtype))
        if bias is not None:
            layer.bias.assign(np.asarray(bias, dtype=np.float64).astype(layer.bias.dtype))
        if backend == "tensorflow":
            y, dx, grads = _vjp_tensorflow(layer, xt, dyt, jit)
        elif backend == "jax":
            y, dx, grads = _vjp_jax(layer, xt, dyt, jit)
        else:
            y, dx, grads = _vjp_torch(layer, xt, dyt)
    found = iter(_to_numpy(g) for g in grads)
    dscale = next(found) if spec.scale else None
    dbias = next(found) if spec.bias else None
    return _to_numpy(y), _to_numpy(dx), dscale, dbias


def _vjp_tensorflow(layer: Any, x: Any, dy: Any, jit: bool) -> tuple[Any, Any, list[Any]]:
    import tensorflow as tf

    def vjp(x: Any, dy: Any) -> tuple[Any, Any, list[Any]]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        dy = tf.cast(dy, y.dtype)
        dx, *grads = tape.gradient(y, [x, *layer.trainable_variables], output_gradients=dy)
        return y, dx, grads

    return (tf.function(vjp, jit_compile=True) if jit else vjp)(x, dy)


def _vjp_jax(layer: Any, x: Any, dy: Any, jit: bool) -> tuple[Any, Any, list[Any]]:
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def vjp(trainable: list[Any], x: Any, dy: Any) -> tuple[Any, Any, list[Any]]:
        y, pullback = jax.vjp(lambda t, x: layer.stateless_call(t, frozen, x)[0], trainable, x)
        grads, dx = pullback(dy.astype(y.dtype))
        return y, dx, grads

    return (jax.jit(vjp) if jit else vjp)(trainable, x, dy)


def _vjp_torch(layer: Any, x: Any, dy: Any) -> tuple[Any, Any, list[Any]]:
    import torch

    x = x.detach().requires_grad_(True)
    trainable = [v.value.detach().clone().requires_grad_(True) for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]
    y = layer.stateless_call(trainable, frozen, x)[0]
    dx, *grads = torch.autograd.grad(y, [x, *trainable], dy.to(y.dtype))
    return y.detach(), dx, grads
