"""normkit.tf against Keras' own layers on the TensorFlow backend, eager and XLA-compiled.

``python -m normkit.bench.tf [--quick] [--device D] [--dtype T]`` prints the table;
`normkit.bench.core.run` of this module returns the rows in `normkit.bench`'s schema. Every group
also times ``x * 1`` over the same bytes, eager (the copy floor: ``tf.identity`` moves nothing, and
XLA would fold a multiply by one). Layers run under the dtype policy of the input: ``float32``,
``mixed_bfloat16`` or ``mixed_float16``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from normkit.bench.core import EPS, Group, Sweep, backend_main, plan_groups, time_group
from normkit.bridges import TensorFlowBridge
from normkit.tf.layers import LayerNorm, RMSNorm

__all__ = ["measure", "plan", "versions"]

EAGER, XLA = "eager", "tf.function(jit_compile=True)"
_BRIDGE = TensorFlowBridge()
devices = _BRIDGE.devices
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


def _task(
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


def _check_backend() -> None:
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "normkit.bench.tf measures the TensorFlow backend; KERAS_BACKEND is "
            f"{keras.backend.backend()!r}"
        )


def versions() -> dict[str, str]:
    """The versions this benchmark ran with."""
    import tensorflow as tf

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def plan(sweep: Sweep) -> list[Group]:
    """Every device x dtype x shape x pass, eager and XLA."""
    _check_backend()
    return plan_groups("tf", sweep, devices(), lambda *_: (EAGER, XLA))


def measure(group: Group, sweep: Sweep) -> list[dict[str, Any]]:
    """Time one group: the four layers, interleaved with ``x * 1`` over the same bytes."""
    _check_backend()
    import tensorflow as tf

    rng = np.random.default_rng(0)
    on_gpu = group.device != "cpu"
    name = _BRIDGE.device(group.device).lstrip("/")
    with tf.device(f"/{name}"):
        x = tf.cast(tf.constant(rng.standard_normal(group.shape, dtype=np.float32)), group.dtype)
        dy = tf.cast(tf.constant(rng.standard_normal(group.shape, dtype=np.float32)), group.dtype)
        buffer = tf.cast(
            tf.constant(rng.standard_normal(group.copy_elements, dtype=np.float32)), group.dtype
        )
        layers = _layers(POLICY[group.dtype])
        for layer in layers.values():
            layer.build(group.shape)
        candidates = {
            k: _task(layer, x, dy, group.backward, group.mode == XLA) for k, layer in layers.items()
        }
        sync = tf.test.experimental.sync_devices if on_gpu else None
        rows = time_group(group, sweep, candidates, ("copy (x * 1)", lambda: buffer * 1), sync=sync)
        if on_gpu:
            for row in rows:
                fn = candidates.get(row["implementation"], lambda: buffer * 1)
                tf.test.experimental.sync_devices()
                tf.config.experimental.reset_memory_stats(name)
                before = tf.config.experimental.get_memory_info(name)["current"]
                fn()
                tf.test.experimental.sync_devices()
                row["peak_memory_bytes"] = (
                    tf.config.experimental.get_memory_info(name)["peak"] - before
                )
    return rows


if __name__ == "__main__":
    backend_main(sys.modules[__name__])
