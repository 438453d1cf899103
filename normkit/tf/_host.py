"""Where a layer's call runs and what is known there: eagerly or traced, traced for XLA, whether
a gradient may be taken, and the values of row-sized tensors read on the host.

The layers choose their program by these: an eager call branches in Python on values it reads
now, a traced one builds both branches of a ``cond``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

__all__ = ["eagerly", "known", "on_host", "recording", "traced_for_xla"]


def eagerly(value: Any) -> bool:
    """Whether ``value``, a tensor of this call, is known now (eager execution), not traced.

    On JAX, ``jax.grad`` or ``jax.vjp`` without ``jit`` wraps concrete arrays in tracers: their
    values are known (`on_host` reads them), and a ``cond`` there would be compiled anew on
    every call."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.executing_eagerly())
    if backend == "jax":
        import jax

        return not isinstance(_without_tangent(value), jax.core.Tracer)
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return True


def _without_tangent(value: Any) -> Any:
    """On JAX, the array under autodiff's tracer of ``value`` (concrete outside ``jit``);
    ``value`` itself elsewhere, or where it is no tracer."""
    if keras.backend.backend() != "jax":
        return value
    import jax

    return jax.lax.stop_gradient(value) if isinstance(value, jax.core.Tracer) else value


def on_host(value: Any) -> np.ndarray:
    """``value``, known now (`eagerly`), as a numpy array."""
    return np.asarray(ops.convert_to_numpy(_without_tangent(value)))


def known(flag: Any) -> bool | None:
    """The value of a boolean scalar tensor when it is known now (eager), None while tracing:
    eager calls branch in Python, which spares JAX compiling both branches of a `cond`."""
    return bool(on_host(flag)) if eagerly(flag) else None


def recording(*inputs: Any) -> bool:
    """Whether a gradient may be taken through this call's ops on ``inputs`` (the input and the
    weights): always while tracing and on the torch backend; eagerly on TensorFlow, whether a
    GradientTape records; on JAX, whether one of them is a tracer (of autodiff, or of a ``jit``
    a gradient may be taken through). Without one the custom gradients are left out (their
    wrapper costs as much as the whole forward on one token's row)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return any(isinstance(v, jax.core.Tracer) for v in inputs)
    if backend != "tensorflow":
        return True
    import tensorflow as tf
    from tensorflow.python.eager import record

    return not tf.executing_eagerly() or bool(record.could_possibly_record())


def traced_for_xla(x: Any) -> bool:
    """Whether the call on ``x`` is traced for XLA, where the output's bits are XLA's fusions'
    anyway: by TensorFlow (``tf.function(jit_compile=True)``, or Keras' ``jit_compile`` on a
    GPU), or by JAX (``jax.jit``: ``x`` is traced beyond autodiff, `eagerly`)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return not eagerly(x)
    if backend != "tensorflow":
        return False
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))
