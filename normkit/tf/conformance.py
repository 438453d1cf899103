"""The conformance hook: run a `normkit.tf` layer forward and backward on numpy inputs.

It runs on the current Keras backend (`keras_backend`); the cross-framework runner starts one
process per ``KERAS_BACKEND``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from normkit import reference
from normkit.backends import Bridge, device_index, device_name
from normkit.bridges import JaxBridge, TensorFlowBridge, TorchBridge
from normkit.conformance.targets import check_variant
from normkit.spec import NormSpec
from normkit.tf.layers import from_spec

__all__ = ["VARIANTS", "devices", "evaluate", "keras_backend"]

VARIANTS: dict[str, tuple[object, ...] | None] = {"jit": (True, False), "policy": None}
_BRIDGES: dict[str, Bridge] = {
    "tensorflow": TensorFlowBridge(), "jax": JaxBridge(), "torch": TorchBridge(),
}


def keras_backend() -> str:
    """The Keras backend in use: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.backend.backend()


def _bridge() -> Bridge:
    """The bridge of the framework under the current Keras backend."""
    backend = keras_backend()
    if backend not in _BRIDGES:
        raise RuntimeError(
            f"normkit.tf supports the tensorflow, jax and torch Keras backends, not {backend!r}"
        )
    return _BRIDGES[backend]


def devices() -> list[str]:
    """The devices the current backend sees: ``"cpu"``, then ``"cuda:0"``, ``"cuda:1"``, ..."""
    return [d for d in _bridge().devices() if d == "cpu" or d.startswith("cuda:")]


def _keras_device(name: str) -> str:
    """Keras' name for a normkit device name: ``cpu:0``, ``gpu:N``."""
    kind, index = device_index(name)
    return f"{'gpu' if kind == 'cuda' else kind}:{index}"


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
      device: one of `devices()` (``gpu:N`` is read as ``cuda:N``).
      **variant: ``jit=True`` runs under ``tf.function(jit_compile=True)`` (TensorFlow) or
        ``jax.jit`` (JAX); the torch backend has no jit variant. ``policy=`` a Keras dtype policy
        name; under a float16/bfloat16 compute dtype ``x`` is cast to it first, and the outputs
        are in it.

    Returns numpy arrays in the dtypes the backend produced, None for weights the spec lacks.
    """
    check_variant(variant, VARIANTS)
    device = device_name(device)
    if device not in devices():
        raise ValueError(
            f"device {device!r} is not seen by the {keras_backend()} backend: {devices()}"
        )
    jit = bool(variant.get("jit", False))
    backend = keras_backend()
    if backend == "jax" and np.asarray(x).dtype == np.float64:
        import jax

        if not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
            raise TypeError("x has dtype float64, which JAX computes only with JAX_ENABLE_X64=1")
    if jit and backend == "torch":
        raise ValueError("the torch Keras backend has no jit variant (jit=True)")
    if np.shape(dy) != np.shape(x):
        raise ValueError(f"dy has shape {np.shape(dy)}, expected the shape of x, {np.shape(x)}")
    reference.check_params(np.shape(x), spec, scale, bias)
    params64 = any(v is not None and np.asarray(v).dtype == np.float64 for v in (scale, bias))
    policy = variant.get("policy") or ("float64" if params64 else "float32")

    framework = _bridge()
    with keras.device(_keras_device(device)):
        layer = from_spec(spec, dtype=policy)
        xt, dyt = (framework.to_tensor(np.asarray(a), device) for a in (x, dy))
        layer.build(tuple(xt.shape))
        for variable, value in ((layer.scale, scale), (layer.bias, bias)):
            if value is not None:
                assert variable is not None  # check_params: the spec has this parameter
                variable.assign(np.asarray(value, dtype=np.float64).astype(variable.dtype))
        if backend == "tensorflow":
            y, dx, grads = _vjp_tensorflow(layer, xt, dyt, jit)
        elif backend == "jax":
            y, dx, grads = _vjp_jax(layer, xt, dyt, jit)
        else:
            y, dx, grads = _vjp_torch(layer, xt, dyt)
    found = iter(framework.to_numpy(g) for g in grads)
    dscale = next(found) if spec.scale else None
    dbias = next(found) if spec.bias else None
    return framework.to_numpy(y), framework.to_numpy(dx), dscale, dbias


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
