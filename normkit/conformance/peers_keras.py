"""Conformance hook for Keras' built-in norm layers on the TensorFlow backend (see `peers`).

The layers run as people call them, ``layer(x)`` with their own variables, so that a mixed
policy's autocasting of the variables is part of what is checked.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from normkit import dtypes
from normkit.backends import FrameworkFn, Outputs
from normkit.bridges import TensorFlowBridge
from normkit.conformance.peers import refuse_extras
from normkit.conformance.targets import check_variant
from normkit.identify import Identification
from normkit.identify import identify as identify_fn
from normkit.spec import NormSpec

LAYERS = (
    "keras.layers.RMSNormalization", "keras.layers.LayerNormalization",
    "keras.layers.LayerNormalization(rms_scaling=True)",
)
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS}
BRIDGE = TensorFlowBridge()
devices = BRIDGE.devices


def _layer(name: str, policy: str) -> keras.layers.Layer:
    if name == "keras.layers.RMSNormalization":
        return keras.layers.RMSNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization":
        return keras.layers.LayerNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization(rms_scaling=True)":
        return keras.layers.LayerNormalization(rms_scaling=True, dtype=policy)
    raise ValueError(f"unknown Keras peer {name!r}")


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    residual: np.ndarray | None = None,
    dh: np.ndarray | None = None,
    alpha: np.ndarray | None = None,
    device: str = "cpu",
    **variant: Any,
) -> Outputs:
    """``(y, dx, dscale, dbias)`` of the built-in ``layer``; half inputs under ``mixed_<dtype>``."""
    check_variant(variant, VARIANTS)
    refuse_extras(residual, dh, alpha)
    layer = str(variant["layer"])
    with tf.device(BRIDGE.device(device)):
        norm = _layer(layer, f"mixed_{x.dtype.name}" if dtypes.is_half(x.dtype) else "float32")
        norm.build(x.shape)
        norm.set_weights(
            [np.asarray(w, np.float32) for w in (scale, bias) if w is not None][: len(norm.weights)]
        )
        xt, dyt = BRIDGE.to_tensor(x, device), BRIDGE.to_tensor(dy, device)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = norm(xt)
        dx, *grads = tape.gradient(
            y, [xt, *norm.trainable_weights], output_gradients=tf.cast(dyt, y.dtype)
        )
    found = iter(BRIDGE.to_numpy(g) for g in grads)
    dscale = next(found) if scale is not None else None
    dbias = next(found) if bias is not None else None
    return BRIDGE.to_numpy(y), BRIDGE.to_numpy(dx), dscale, dbias


def peer_function(layer: str, n: int) -> FrameworkFn:
    """``fn(x, scale, bias)``: the built-in ``layer`` called on ``x`` after its variables are set,
    under ``mixed_<dtype>`` for half inputs (forward only)."""
    layers: dict[str, keras.layers.Layer] = {}

    def fn(x: tf.Tensor, scale: tf.Tensor | None, bias: tf.Tensor | None) -> tf.Tensor:
        policy = f"mixed_{x.dtype.name}" if x.dtype.size == 2 else "float32"
        if policy not in layers:
            layers[policy] = _layer(layer, policy)
            layers[policy].build((None, n))
        norm = layers[policy]
        for variable, value in zip(
            norm.trainable_variables, (v for v in (scale, bias) if v is not None), strict=False
        ):
            variable.assign(tf.cast(value, variable.dtype))
        return norm(x)

    return fn


def identify(*, layer: str, n: int = 64, device: str = "cpu") -> Identification:
    """What the built-in ``layer`` computes, probed with float32 variables."""
    return identify_fn(peer_function(layer, n), (n,), backend="tf", params=True, device=device)
