"""What normkit.tf says to its user: in ``model.fit`` nothing that Keras' own layers do not
(issue 51: a tape's warning of a watched boolean, twice per fit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit.tf import DyT, LayerNorm, PartialRMSNorm, RMSNorm  # noqa: E402
from tests.helpers.keras_backend import tensorflow_backend_only  # noqa: E402

pytestmark = tensorflow_backend_only("TensorFlow's log is TensorFlow's")


def _fit_log(layer: keras.layers.Layer, jit_compile: bool | str) -> list[str]:
    """The messages TensorFlow logs (warnings and above) while a small model around ``layer``
    is fitted, evaluated and asked to predict."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype("float32")
    y = rng.standard_normal((32, 4)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), layer,
                              keras.layers.Dense(4)])
    model.compile("adam", "mse", jit_compile=jit_compile)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        model.fit(x, y, epochs=2, batch_size=16, verbose=0)
        model.evaluate(x, y, verbose=0)
        model.predict(x, verbose=0)
    finally:
        logger.removeHandler(handler)
    # TensorFlow's note that its functions were traced again: the tests build model after model.
    messages = [r.getMessage() for r in records]
    return [m for m in messages if "triggered tf.function retracing" not in m]


@pytest.mark.parametrize("jit_compile", ["auto", True], ids=["auto", "xla"])
@pytest.mark.parametrize(
    "make, keras_layer",
    [
        (LayerNorm, keras.layers.LayerNormalization),
        (lambda: LayerNorm(group_size=4), keras.layers.LayerNormalization),
        (lambda: PartialRMSNorm(0.5), keras.layers.RMSNormalization),
        (RMSNorm, keras.layers.RMSNormalization),
        (DyT, keras.layers.LayerNormalization),
    ],
    ids=["layer", "layer-groups", "partial_rms", "rms", "dyt"],
)
def test_model_fit_logs_nothing_kerass_own_layer_does_not(make, keras_layer, jit_compile):
    """The guarded program's recomputed branch watched every argument of the plain branch,
    the rows' boolean marks too: "The dtype of the watched tensor must be floating ... got
    tf.bool", twice per fit."""
    theirs = set(_fit_log(keras_layer(), jit_compile))
    ours = _fit_log(make(), jit_compile)
    assert [m for m in ours if m not in theirs] == []
