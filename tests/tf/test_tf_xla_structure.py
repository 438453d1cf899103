"""A structural guard on normkit.tf under ``tf.function(jit_compile=True)``, which times nothing:
the optimized HLO of the jitted forward+backward program materializes no more input-sized
arrays than Keras' own layer's. The guards that keep unusual rows exact live in a branch the
common case skips; its intermediates must not become arrays that common case writes."""

from __future__ import annotations

import re

import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit.tf import LayerNorm, RMSNorm  # noqa: E402
from tests.helpers.keras_backend import tensorflow_backend_only  # noqa: E402

pytestmark = tensorflow_backend_only(
    "compiles the TensorFlow backend's layers with tf.function(jit_compile=True)"
)

ROWS, FEATURES = 64, 256


def _materialized_arrays(layer: keras.layers.Layer, dtype: str, backward: bool = True) -> int:
    """The number of input-sized arrays the entry computation of the jitted forward+backward
    (or forward) program produces (a conditional's or fusion's outputs; parameters and tuples
    not counted)."""
    x = tf.cast(tf.random.normal((ROWS, FEATURES)), dtype)
    dy = tf.cast(tf.random.normal((ROWS, FEATURES)), dtype)
    layer(x)

    @tf.function(jit_compile=True)
    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return y, tape.gradient(y, [x, *layer.trainable_variables], output_gradients=dy)

    program = forward_backward if backward else tf.function(layer, jit_compile=True)
    hlo = program.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    entry = hlo[hlo.index("\nENTRY"):]
    count = 0
    for line in entry.splitlines()[1:]:
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (\S+)\(", line)
        if match is None or match.group(2) in ("parameter", "tuple", "get-tuple-element"):
            continue
        count += len(re.findall(rf"\[{ROWS},{FEATURES}\]", match.group(1)))
    return count


RMS = (RMSNorm, keras.layers.RMSNormalization)
LAYER = (LayerNorm, keras.layers.LayerNormalization)


@pytest.mark.parametrize(
    "ours, theirs, dtype",
    [
        (*RMS, "float32"),
        (*RMS, "bfloat16"),
        (*LAYER, "float32"),
        (*LAYER, "bfloat16"),
    ],
    ids=["RMSNorm-float32", "RMSNorm-bfloat16", "LayerNorm-float32", "LayerNorm-bfloat16"],
)
def test_jitted_forward_backward_materializes_no_more_arrays_than_keras(ours, theirs, dtype):
    policy = "float32" if dtype == "float32" else "mixed_bfloat16"
    mine = _materialized_arrays(ours(dtype=policy), dtype)
    keras_own = _materialized_arrays(theirs(dtype=policy), dtype)
    assert mine <= keras_own, f"{mine} input-sized arrays, Keras' layer {keras_own}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ours, theirs", [RMS, LAYER], ids=["RMSNorm", "LayerNorm"])
def test_jitted_forward_materializes_no_more_arrays_than_keras(ours, theirs, dtype):
    """The plain branch casts a half input itself, inside the fused pass: no float32 copy of x
    crosses into it (RMSNorm's gradient still meets Keras' autodiff at that copy)."""
    policy = "float32" if dtype == "float32" else "mixed_bfloat16"
    mine = _materialized_arrays(ours(dtype=policy), dtype, backward=False)
    keras_own = _materialized_arrays(theirs(dtype=policy), dtype, backward=False)
    assert mine <= keras_own, f"{mine} input-sized arrays, Keras' layer {keras_own}"


def test_xla_tracing_is_told_from_graph_tracing():
    """RMSNorm keeps Keras' autodiff order (bit-identical training) in graphs XLA does not
    compile, and takes the closed-form gradient in a recomputed branch in those it does."""
    from normkit.tf._host import traced_for_xla

    seen = {}

    def probe(tag):
        def body():
            seen[tag] = traced_for_xla(tf.constant(0.0))
            return tf.constant(0.0)

        return body

    tf.function(probe("xla"), jit_compile=True)()
    tf.function(probe("graph"), jit_compile=False)()
    probe("eager")()
    assert seen == {"xla": True, "graph": False, "eager": False}
