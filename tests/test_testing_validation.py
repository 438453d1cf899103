"""assert_conforms refuses bad arguments and bad outputs with messages naming the problem, and
tells the two cast orders apart with parameters."""

import re
import warnings

import numpy as np
import pytest

from normkit import NormSpec
from normkit.testing import assert_conforms

torch = pytest.importorskip("torch")

SPEC = NormSpec("rms", eps=1e-5)
F32 = {"dtypes": ("float32",), "shapes": ((5, 7),)}


def rms(x, eps=1e-5):
    """y_hat in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x):
    return rms(x).to(x.dtype)


def after_scale(x, weight, bias):
    """Scale and bias in float32, one rounding (torch, Gemma, Keras, Flax)."""
    y = rms(x) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def before_scale(x, weight, bias):
    """y_hat rounded to the input dtype, then the affine step in float32 and rounded (Llama)."""
    y = rms(x).to(x.dtype).float() * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


# --- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"dtypes": ()}, ValueError, ("dtypes is empty: nothing would be checked; give some of "
         "float16, bfloat16, float32, float64")),
        ({"shapes": ()}, ValueError, "shapes is empty: nothing would be checked"),
        ({"dtypes": ("int8",)}, ValueError, ("dtypes: 'int8' is not a dtype normkit checks; "
         "expected one of float16, bfloat16, float32, float64")),
        ({"dtypes": "float32"}, TypeError, "dtypes must be a sequence of dtype names"),
        ({"shapes": (5, 7)}, ValueError, ("shapes: 5 is not a shape of positive sizes (shapes is a "
         "sequence of shapes, e.g. ((5, 7),), not one shape)")),
        ({"shapes": ((5, 0),)}, ValueError, "shapes: (5, 0) is not a shape of positive sizes"),
        ({"shapes": "5x7"}, TypeError, "shapes must be a sequence of shapes, e.g. ((5, 7),)"),
        ({"shapes": ((5, 7),), "spec": SPEC.replace(axis=(-3, -1))}, ValueError,
         "NormSpec.axis=(-3, -1): axis -3 is out of range for an input of rank 2"),
        ({"spec": "rms"}, TypeError, "spec must be a normkit.NormSpec, got str 'rms'"),
        ({"spec": SPEC.to_dict()}, TypeError, "spec must be a normkit.NormSpec, got dict"),
        ({"backend": "mxnet"}, ValueError, "unknown backend 'mxnet'; known: ['torch', 'tf', 'jax']"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(kwargs, error, message):
    calls = []
    kwargs = {"spec": SPEC, "backend": "torch", **kwargs}
    with pytest.raises(error) as info:
        assert_conforms(lambda x: calls.append(x) or rms_norm(x), **kwargs)
    assert message in str(info.value)
    assert calls == []


def test_numpy_dtypes_are_accepted_by_name():
    assert_conforms(rms_norm, SPEC, backend="torch", dtypes=(np.dtype(np.float32),),
                    shapes=((5, 7),))


# --- outputs that are not a norm's -------------------------------------------------------


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x: rms_norm(x)[..., :-1], ("(float32[5, 7]) returned shape (5, 6) for an input of "
         "shape (5, 7); a norm keeps the input's shape")),
        (lambda x: rms_norm(x).detach().numpy(), ("(float32[5, 7]) returned a numpy.ndarray; it "
         "must return a torch.Tensor of the input's shape")),
        (lambda x: None, "(float32[5, 7]) returned None; it must return a torch.Tensor"),
    ],
)
def test_an_output_that_is_not_a_tensor_of_the_input_shape_fails(fn, message, grad):
    with pytest.raises(AssertionError) as info:
        assert_conforms(fn, SPEC, backend="torch", grad=grad, **F32)
    assert str(info.value).startswith("<lambda> (float32[5, 7]) returned")
    assert message in str(info.value)


def test_a_detached_torch_output_fails_with_grad_and_passes_forward_only():
    def detached(x):
        return rms_norm(x).detach()

    with pytest.raises(AssertionError, match=r"detached \(float32\[5, 7\]\) returned an output "
                       r"detached from its inputs \(requires_grad is False.*pass grad=False"):
        assert_conforms(detached, SPEC, backend="torch", **F32)
    assert_conforms(detached, SPEC, backend="torch", grad=False, **F32)


def test_an_output_with_no_gradient_path_to_x_fails_naming_it():
    def x_detached(x, weight, bias):
        return after_scale(x.detach(), weight, bias)

    with pytest.raises(AssertionError, match=r"x_detached \(float32\[5, 7\]\): no gradient could "
                       r"be taken through its output \(none reaches x\); y must be computed "
                       "from x .* by differentiable torch operations"):
        assert_conforms(x_detached, SPEC, backend="torch", params=True, **F32)


def test_jax_and_tensorflow_outputs_without_a_gradient_path_fail_naming_it():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    tf = pytest.importorskip("tensorflow")

    def jax_rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 / jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)

    def tf_rms(x):
        x32 = tf.cast(x, tf.float32)
        y = x32 * tf.math.rsqrt(tf.reduce_mean(x32 * x32, -1, keepdims=True) + 1e-5)
        return tf.cast(y, x.dtype)

    with pytest.raises(AssertionError, match=r"dx is zero everywhere, the reference's is not: no "
                       r"gradient reaches x \(a stop_gradient or detach in fn\?\)"):
        assert_conforms(lambda x: jax.lax.stop_gradient(jax_rms(x)), SPEC, backend="jax", **F32)
    with pytest.raises(AssertionError, match=r"converted its traced input to numpy or a Python "
                       r"value \(TracerArrayConversionError"):
        assert_conforms(lambda x: np.asarray(jax_rms(x)), SPEC, backend="jax", **F32)
    with pytest.raises(AssertionError, match="returned a numpy.ndarray; it must return a jax"):
        assert_conforms(lambda x: np.asarray(jax_rms(x)), SPEC, backend="jax", grad=False, **F32)
    with pytest.raises(AssertionError, match="no gradient could be taken through its output .*"
                       "differentiable tf operations"):
        assert_conforms(lambda x: tf.stop_gradient(tf_rms(x)), SPEC, backend="tf", **F32)
    with pytest.raises(AssertionError, match="returned a numpy.ndarray; it must return a tf"):
        assert_conforms(lambda x: tf_rms(x).numpy(), SPEC, backend="tf", **F32)
    with pytest.raises(AssertionError, match=r"returned shape \(5, 3\) for an input of shape"):
        assert_conforms(lambda x: jax_rms(x)[:, :3], SPEC, backend="jax", **F32)


# --- cast order ----------------------------------------------------------------------------

HALVES = ("bfloat16", "float16")
SHARES = re.compile(
    r"(\w+)\[[\d, ]+\](?: rows near [\w ]+)?: cast order: the spec says cast='(\w+)', but y is "
    r"closer to cast='(\w+)' on (\d+)% and to '\w+' on (\d+)% of the (\d+) elements where the two "
    r"round differently"
)


def cast_failures(message):
    """``{dtype: (claimed, closer, share of closer, share of claimed, elements)}``, from the first
    line of each dtype."""
    found = {}
    for m in SHARES.findall(message):
        found.setdefault(m[0], (m[1], m[2], int(m[3]), int(m[4]), int(m[5])))
    return found


def likely(message):
    return message.splitlines()[1]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "fn, claimed, actual",
    [(after_scale, "before_scale", "after_scale"), (before_scale, "after_scale", "before_scale")],
)
def test_the_wrong_cast_order_fails_naming_it_torch(fn, claimed, actual, bias):
    spec = SPEC.replace(cast=claimed, bias=bias)
    with pytest.raises(AssertionError) as info:
        assert_conforms(fn, spec, backend="torch", params=True, grad=False, dtypes=HALVES,
                        shapes=((4, 256),))
    message = str(info.value)
    assert f"cast={actual!r}, not {claimed!r} (identify: cast {actual}: closer to" in likely(message)
    found = cast_failures(message)
    if bias and claimed == "after_scale":
        # the bias cancels y_hat w on some elements, where y_hat's rounding is many of y's ulps
        assert "rows near rounding ties: y: FAIL" in message
        return
    assert set(found) == set(HALVES), message
    for claim, closer, share, share_claimed, elements in found.values():
        assert (claim, closer) == (claimed, actual)
        assert share >= 90 and share_claimed <= 10 and elements >= 100


def test_an_after_scale_implementation_passes_the_ulp_bound_of_before_scale():
    """Why the rounding count is needed: the forward bound of before_scale (2 ulps) admits the
    other order, so only counting which order each element follows tells them apart."""
    spec = SPEC.replace(cast="before_scale")
    with pytest.raises(AssertionError) as info:
        assert_conforms(after_scale, spec, backend="torch", params=True, dtypes=HALVES,
                        shapes=((4, 256),))
    message = str(info.value)
    assert "FAIL" not in message
    assert set(cast_failures(message)) == set(HALVES)
    assert "rows near rounding ties: cast order" in message


@pytest.mark.parametrize("bias", [False, True])
def test_the_right_cast_order_passes_torch(bias):
    spec = SPEC.replace(bias=bias)
    assert_conforms(after_scale, spec, backend="torch", params=True, dtypes=HALVES)
    assert_conforms(before_scale, spec.replace(cast="before_scale"), backend="torch", params=True,
                    grad=False, dtypes=HALVES)


def test_the_cast_order_is_checked_with_the_gemma_offset():
    spec = SPEC.replace(scale_offset=1.0)

    def gemma(x, weight, bias):
        return (rms(x) * (1.0 + weight.float())).to(x.dtype)

    assert_conforms(gemma, spec, backend="torch", params=True, dtypes=HALVES, shapes=((4, 256),))
    with pytest.raises(AssertionError) as info:
        assert_conforms(gemma, spec.replace(cast="before_scale"), backend="torch", params=True,
                        dtypes=HALVES, shapes=((4, 256),))
    assert set(cast_failures(str(info.value))) == set(HALVES)


def test_the_wrong_cast_order_fails_in_jax():
    jnp = pytest.importorskip("jax.numpy")

    def y_hat(x):
        x32 = x.astype(jnp.float32)
        return x32 / jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)

    def jax_after(x, weight, bias):
        return (y_hat(x) * weight + bias).astype(x.dtype)

    def jax_before(x, weight, bias):
        return (y_hat(x).astype(x.dtype).astype(jnp.float32) * weight + bias).astype(x.dtype)

    after, before = SPEC.replace(bias=True), SPEC.replace(bias=True, cast="before_scale")
    kwargs = {"backend": "jax", "params": True, "grad": False, "dtypes": HALVES,
              "shapes": ((4, 256),)}
    assert_conforms(jax_after, after, **kwargs)
    assert_conforms(jax_before, before, **kwargs)
    wrong = ((jax_after, before, "after_scale"), (jax_before, after, "before_scale"))
    for fn, claimed, actual in wrong:
        with pytest.raises(AssertionError) as info:
            assert_conforms(fn, claimed, **kwargs)
        assert f"cast={actual!r}, not {claimed.cast!r}" in likely(str(info.value))


def test_without_params_a_claimed_before_scale_is_not_checked_and_a_warning_says_so():
    spec = SPEC.replace(cast="before_scale")
    with pytest.warns(UserWarning, match=r"rms_norm: cast='before_scale' is not checked: without "
                      r"params=True the parameters are at their initial values .* pass "
                      "params=True to check it"):
        assert_conforms(rms_norm, spec, backend="torch", dtypes=HALVES, shapes=((4, 256),))
    with warnings.catch_warnings():  # float32 only, or no scale and bias: nothing to warn about
        warnings.simplefilter("error")
        assert_conforms(rms_norm, spec, backend="torch", **F32)
        assert_conforms(rms_norm, spec.replace(scale=False), backend="torch", dtypes=HALVES,
                        shapes=((4, 256),))
        assert_conforms(rms_norm, SPEC, backend="torch", dtypes=HALVES, shapes=((4, 256),))
