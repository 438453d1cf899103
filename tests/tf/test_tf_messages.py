"""What normkit.tf says to its user: in ``model.fit`` nothing that Keras' own layers do not
(issue 51: a tape's warning of a watched boolean, twice per fit)."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm  # noqa: E402
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


@functools.cache
def _kerass_log(name: str, jit_compile: bool | str) -> frozenset[str]:
    return frozenset(_fit_log(getattr(keras.layers, name)(), jit_compile))


@pytest.mark.parametrize(
    "make, kerass, jit_compile",
    [
        (LayerNorm, "LayerNormalization", "auto"),
        (LayerNorm, "LayerNormalization", True),
        (lambda: LayerNorm(group_size=4), "LayerNormalization", "auto"),
        (lambda: PartialRMSNorm(0.5), "RMSNormalization", "auto"),
        (RMSNorm, "RMSNormalization", "auto"),
    ],
    ids=["layer", "layer-xla", "layer-groups", "partial_rms", "rms"],
)
def test_model_fit_logs_nothing_kerass_own_layer_does_not(make, kerass, jit_compile):
    """The guarded program's recomputed branch watched every argument of the plain branch,
    the rows' boolean marks too: "The dtype of the watched tensor must be floating ... got
    tf.bool", twice per fit."""
    ours = _fit_log(make(), jit_compile)
    assert [m for m in ours if m not in _kerass_log(kerass, jit_compile)] == []
