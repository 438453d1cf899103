"""normkit.tf.LayerNorm and RMSNorm as drop-ins for keras.layers.LayerNormalization and
RMSNormalization: Keras' arguments, attributes and call conventions (those of Keras' own tests in
keras/src/layers/normalization/) give Keras' outputs.

Tolerances: RMSNorm performs Keras' float32 operations in Keras' order (``x * rsqrt(mean(x**2)
+ eps) * scale``), so its outputs are compared bit for bit. LayerNorm orders them differently
(Keras: ``x * inv + (beta - mean * inv)``; normkit: ``(x - mean) * inv + beta``), so the two differ
by a few float32 roundings of terms no larger than ``max|y|`` on inputs whose mean is within a
few standard deviations of zero: they are compared with the tolerance policy's float32 forward
bound, ``FORWARD_REL * max|y|`` (`normkit.tolerances`), Keras' output standing as the reference.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import DyT, LayerNorm, PartialRMSNorm, RMSNorm, from_spec  # noqa: E402

# Keras' TensorFlow backend converts tensors with np.array(x), which numpy 2 flags; harmless.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)

testing = pytest.importorskip("keras.src.testing")


def _numpy(y: object) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(y))


def _assert_layer_norm_close(actual: object, expected: object) -> None:
    """The policy's float32 forward bound with Keras' output as the reference (module doc)."""
    a, e = _numpy(actual), _numpy(expected)
    assert a.dtype == e.dtype == np.float32
    bound = tolerances.FORWARD_REL * float(np.abs(e).max(initial=0.0))
    np.testing.assert_allclose(a, e, rtol=0, atol=bound)


def _positional(cls: type) -> list[tuple[str, object]]:
    """``(name, default)`` of the constructor's arguments that may be passed by position."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [(p.name, p.default) for p in params if p.kind in kinds]


@pytest.mark.parametrize(
    "ours,theirs",
    [(LayerNorm, keras.layers.LayerNormalization), (RMSNorm, keras.layers.RMSNormalization)],
    ids=["LayerNorm", "RMSNorm"],
)
def test_positional_arguments_are_keras_own(ours, theirs):
    """The installed Keras' names, order and defaults, so positional calls mean the same."""
    assert _positional(ours) == _positional(theirs)


def test_defaults_are_keras_eps_and_affine():
    assert LayerNorm().spec == NormSpec("layer", eps=1e-3)
    assert RMSNorm().spec == NormSpec("rms", eps=1e-6)
    for ours, theirs in ((LayerNorm(), keras.layers.LayerNormalization()),
                         (RMSNorm(), keras.layers.RMSNormalization())):
        assert ours.epsilon == theirs.epsilon
        assert ours.axis == theirs.axis == -1


LAYER_NORM_CALLS = [
    # (constructor arguments, input shape) as Keras' layer_normalization_test.py uses them
    ({"gamma_regularizer": "l2", "beta_regularizer": "l2"}, (3, 4, 2)),
    ({"gamma_initializer": "ones", "beta_initializer": "ones"}, (3, 4, 2)),
    ({"scale": False, "center": False}, (3, 3)),
    ({"axis": (-3, -2, -1)}, (2, 8, 8, 3)),
    ({"axis": [-1, -2]}, (2, 3, 4)),
    ({}, (1, 0, 10)),
    ({"epsilon": 1e-5, "gamma_initializer": "random_normal", "beta_initializer": "random_normal"},
     (5, 7)),
]


@pytest.mark.parametrize("kwargs,shape", LAYER_NORM_CALLS, ids=str)
def test_layer_norm_gives_keras_output(kwargs, shape):
    x = np.random.default_rng(0).normal(5.0, 10.0, shape).astype(np.float32)
    theirs = keras.layers.LayerNormalization(**kwargs)
    ours = LayerNorm(**kwargs)
    theirs.build(shape)
    ours.build(shape)
    assert len(ours.weights) == len(theirs.weights)
    ours.set_weights(theirs.get_weights())  # the random initializers draw differently
    _assert_layer_norm_close(ours(x), theirs(x))
    assert tuple(ours.compute_output_shape(shape)) == shape


@pytest.mark.parametrize(
    "kwargs,shape",
    [({}, (4, 2)), ({"axis": -1}, (4, 2)), ({"axis": [-1, -2]}, (2, 3, 4)),
     ({"epsilon": 1e-3}, (3, 16)), ({"axis": [1, 2]}, (2, 5, 3))],
    ids=str,
)
def test_rms_norm_gives_keras_output_bit_for_bit(kwargs, shape):
    x = np.random.default_rng(1).normal(5.0, 10.0, shape).astype(np.float32)
    theirs = keras.layers.RMSNormalization(**kwargs)
    ours = RMSNorm(**kwargs)
    theirs.build(shape)
    ours.build(shape)
    ours.set_weights([np.linspace(0.5, 1.5, w.size, dtype=np.float32).reshape(w.shape)
                      for w in ours.get_weights()])
    theirs.set_weights(ours.get_weights())
    np.testing.assert_array_equal(_numpy(ours(x)), _numpy(theirs(x)))


def test_keras_documented_outputs():
    """The values Keras' tests pin, here computed by normkit's layers (eps 1e-3 and 1e-6)."""
    five = np.arange(5, dtype=np.float32)[None, :]
    layer = LayerNorm(dtype="float32", beta_initializer="ones", gamma_initializer="ones")
    np.testing.assert_allclose(
        _numpy(layer(five)), [[-0.41386, 0.29307, 1.0, 1.70693, 2.41386]], rtol=0, atol=1e-5
    )
    # mean 2, variance 2: (x - 2) / sqrt(2 + 1e-3) + 1, within the policy's float32 bound
    exact = (np.arange(5) - 2) / np.sqrt(2 + 1e-3) + 1
    bound = tolerances.FORWARD_REL * exact.max()
    np.testing.assert_allclose(_numpy(layer(five)), [exact], rtol=0, atol=bound)
    ten = np.arange(10, dtype=np.float32)[None, :]
    exact = np.arange(10) / np.sqrt(28.5 + 1e-6)  # mean(x**2) = 28.5
    bound = tolerances.FORWARD_REL * exact.max()
    np.testing.assert_allclose(_numpy(RMSNorm()(ten)), [exact], rtol=0, atol=bound)
    np.testing.assert_array_equal(
        _numpy(RMSNorm()(ten)), _numpy(keras.layers.RMSNormalization()(ten))
    )


def test_built_with_a_smaller_shape_then_called_as_keras_test_correctness_does():
    """Keras' test_correctness: build on (2, 2, 2), call on (1000, 2, 2, 2); undoing beta and
    gamma leaves zero mean and unit deviation.

    Rows of two values far from zero compared with their difference make Keras' ``x * inv -
    mean * inv`` cancel: its error is a few roundings of ``|x| * inv``, not of ``|y|``. normkit
    forms ``x - mean`` first and meets the policy against the exact reference.
    """
    x = np.random.default_rng(2).normal(5.0, 10.0, (1000, 2, 2, 2)).astype(np.float32)
    theirs = keras.layers.LayerNormalization(dtype="float32")
    ours = LayerNorm(dtype="float32")
    for layer in (theirs, ours):
        layer.build(input_shape=(2, 2, 2))
    y = _numpy(ours(x))
    tolerances.assert_close(y, reference.normalize(x, ours.spec, *ours.get_weights()))
    wide = x.astype(np.float64)
    inv = 1 / np.sqrt(wide.var(axis=-1, keepdims=True) + 1e-3)
    bound = tolerances.FORWARD_REL * float(np.abs(wide * inv).max())
    np.testing.assert_allclose(y, _numpy(theirs(x)), rtol=0, atol=bound)
    undone = (y - _numpy(ours.beta)) / _numpy(ours.gamma)
    # each row of 2 holds +-d / sqrt(d**2 + 1e-3): |value| just below 1
    assert abs(undone.mean()) < 1e-6
    assert 0.99 < undone.std() < 1.0


def test_attributes_are_keras_own():
    """LayerNorm: Keras' bools ``center`` and ``scale`` and weights ``gamma`` and ``beta``;
    RMSNorm: Keras' weight ``scale``. Every normkit layer has ``gamma`` and ``beta``."""
    layer = LayerNorm(axis=[1, 2, 3])
    keras_layer = keras.layers.LayerNormalization(axis=[1, 2, 3])
    assert layer.axis == keras_layer.axis == [1, 2, 3]
    assert (layer.epsilon, layer.center, layer.scale) == (
        keras_layer.epsilon, keras_layer.center, keras_layer.scale) == (1e-3, True, True)
    assert layer.gamma is None and layer.beta is None
    layer.build([5, 20, 30, 40])
    keras_layer.build([5, 20, 30, 40])
    assert tuple(layer.gamma.shape) == tuple(layer.beta.shape) == tuple(keras_layer.gamma.shape)
    assert not hasattr(layer, "bias") and not hasattr(keras_layer, "bias")
    # the weights keep normkit's names, so .keras files saved before the aliases still load
    assert [w.name for w in layer.weights] == ["scale", "bias"]
    assert layer.weights == [layer.gamma, layer.beta]
    bare = LayerNorm(center=False, scale=False)
    bare_keras = keras.layers.LayerNormalization(center=False, scale=False)
    bare.build((2, 4))
    bare_keras.build((2, 4))
    assert (bare.center, bare.scale, bare.gamma, bare.beta, bare.weights) == (
        bare_keras.center, bare_keras.scale, bare_keras.gamma, bare_keras.beta,
        bare_keras.weights) == (False, False, None, None, [])
    rms, keras_rms = RMSNorm(axis=1, epsilon=1e-5), keras.layers.RMSNormalization(1, 1e-5)
    assert (rms.axis, rms.epsilon) == (1, 1e-5)
    rms.build((2, 6))
    keras_rms.build((2, 6))
    assert rms.scale is rms.gamma and rms.bias is rms.beta is None
    assert tuple(rms.scale.shape) == tuple(keras_rms.scale.shape) == (6,)
    assert [w.name for w in rms.weights] == [w.name for w in keras_rms.weights] == ["scale"]
    assert DyT().epsilon is None


def test_refusals_name_the_reason():
    with pytest.raises(
        ValueError,
        match=r"^LayerNorm\(rms_scaling=True\) is refused: Keras' rms_scaling divides x by "
        r"sqrt\(variance \+ eps\), the variance of x about its mean, not by the root mean square "
        r"of x, so it is neither LayerNorm nor RMSNorm \(Keras 3.15 deprecates it\); use "
        r"normkit.tf.RMSNorm, which is keras.layers.RMSNormalization's drop-in$",
    ):
        LayerNorm(rms_scaling=True)
    assert LayerNorm(rms_scaling=False).spec == LayerNorm().spec
    with pytest.raises(
        ValueError,
        match=r"^LayerNorm: gamma_initializer='zeros' with scale_offset=1.0: with an offset only "
        r"'ones' is accepted \(w then starts at 1 - scale_offset, so that scale_offset \+ w starts "
        r"at one\)$",
    ):
        LayerNorm(gamma_initializer="zeros", scale_offset=1.0)
    with pytest.raises(ValueError, match=r"NormSpec.axis=\[\] is invalid: expected at least one"):
        LayerNorm(axis=[])


@pytest.mark.parametrize(
    "argument, value",
    [("axis", {"axis": -1}), ("axis", "-1"), ("axis", 1.5), ("axis", None), ("axis", ["a"])],
)
@pytest.mark.parametrize(
    "ours, theirs",
    [(LayerNorm, keras.layers.LayerNormalization), (RMSNorm, keras.layers.RMSNormalization)],
    ids=["LayerNorm", "RMSNorm"],
)
def test_wrong_types_raise_type_error_as_keras_layers(ours, theirs, argument, value):
    """Keras' own layers raise TypeError for these (LayerNormalization at construction,
    RMSNormalization at the first call); normkit's at construction, naming the argument."""
    with pytest.raises(TypeError):
        theirs(**{argument: value})(np.ones((2, 4), "float32"))
    with pytest.raises(TypeError, match=f"^{ours.__name__}: expected .* for the argument "
                       f"'{argument}', but received"):
        ours(**{argument: value})


@pytest.mark.parametrize(
    "make, argument",
    [(lambda: LayerNorm(epsilon="1e-3"), "epsilon"), (lambda: RMSNorm(epsilon=1j), "epsilon"),
     (lambda: LayerNorm(center="yes"), "center"), (lambda: LayerNorm(scale=1), "scale"),
     (lambda: RMSNorm(bias="no"), "bias"), (lambda: RMSNorm(scale_offset="1"), "scale_offset"),
     (lambda: RMSNorm(eps_placement=0), "eps_placement"), (lambda: RMSNorm(cast=None), "cast"),
     (lambda: RMSNorm(residual=1), "residual"), (lambda: LayerNorm(variance=2), "variance"),
     (lambda: RMSNorm(offset_dtype=b"x"), "offset_dtype"), (lambda: RMSNorm(backward=0), "backward"),
     (lambda: RMSNorm(output_dtype=0), "output_dtype"), (lambda: DyT(alpha_init="1"), "alpha_init"),
     (lambda: PartialRMSNorm("0.5"), "p")],
)
def test_every_option_of_the_wrong_type_raises_type_error(make, argument):
    with pytest.raises(TypeError, match=f"for the argument '{argument}', but received"):
        make()


def test_ones_with_an_offset_starts_the_effective_scale_at_one():
    layer = LayerNorm(scale_offset=1.0, gamma_initializer="ones")
    x = np.array([[1.0, 3.0]], np.float32)
    np.testing.assert_array_equal(_numpy(layer(x)), _numpy(LayerNorm()(x)))
    assert _numpy(layer.gamma).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("layer", [LayerNorm(), RMSNorm(axis=(1, 2)), DyT(axis=1)],
                         ids=lambda layer: type(layer).__name__)
def test_compute_output_shape_is_the_input_shape(layer):
    assert layer.compute_output_shape((None, 3, 4)) == (None, 3, 4)
    assert layer.compute_output_shape((2, 3, 4)) == (2, 3, 4)


def test_compute_output_shape_names_an_out_of_range_axis():
    with pytest.raises(ValueError, match=r"input of shape \(2, 4\).*axis 2 is out of range for "
                                         r"an input of rank 2 \(allowed: -2 \.\. 1\)"):
        LayerNorm(axis=2).compute_output_shape((2, 4))
    with pytest.raises(ValueError, match=r"axis -4 is out of range for an input of rank 3"):
        RMSNorm(axis=[-4, -1]).compute_output_shape((None, 3, 4))


def test_compute_output_shape_with_a_residual_is_that_of_y_and_h():
    assert RMSNorm(residual="rounded").compute_output_shape((2, 4)) == ((2, 4), (2, 4))


def test_time_distributed_gives_keras_output():
    x = np.random.default_rng(3).standard_normal((4, 3, 5, 8)).astype(np.float32)
    theirs = keras.layers.TimeDistributed(keras.layers.LayerNormalization())
    ours = keras.layers.TimeDistributed(LayerNorm())
    assert ours.compute_output_shape((None, 3, 5, 8)) == (None, 3, 5, 8)
    _assert_layer_norm_close(ours(x), theirs(x))
    symbolic = ours(keras.Input((3, 5, 8)))
    assert tuple(symbolic.shape) == (None, 3, 5, 8)
    rms = keras.layers.TimeDistributed(RMSNorm())
    np.testing.assert_array_equal(
        _numpy(rms(x)), _numpy(keras.layers.TimeDistributed(keras.layers.RMSNormalization())(x))
    )


def _custom() -> LayerNorm:
    return LayerNorm(
        axis=1,
        gamma_initializer=keras.initializers.Constant(0.5),
        beta_initializer=keras.initializers.Constant(-0.25),
        gamma_regularizer=keras.regularizers.L2(0.25),
        beta_regularizer=keras.regularizers.L1(0.5),
        gamma_constraint=keras.constraints.NonNeg(),
        beta_constraint=keras.constraints.MaxNorm(0.1, axis=0),
        variance="fast",
        name="norm",
    )


def test_get_config_round_trip_keeps_initializers_regularizers_constraints():
    layer = _custom()
    config = layer.get_config()
    assert config["gamma_initializer"]["class_name"] == "Constant"
    assert config["beta_regularizer"]["config"] == {"l1": 0.5}
    assert config["gamma_constraint"]["class_name"] == "NonNeg"
    assert (config["center"], config["scale"], config["rms_scaling"]) == (True, True, False)
    clone = LayerNorm.from_config(config)
    assert clone.get_config() == config
    assert clone.spec == layer.spec == NormSpec("layer", eps=1e-3, axis=1, variance="fast")
    clone.build((2, 3))
    assert _numpy(clone.gamma).tolist() == [0.5] * 3
    assert _numpy(clone.beta).tolist() == [-0.25] * 3
    # the regularizers' losses, exact in float32: 0.25 * sum(gamma**2) and 0.5 * sum(|beta|)
    assert sorted(float(v) for v in clone.losses) == [0.25 * 3 * 0.25, 0.5 * 3 * 0.25]
    assert isinstance(clone.gamma.constraint, keras.constraints.NonNeg)
    assert isinstance(clone.beta.constraint, keras.constraints.MaxNorm)


def test_constraints_apply_after_an_optimizer_step():
    layer = _custom()
    layer.build((2, 3))
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.apply([keras.ops.ones(3), keras.ops.ones(3)], [layer.gamma, layer.beta])
    assert _numpy(layer.gamma).tolist() == [0.0] * 3  # 0.5 - 1, clipped by NonNeg
    # beta = -1.25 each; MaxNorm(0.1) rescales the vector to norm 0.1
    np.testing.assert_allclose(np.linalg.norm(_numpy(layer.beta)), 0.1, rtol=1e-6)


def test_a_keras_layer_normalization_config_builds_the_same_layer():
    """Swapping the class of a saved LayerNormalization config keeps its arguments."""
    keras_layer = keras.layers.LayerNormalization(
        axis=[-2, -1], epsilon=1e-4, center=False, gamma_initializer="zeros",
        gamma_regularizer=keras.regularizers.L2(0.5), name="ln",
    )
    layer = LayerNorm.from_config(keras_layer.get_config())
    assert layer.spec == NormSpec("layer", eps=1e-4, axis=(-2, -1), bias=False)
    assert (layer.name, layer.center) == ("ln", False)
    x = np.random.default_rng(4).standard_normal((2, 3, 4)).astype(np.float32)
    keras_layer(x)
    layer(x)
    assert _numpy(layer.gamma).tolist() == [[0.0] * 4] * 3
    assert len(layer.losses) == len(keras_layer.losses) == 1


def test_configs_saved_with_bias_still_load():
    """Configs written before LayerNorm took Keras' ``center`` name it ``bias``."""
    old = {**LayerNorm(epsilon=1e-6).get_config(), "bias": False}
    del old["center"]
    assert LayerNorm.from_config(old).spec == NormSpec("layer", bias=False)


def test_from_spec_keeps_the_spec_whatever_the_defaults(tmp_path):
    spec = NormSpec("layer", bias=False, scale_offset=1.0)  # eps 1e-6, the spec's default
    layer = from_spec(spec)
    assert layer.spec == spec
    model = keras.Sequential([keras.Input((4,)), layer])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].spec == spec


def test_save_and_load_a_model_with_custom_arguments(tmp_path):
    model = keras.Sequential([keras.Input((3,)), _custom()])
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    model.layers[0].set_weights([np.array([1.0, 2.0, 3.0], np.float32),
                                 np.array([0.1, 0.0, -0.1], np.float32)])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].get_config() == model.layers[0].get_config()
    np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(model(x)))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_policy_gives_keras_output_on_compute_dtype_inputs(policy):
    """In a mixed model the norm receives the previous layer's compute-dtype output; both
    layers then compute in float32 and round once, to the bit here (measured). The initial
    weights (ones and zeros) are exact in half precision: RMSNormalization autocasts its
    scale to the compute dtype, normkit keeps it float32."""
    compute = keras.DTypePolicy(policy).compute_dtype
    x = keras.ops.cast(np.random.default_rng(6).standard_normal((4, 16)), compute)
    for ours, theirs in ((LayerNorm(dtype=policy), keras.layers.LayerNormalization(dtype=policy)),
                         (RMSNorm(dtype=policy), keras.layers.RMSNormalization(dtype=policy))):
        y, expected = ours(x), theirs(x)
        assert keras.backend.standardize_dtype(y.dtype) == compute
        assert [w.dtype for w in ours.weights] == [w.dtype for w in theirs.weights]
        np.testing.assert_array_equal(_numpy(keras.ops.cast(y, "float32")),
                                      _numpy(keras.ops.cast(expected, "float32")))


@pytest.mark.parametrize("policy", ["float32", "float64", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_output_dtype_follows_the_policy_as_keras(policy, dtype):
    """Every policy and floating input dtype: the input is cast to the compute dtype and the
    output has it, as Keras' layers return (measured: keras 3.15). RMSNorm then gives
    RMSNormalization's output to the bit; LayerNorm the reference's on the cast input."""
    compute = keras.DTypePolicy(policy).compute_dtype
    x = keras.ops.cast(np.random.default_rng(8).standard_normal((4, 16)), dtype)
    seen = _numpy(keras.ops.cast(x, compute))
    rms, keras_rms = RMSNorm(dtype=policy), keras.layers.RMSNormalization(dtype=policy)
    np.testing.assert_array_equal(_numpy(rms(x)), _numpy(keras_rms(x)))
    pairs = ((rms, keras_rms),
             (LayerNorm(dtype=policy), keras.layers.LayerNormalization(dtype=policy)))
    for ours, theirs in pairs:
        y, expected = ours(x), theirs(x)
        assert keras.backend.standardize_dtype(y.dtype) == compute
        assert keras.backend.standardize_dtype(expected.dtype) == compute
        tolerances.assert_close(_numpy(y), reference.normalize(seen, ours.spec))


def test_autocast_false_keeps_the_input_dtype_as_keras_rms_normalization():
    """Keras' ``autocast=False``: the spec applies to the input as given, so a bfloat16 input
    under the float32 policy gives bfloat16, as RMSNormalization(autocast=False) does; the
    argument round-trips through get_config."""
    x = keras.ops.cast(np.random.default_rng(9).standard_normal((4, 16)), "bfloat16")
    ours = RMSNorm(autocast=False)
    y = ours(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    np.testing.assert_array_equal(_numpy(y), _numpy(keras.layers.RMSNormalization(autocast=False)(x)))
    tolerances.assert_close(_numpy(y), reference.normalize(_numpy(x), ours.spec))
    clone = RMSNorm.from_config(ours.get_config())
    assert keras.backend.standardize_dtype(clone(x).dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(RMSNorm.from_config(RMSNorm().get_config())(x).dtype) == "float32"


def _train(norm: keras.layers.Layer, weights: list[np.ndarray]) -> tuple[list, list]:
    """Dense -> norm -> Dense from ``weights``, 20 full-batch SGD steps: (losses, weights)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    target = rng.standard_normal((32, 3)).astype(np.float32)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), norm,
                              keras.layers.Dense(3)])
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, target, batch_size=32, epochs=20, shuffle=False, verbose=0)
    return history.history["loss"], model.get_weights()


def _initial_weights(norm: keras.layers.Layer) -> list[np.ndarray]:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), norm,
                              keras.layers.Dense(3)])
    return model.get_weights()


PAIRS = [(LayerNorm, keras.layers.LayerNormalization), (RMSNorm, keras.layers.RMSNormalization)]


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["LayerNorm", "RMSNorm"])
def test_training_matches_keras_layer(ours, theirs):
    """Each step's forward and gradients agree within the policy's float32 bounds; 20 steps of
    SGD at lr 0.1 on this small, well-conditioned problem keep the final weights within the
    gradient bound ``GRAD_REL * max|w|`` of Keras' (measured: about 1e-7 relative for
    LayerNorm; RMSNorm is bit-identical on TensorFlow) and the losses within ten times the
    forward bound."""
    initial = _initial_weights(theirs())
    losses, weights = _train(ours(), initial)
    keras_losses, keras_weights = _train(theirs(), initial)
    assert keras_losses[-1] < 0.6 * keras_losses[0]  # it trains
    np.testing.assert_allclose(losses, keras_losses, rtol=10 * tolerances.FORWARD_REL)
    for mine, reference_weight in zip(weights, keras_weights, strict=True):
        bound = tolerances.GRAD_REL * float(np.abs(reference_weight).max())
        np.testing.assert_allclose(mine, reference_weight, rtol=0, atol=bound)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="bit-identical training measured on TensorFlow (XLA fuses otherwise)")
def test_training_matches_keras_rms_normalization_bit_for_bit():
    """RMSNorm runs Keras' operations in Keras' order, forward and (by autodiff) backward."""
    initial = _initial_weights(keras.layers.RMSNormalization())
    losses, weights = _train(RMSNorm(), initial)
    keras_losses, keras_weights = _train(keras.layers.RMSNormalization(), initial)
    assert losses == keras_losses
    for mine, reference_weight in zip(weights, keras_weights, strict=True):
        np.testing.assert_array_equal(mine, reference_weight)


class TestKerasOwnLayerHarness(testing.TestCase):
    """Keras' run_layer_test (serialization, symbolic call, training, mixed precision) with the
    arguments Keras' own tests give LayerNormalization and RMSNormalization."""

    def test_layer_norm(self) -> None:
        common = {"expected_num_non_trainable_weights": 0, "expected_num_seed_generators": 0,
                  "supports_masking": True}
        self.run_layer_test(
            LayerNorm,
            init_kwargs={"gamma_regularizer": keras.regularizers.L2(0.01),
                         "beta_regularizer": keras.regularizers.L2(0.01)},
            input_shape=(3, 4, 2), expected_output_shape=(3, 4, 2),
            expected_num_trainable_weights=2, expected_num_losses=2, **common,
        )
        self.run_layer_test(
            LayerNorm, init_kwargs={"scale": False, "center": False}, input_shape=(3, 3),
            expected_output_shape=(3, 3), expected_num_trainable_weights=0,
            expected_num_losses=0, **common,
        )
        self.run_layer_test(
            LayerNorm, init_kwargs={"axis": (-3, -2, -1)}, input_shape=(2, 8, 8, 3),
            expected_output_shape=(2, 8, 8, 3), expected_num_trainable_weights=2,
            expected_num_losses=0, **common,
        )

    def test_rms_norm(self) -> None:
        self.run_layer_test(
            RMSNorm, init_kwargs={"axis": -1}, input_shape=(4, 2), expected_output_shape=(4, 2),
            expected_num_trainable_weights=1, expected_num_seed_generators=0,
        )
