"""A structural guard on normkit.tf's eager cost, which times nothing: the number of TensorFlow
ops one eager call executes, forward and forward+backward, is at most that of Keras' own layer
plus a stated constant. The guards that keep rows far from unit scale exact must cost per row
(a judgement of row-sized statistics and one branch), not ops on every call."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402
from tensorflow.python.framework import op_callbacks  # noqa: E402

from normkit.tf import LayerNorm, RMSNorm  # noqa: E402
from tests.helpers.keras_backend import tensorflow_backend_only  # noqa: E402

pytestmark = tensorflow_backend_only(
    "counts the TensorFlow ops of the TensorFlow backend's eager calls"
)

# The most ops normkit's call may execute beyond Keras' own layer's: none. Eagerly the rows are
# judged on the host from their statistics, so no guard op runs on the device (each costs as
# much as the whole pass on one token's row); the backward's closed forms take fewer ops than
# autodiff's.
FORWARD_EXTRA = 0
FORWARD_BACKWARD_EXTRA = 0


def _executed_ops(run, size: int | None = None) -> int:
    """The number of ops `run` executes eagerly (after one call that builds the layer); with
    ``size``, only those reading a tensor of that many elements (whole-tensor passes), not
    counting ``Identity`` and ``StopGradient`` (TensorFlow's identity kernel: the input's
    buffer passed on)."""
    run()
    executed = []

    def count(op_type, inputs, *args, **kwargs):
        if size is None or (
            op_type not in ("Identity", "StopGradient") and any(t.shape.num_elements() == size for t in inputs)
        ):
            executed.append(op_type)

    op_callbacks.add_op_callback(count)
    try:
        run()
    finally:
        op_callbacks.remove_op_callback(count)
    return len(executed)


def _forward(layer, x):
    return lambda: layer(x)


def _forward_backward(layer, x):
    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_variables], output_gradients=tf.ones_like(y))

    return run


@pytest.mark.parametrize(
    "ours, theirs",
    [(lambda: RMSNorm(), keras.layers.RMSNormalization),
     (lambda: LayerNorm(), keras.layers.LayerNormalization)],
    ids=["RMSNorm", "LayerNorm"],
)
@pytest.mark.parametrize(
    "task, extra",
    [(_forward, FORWARD_EXTRA), (_forward_backward, FORWARD_BACKWARD_EXTRA)],
    ids=["forward", "forward+backward"],
)
def test_eager_call_executes_at_most_a_constant_more_ops_than_keras(ours, theirs, task, extra):
    x = tf.random.normal((8, 64))
    mine, keras_own = _executed_ops(task(ours(), x)), _executed_ops(task(theirs(), x))
    assert mine <= keras_own + extra, f"{mine} ops, Keras' layer {keras_own} (+{extra} allowed)"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize(
    "ours, theirs",
    [(RMSNorm, keras.layers.RMSNormalization), (LayerNorm, keras.layers.LayerNormalization)],
    ids=["RMSNorm", "LayerNorm"],
)
@pytest.mark.parametrize("task", [_forward, _forward_backward], ids=["forward", "forward+backward"])
def test_eager_call_makes_no_more_whole_tensor_passes_than_keras(ours, theirs, task, policy):
    """The per-row guards add ops on row-sized tensors only; a half input is cast once."""
    x = tf.cast(tf.random.normal((8, 64)), "bfloat16" if policy != "float32" else "float32")
    mine = _executed_ops(task(ours(dtype=policy), x), x.shape.num_elements())
    keras_own = _executed_ops(task(theirs(dtype=policy), x), x.shape.num_elements())
    assert mine <= keras_own, f"{mine} whole-tensor ops, Keras' layer {keras_own}"
