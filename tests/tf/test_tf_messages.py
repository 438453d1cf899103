"""What normkit.tf says to its user: in ``model.fit`` nothing that Keras' own layers do not
(issue 51: a tape's warning of a watched boolean, twice per fit); a warning where the dtype
policy keeps a spec's half-precision steps from the half inputs they are for (issue 51: a
bfloat16 Llama norm under the float32 policy differed from torch and Flax by 8.6e-3)."""

from __future__ import annotations

import functools
import logging
import warnings

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="these tests run TensorFlow, which is not installed")
import keras  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm, from_spec  # noqa: E402
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


LLAMA_BF16 = NormSpec(eps=1e-5, cast="before_scale")  # Hugging Face Llama's RMSNorm


def _bfloat16_rows() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((4, 64)).astype(ml_dtypes.bfloat16)


def test_a_half_precision_spec_under_a_wider_policy_warns_once_naming_the_remedy():
    """Under the float32 policy Keras' autocast makes the bfloat16 input float32, where
    cast='before_scale' rounds nothing: the layer says so, once, with the policy that computes
    the spec on bfloat16 inputs; under that policy it is the reference's."""
    x = _bfloat16_rows()
    layer = from_spec(LLAMA_BF16, name="llama_norm")
    with pytest.warns(UserWarning) as caught:
        y = layer(x)
        layer(x)
    assert len(caught) == 1
    message = str(caught[0].message)
    for part in ("llama_norm", "bfloat16 input is cast to float32", "'float32'",
                 "cast='before_scale'", "dtype='mixed_bfloat16'", "autocast=False"):
        assert part in message, (part, message)
    # The warning's figures: about a bfloat16 ulp from the reference on bfloat16 inputs.
    want = reference.normalize(x, LLAMA_BF16).astype(np.float32)
    assert 1e-3 < np.abs(keras.ops.convert_to_numpy(y) - want).max() < 2e-2
    advised = from_spec(LLAMA_BF16, dtype="mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = advised(x)
    tolerances.assert_close(keras.ops.convert_to_numpy(y), reference.normalize(x, LLAMA_BF16),
                            cast="before_scale")


@pytest.mark.parametrize("make, x_dtype", [
    (lambda: from_spec(LLAMA_BF16, dtype="mixed_bfloat16"), ml_dtypes.bfloat16),
    (lambda: from_spec(LLAMA_BF16, autocast=False), ml_dtypes.bfloat16),
    (lambda: from_spec(LLAMA_BF16), np.float32),
    (lambda: RMSNorm(), ml_dtypes.bfloat16),  # no half-precision step: Keras' autocast alone
], ids=["its-policy", "autocast-off", "float32-input", "after-scale"])
def test_no_warning_where_the_spec_is_computed_as_asked(make, x_dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()(_bfloat16_rows().astype(x_dtype))


def test_a_functional_model_warns_when_it_is_built():
    """A bfloat16 ``keras.Input`` reaches the layer when the model is built: the warning comes
    then, before any data."""
    with pytest.warns(UserWarning, match="cast='before_scale'"):
        inputs = keras.Input((64,), dtype="bfloat16")
        keras.Model(inputs, from_spec(LLAMA_BF16.replace(backward="autograd"))(inputs))
