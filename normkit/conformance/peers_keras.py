"""Conformance hook for Keras' built-in norm layers on the TensorFlow backend (see `peers`)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from normkit import dtypes
from normkit.spec import NormSpec

__all__ = ["devices", "evaluate"]


def devices() -> list[str]:
    """``"cpu"``, then ``"gpu:i"`` for each GPU TensorFlow sees."""
    return ["cpu"] + [f"gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]


def _layer(name: str, policy: str) -> keras.layers.Layer:
    if name == "keras.layers.RMSNormalization":
        return keras.layers.RMSNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization":
        return keras.layers.LayerNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization(rms_scaling=True)":
        try:
            return keras.layers.LayerNormalization(rms_scaling=True, dtype=policy)
        except TypeError as exc:
            raise NotImplementedError(f"Keras {keras.__version__} has no rms_scaling option: {exc}") from exc
    raise ValueError(f"unknown Keras peer {name!r}")


def _numpy(t: tf.Tensor) -> np.ndarray:
    # float32 holds every half value exactly; cast back to the tensor's own dtype
    return tf.cast(t, tf.float32).numpy().astype(dtypes.as_float_dtype(t.dtype.name))


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    layer: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dscale, dbias)`` of the built-in ``layer``; half inputs under ``mixed_<dtype>``."""
    policy = f"mixed_{x.dtype.name}" if dtypes.is_half(x.dtype) else "float32"
    with tf.device(device):
        norm = _layer(layer, policy)
        xt = tf.cast(tf.constant(x.astype(np.float32)), x.dtype.name)
        norm.build(x.shape)
        norm.set_weights([np.asarray(v, np.float32) for v in (scale, bias) if v is not None][: len(norm.weights)])
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = norm(xt)
        dyt = tf.cast(tf.constant(dy.astype(np.float32)), y.dtype)
        dx, *grads = tape.gradient(y, [xt, *norm.trainable_weights], output_gradients=dyt)
    found = iter(_numpy(g) for g in grads)
    return _numpy(y), _numpy(dx), next(found) if scale is not None else None, next(found) if bias is not None else None
