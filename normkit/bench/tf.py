"""normkit.tf against Keras' own layers, eager and compiled, on the Keras backend in use.

On TensorFlow (``KERAS_BACKEND=tensorflow``) the modes are eager and
``tf.function(jit_compile=True)``, and every group also times ``x * 1`` over the same bytes,
eager (the copy floor: ``tf.identity`` moves nothing, and XLA would fold a multiply by one). On
JAX (``KERAS_BACKEND=jax``, timed by `normkit.bench.run` in a worker of its own) the layers run
statelessly (``stateless_call``, as Keras' JAX trainer calls them), each op dispatched by JAX
(`JAX_EAGER`) or the whole call jitted (`JAX_JIT`), beside a jitted ``jnp.copy``.
Forward+backward takes the gradients of ``x`` and the weights given ``dy``. The bench waits
for a call's work with ``jax.block_until_ready`` on JAX, and on a TensorFlow GPU with
``tf.test.experimental.sync_devices`` (TensorFlow computes a CPU call before it returns): after
each call (latency) or after the last of a throughput sample. Layers run under
the dtype policy of the input: ``float32``, ``mixed_bfloat16`` or ``mixed_float16``.

``python -m normkit.bench.tf [--quick] [--device D] [--dtype T]`` prints the table;
`normkit.bench.core.run` of this module returns the rows in `normkit.bench`'s schema.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from normkit.bench.core import (
    EPS,
    KERAS_JAX_MODES,
    Group,
    Sweep,
    backend_main,
    plan_groups,
    time_group,
)
from normkit.bridges import JaxBridge, TensorFlowBridge
from normkit.tf.layers import LayerNorm, RMSNorm

__all__ = ["devices", "measure", "plan", "versions"]

EAGER, XLA = "eager", "tf.function(jit_compile=True)"
JAX_EAGER, JAX_JIT = KERAS_JAX_MODES
KERAS_BACKENDS = ("tensorflow", "jax")
POLICY = {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


def _layers(policy: str) -> dict[str, keras.layers.Layer]:
    return {
        "normkit.tf.RMSNorm": RMSNorm(epsilon=EPS, dtype=policy),
        "keras.layers.RMSNormalization": keras.layers.RMSNormalization(epsilon=EPS, dtype=policy),
        "normkit.tf.LayerNorm": LayerNorm(epsilon=EPS, dtype=policy),
        "keras.layers.LayerNormalization": keras.layers.LayerNormalization(
            epsilon=EPS, dtype=policy
        ),
    }


def _tf_task(
    layer: keras.layers.Layer, x: Any, dy: Any, backward: bool, jit: bool
) -> Callable[[], object]:
    import tensorflow as tf

    def forward(x: Any) -> Any:
        return layer(x)

    def forward_backward(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_variables], output_gradients=dy)

    fn = forward_backward if backward else forward
    if jit:
        fn = tf.function(fn, jit_compile=True)
    return lambda: fn(x)


def _jax_task(
    layer: keras.layers.Layer, x: Any, dy: Any, backward: bool, jit: bool
) -> Callable[[], object]:
    import jax

    weights = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def forward(weights: Any, x: Any) -> Any:
        return layer.stateless_call(weights, frozen, x)[0]

    def forward_backward(weights: Any, x: Any) -> Any:
        y, pullback = jax.vjp(forward, weights, x)
        return y, pullback(dy)

    fn = forward_backward if backward else forward
    if jit:
        fn = jax.jit(fn)
    return lambda: fn(weights, x)


def _keras_backend() -> str:
    backend = keras.backend.backend()
    if backend not in KERAS_BACKENDS:
        raise RuntimeError(
            f"normkit.bench.tf measures Keras' backends {list(KERAS_BACKENDS)}; KERAS_BACKEND is "
            f"{backend!r}"
        )
    return backend


def devices() -> list[str]:
    """The devices the Keras backend in use sees (`normkit.backends` names)."""
    bridge = TensorFlowBridge() if _keras_backend() == "tensorflow" else JaxBridge()
    return bridge.devices()


def versions() -> dict[str, str]:
    """The versions this benchmark ran with: Keras and its backend's framework."""
    if _keras_backend() == "jax":
        import jax

        return {"jax": jax.__version__, "keras": keras.__version__}
    import tensorflow as tf

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def plan(sweep: Sweep) -> list[Group]:
    """Every device x dtype x shape x pass, eager and compiled."""
    modes = (EAGER, XLA) if _keras_backend() == "tensorflow" else (JAX_EAGER, JAX_JIT)
    return plan_groups("tf", sweep, devices(), lambda *_: modes)


def _layers_built(dtype: str, shape: tuple[int, int]) -> dict[str, keras.layers.Layer]:
    layers = _layers(POLICY[dtype])
    for layer in layers.values():
        layer.build(shape)
    return layers


def measure(group: Group, sweep: Sweep) -> list[dict[str, Any]]:
    """Time one group: the four layers, interleaved with a copy of the same bytes."""
    if _keras_backend() == "jax":
        return _measure_jax(group, sweep)
    import tensorflow as tf

    rng = np.random.default_rng(0)
    on_gpu = group.device != "cpu"
    name = TensorFlowBridge().device(group.device).lstrip("/")
    with tf.device(f"/{name}"):
        x = tf.cast(tf.constant(rng.standard_normal(group.shape, dtype=np.float32)), group.dtype)
        dy = tf.cast(tf.constant(rng.standard_normal(group.shape, dtype=np.float32)), group.dtype)
        buffer = tf.cast(
            tf.constant(rng.standard_normal(group.copy_elements, dtype=np.float32)), group.dtype
        )
        candidates = {
            k: _tf_task(layer, x, dy, group.backward, group.mode == XLA)
            for k, layer in _layers_built(group.dtype, group.shape).items()
        }
        wait = (lambda _: tf.test.experimental.sync_devices()) if on_gpu else None
        copy = ("copy (x * 1)", lambda: buffer * 1)
        rows = time_group(group, sweep, candidates, copy, wait=wait)
        if on_gpu:
            peaks = {k: _peak_bytes(fn, name) for k, fn in {**candidates, copy[0]: copy[1]}.items()}
            for row in rows:
                row["peak_memory_bytes"] = peaks[row["implementation"]]
    return rows


def _peak_bytes(fn: Callable[[], object], name: str) -> int:
    """TensorFlow's peak memory on device ``name`` during one call, above what it held before."""
    import tensorflow as tf

    tf.test.experimental.sync_devices()
    tf.config.experimental.reset_memory_stats(name)
    before = tf.config.experimental.get_memory_info(name)["current"]
    fn()
    tf.test.experimental.sync_devices()
    return int(tf.config.experimental.get_memory_info(name)["peak"] - before)


def _measure_jax(group: Group, sweep: Sweep) -> list[dict[str, Any]]:
    """`measure` on Keras' JAX backend: the arrays on the group's device, a jitted copy."""
    from normkit.bench.jax_timing import time_on_jax

    def tasks(x: Any, dy: Any) -> dict[str, Callable[[], object]]:
        return {
            k: _jax_task(layer, x, dy, group.backward, group.mode == JAX_JIT)
            for k, layer in _layers_built(group.dtype, group.shape).items()
        }

    return time_on_jax(group, sweep, JaxBridge().device(group.device), tasks)


if __name__ == "__main__":
    backend_main(sys.modules[__name__])
