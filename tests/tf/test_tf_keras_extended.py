"""normkit.tf's extended fields as Keras sees them: the DyT layer, the residual call, the output
dtype under mixed precision, param_dtype, configs and .keras files."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import DyT, LayerNorm, RMSNorm, from_spec  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)
BF16 = np.dtype(ml_dtypes.bfloat16)

SPECS = [
    NormSpec("dyt", alpha_init=1.0, axis=(1, 2), scale_offset=1.0, bias=False),
    NormSpec("rms", residual="float32", cast="before_scale", output_dtype="promote"),
    NormSpec("partial_rms", p=0.5, scale_offset=1.0, offset_dtype="param", backward="autograd"),
    NormSpec("layer", variance="fast", residual="float32_normalized", eps=1e-3),
    NormSpec("dyt", residual="rounded"),
]


def _numpy(t: object) -> np.ndarray:
    return keras.ops.convert_to_numpy(t)


def _randomize(layer: keras.layers.Layer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layer.set_weights([w + 0.3 * rng.standard_normal(w.shape).astype(w.dtype) for w in layer.get_weights()])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.residual}")
def test_from_spec_and_config_round_trip(spec):
    layer = from_spec(spec, name="norm")
    assert layer.spec == spec
    config = layer.get_config()
    json.dumps(config)
    clone = type(layer).from_config(config)
    assert clone.spec == spec and clone.get_config() == config


def test_dyt_weights_follow_the_spec():
    layer = DyT(alpha_init=0.7, axis=-1)
    assert type(from_spec(NormSpec("dyt"))) is DyT
    assert layer.spec == NormSpec("dyt", alpha_init=0.7)
    layer.build((2, 5))
    assert [(w.name, tuple(w.shape)) for w in layer.weights] == [
        ("alpha", (1,)), ("scale", (5,)), ("bias", (5,))
    ]
    alpha, scale, bias = layer.get_weights()
    np.testing.assert_array_equal(alpha, np.full(1, 0.7, np.float32))
    np.testing.assert_array_equal(scale, np.ones(5))
    np.testing.assert_array_equal(bias, np.zeros(5))
    with pytest.raises(ValueError, match=r"NormSpec.alpha_init=-1.0 is invalid"):
        DyT(alpha_init=-1.0)


def test_dyt_config_round_trip_keeps_its_outputs():
    layer = DyT(alpha_init=1.0, scale_offset=1.0, name="dyt")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    layer(x)
    _randomize(layer, 1)
    config = layer.get_config()
    assert config["alpha_init"] == 1.0 and "epsilon" not in config
    clone = DyT.from_config(config)
    clone(x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(_numpy(clone(x)), _numpy(layer(x)))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="one backend is enough")
def test_keras_file_round_trip_with_dyt_and_residual_layers(tmp_path):
    """A block h = x + r; y = DyT(h) then RMSNorm(y, h): saved as .keras, loaded, same outputs."""
    x_in, r_in = keras.Input((3, 8)), keras.Input((3, 8))
    dyt = DyT(residual="float32_normalized", alpha_init=1.0)
    rms = RMSNorm(residual="rounded", scale_offset=1.0, bias=True)
    y, h = dyt(x_in, r_in)
    z, h2 = rms(y, h)
    model = keras.Model([x_in, r_in], [z, h2])
    _randomize(dyt, 2)
    _randomize(rms, 3)
    rng = np.random.default_rng(4)
    x, r = (rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(2))
    expected = [_numpy(t) for t in model([x, r])]
    model.save(tmp_path / "block.keras")
    loaded = keras.saving.load_model(tmp_path / "block.keras")
    for got, want in zip(loaded([x, r]), expected, strict=True):
        np.testing.assert_array_equal(_numpy(got), want)
    specs = [layer.spec for layer in loaded.layers if hasattr(layer, "spec")]
    assert specs == [dyt.spec, rms.spec]
    assert [w.name for w in loaded.layers[2].weights] == ["alpha", "scale", "bias"]
    # The numbers are the reference's: the second layer reads the first's y and h.
    w = dyt.get_weights()
    ry, rh = reference.add_normalize(x, r, dyt.spec, w[1], w[2], w[0])
    tolerances.assert_close(_numpy(dyt(x, r)[0]), ry)
    rz, rh2 = reference.add_normalize(ry.astype(np.float32), rh, rms.spec, *rms.get_weights())
    tolerances.assert_close(expected[0], rz, what="z")
    tolerances.assert_close(expected[1], rh2, what="h")


def test_residual_call_returns_y_and_h():
    layer = LayerNorm(residual="rounded", dtype="mixed_bfloat16")
    rng = np.random.default_rng(5)
    x, r = (rng.standard_normal((4, 6)).astype(BF16) for _ in range(2))
    y, h = layer(x, r)
    ry, rh = reference.add_normalize(x, r, layer.spec)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    np.testing.assert_array_equal(_numpy(h).astype(np.float64), rh.astype(np.float64))
    tolerances.assert_close(_numpy(y).astype(BF16), ry)


def test_residual_call_errors_name_the_problem():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"the spec has residual='rounded'; call the layer as layer\(x, residual\), which returns \(y, h\)"):
        RMSNorm(residual="rounded", name="n")(x)
    with pytest.raises(ValueError, match=r"a residual was passed, but the layer's spec has residual=None"):
        RMSNorm()(x, x)
    with pytest.raises(ValueError, match=r"the residual has shape \(2, 3\), expected the input's shape \(2, 4\)"):
        RMSNorm(residual="float32")(x, np.ones((2, 3), np.float32))
    # Autocast casts a floating residual to the compute dtype; without it the dtypes must fit.
    with pytest.raises(TypeError, match=r"the residual has dtype float16; residual='rounded' with an input of dtype bfloat16 needs bfloat16"):
        RMSNorm(residual="rounded", autocast=False)(x.astype(BF16), x.astype(np.float16))
    with pytest.raises(TypeError, match=r"residual='float32' with an input of dtype float16 needs float16 or float32"):
        RMSNorm(residual="float32", autocast=False)(x.astype(np.float16), x.astype(np.float64))


def test_float32_residual_stream_with_half_inputs():
    """residual="float32" takes a float32 residual next to a bfloat16 x and returns h in float32:
    the mixed policy's autocast leaves the float32 residual stream alone."""
    layer = RMSNorm(residual="float32", dtype="mixed_bfloat16")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 8)).astype(BF16)
    r = rng.standard_normal((3, 8)).astype(np.float32)
    y, h = layer(x, r)
    ry, rh = reference.add_normalize(x, r, layer.spec)
    assert rh.dtype == np.float32 and keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    np.testing.assert_array_equal(_numpy(h), rh)
    tolerances.assert_close(_numpy(y).astype(BF16), ry)


@pytest.mark.parametrize("policy,y_dtype", [("float32", "float32"), ("mixed_bfloat16", "bfloat16")])
def test_symbolic_residual_outputs_and_masks(policy, y_dtype):
    layer = RMSNorm(residual="float32", dtype=policy)
    y, h = layer(keras.Input((5, 4), dtype="bfloat16"), keras.Input((5, 4), dtype="float32"))
    assert (y.dtype, h.dtype) == (y_dtype, "float32")
    mask = np.array([[True, False]])
    assert layer.compute_mask(None, mask) == (mask, mask)
    with pytest.raises(ValueError, match=r"the spec has residual='float32'; call the layer"):
        layer(keras.Input((5, 4)))


@pytest.mark.parametrize("output_dtype,expected", [("input", "bfloat16"), ("promote", "float32")])
def test_mixed_bfloat16_policy_output_dtype(output_dtype, expected):
    """Under mixed_bfloat16 the input is cast to bfloat16 and the variables are float32:
    "promote" gives float32 (bfloat16 promoted with the float32 variables), "input" bfloat16."""
    layer = RMSNorm(cast="before_scale", output_dtype=output_dtype, dtype="mixed_bfloat16")
    x = np.random.default_rng(7).standard_normal((4, 16)).astype(np.float32)
    y = layer(x)
    _randomize(layer, 8)
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == expected
    assert layer(keras.Input((16,))).dtype == expected
    seen = x.astype(BF16)
    (w,) = layer.get_weights()
    assert w.dtype == np.float32
    want = reference.normalize(seen, layer.spec, w)
    assert want.dtype.name == expected
    tolerances.assert_close(
        _numpy(y).astype(want.dtype), want, cast="before_scale",
        magnitude=reference.scaled_magnitude(seen, layer.spec, w),
    )


def test_promote_follows_the_variables_dtype():
    """A bfloat16 input (under mixed_bfloat16, or autocast=False) with float32 variables
    promotes to float32; with bfloat16 variables (param_dtype, or the bfloat16 policy) it stays
    bfloat16. Under the float32 policy the input is float32 once autocast."""
    x = keras.Input((4,), dtype="bfloat16")
    mixed = {"dtype": "mixed_bfloat16"}
    assert RMSNorm(output_dtype="promote", **mixed)(x).dtype == "float32"
    assert RMSNorm(output_dtype="promote", autocast=False)(x).dtype == "float32"
    assert RMSNorm(output_dtype="promote", param_dtype="bfloat16", **mixed)(x).dtype == "bfloat16"
    assert RMSNorm(output_dtype="promote", dtype="bfloat16")(x).dtype == "bfloat16"
    assert RMSNorm(output_dtype="promote", scale=False, **mixed)(x).dtype == "bfloat16"  # none
    assert DyT(output_dtype="promote", scale=False, bias=False, **mixed)(x).dtype == "float32"
    assert RMSNorm(output_dtype="promote", param_dtype="bfloat16")(x).dtype == "float32"


def test_param_dtype_holds_half_weights_for_the_param_offset():
    """Gemma bfloat16 weights: 1 + w rounded in bfloat16, under a float32 policy."""
    layer = RMSNorm(scale_offset=1.0, offset_dtype="param", param_dtype="bfloat16")
    x = np.random.default_rng(9).standard_normal((3, 32)).astype(np.float32)
    layer.build(x.shape)
    w = (0.05 * np.random.default_rng(10).standard_normal(32)).astype(BF16)
    layer.set_weights([w])
    assert layer.get_config()["param_dtype"] == "bfloat16"
    assert layer.weights[0].dtype == "bfloat16"
    y = _numpy(layer(x))
    want = reference.normalize(x, layer.spec, w)
    tolerances.assert_close(y, want)
    in_float32 = reference.normalize(x, layer.spec.replace(offset_dtype="float32"), w)
    assert np.abs(want - in_float32).max() > 1e-3  # the bfloat16 rounding of 1 + w shows


def test_param_dtype_must_be_a_float():
    with pytest.raises(TypeError, match=r"param_dtype='int32' is invalid: expected one of"):
        RMSNorm(param_dtype="int32")
