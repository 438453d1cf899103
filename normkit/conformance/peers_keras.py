"""Conformance hook for Keras' built-in norm layers on the TensorFlow backend (see `peers`).

The layers run as people call them, ``layer(x)``, their variables taking the parameters' values,
so that a mixed policy's autocasting of the variables is part of what is checked.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from normkit.bridges import FrameworkFn, TensorFlowBridge
from normkit.conformance.harness import Harness
from normkit.spec import NormSpec

LAYERS = (
    "keras.layers.RMSNormalization", "keras.layers.LayerNormalization",
    "keras.layers.LayerNormalization(rms_scaling=True)",
)
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS}


def _layer(name: str, policy: str) -> keras.layers.Layer:
    if name == "keras.layers.RMSNormalization":
        return keras.layers.RMSNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization":
        return keras.layers.LayerNormalization(dtype=policy)
    if name == "keras.layers.LayerNormalization(rms_scaling=True)":
        return keras.layers.LayerNormalization(rms_scaling=True, dtype=policy)
    raise ValueError(f"unknown Keras peer {name!r}")


def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, layer: str,
) -> FrameworkFn:
    """The built-in ``layer`` over the last axis of the input (`peer_function`)."""
    del spec, param_dtype, dtype, device  # the peer is what it is; the bridge places the arrays
    return peer_function(layer, shape[-1])


def peer_function(layer: str, n: int) -> FrameworkFn:
    """``fn(x, scale, bias)``: the built-in ``layer`` called on ``x`` with those values as its
    variables' (a `keras.StatelessScope`, so that their gradients are taken), under
    ``mixed_<dtype>`` for half inputs (float32 variables, autocast by the layer)."""
    layers: dict[str, keras.layers.Layer] = {}

    def fn(x: tf.Tensor, scale: tf.Tensor | None = None, bias: tf.Tensor | None = None) -> Any:
        policy = f"mixed_{x.dtype.name}" if x.dtype.size == 2 else "float32"
        if policy not in layers:
            layers[policy] = _layer(layer, policy)
            layers[policy].build((None, n))
        norm = layers[policy]
        given = [v for v in (scale, bias) if v is not None]
        with keras.StatelessScope(zip(norm.trainable_variables, given, strict=False)):
            return norm(x)

    return fn


_HARNESS = Harness(TensorFlowBridge(), build, VARIANTS)
devices, evaluate, identify = _HARNESS.devices, _HARNESS.evaluate, _HARNESS.identify
