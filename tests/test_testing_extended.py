"""assert_conforms on the extended spec: an add-and-norm returning (y, h), DyT with its alpha,
and the two backward models: a Hugging Face Llama-style eager function trains like the
spec's ``backward="autograd"``, and is not as accurate as ``"exact"``."""

import pytest

from normkit import NormSpec
from normkit.testing import assert_conforms

torch = pytest.importorskip("torch")

EPS = 1e-6
SMALL = {"shapes": ((5, 7), (3, 64))}


def rms(x):
    """y_hat in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)


def add_rms_rounded(x, residual):
    """The sum rounded to the input dtype, and normalized: eager model code."""
    h = x + residual
    return rms(h).to(x.dtype), h


def add_rms_float32(x, residual):
    """The sum kept in float32 and returned in it."""
    h = x.float() + residual.float()
    return rms(h).to(x.dtype), h


def add_rms_params(x, residual, weight, bias):
    h = x + residual
    return (rms(h) * weight.float()).to(x.dtype), h


def dyt(x, weight, bias, alpha):
    """Dynamic Tanh: tanh in float32, the affine step in float32, one rounding."""
    y = torch.tanh(alpha.float() * x.float()) * weight.float() + bias.float()
    return y.to(x.dtype)


def hf_llama(x, weight, bias):
    """Hugging Face's LlamaRMSNorm.forward, eager."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return weight * h.to(input_dtype)


LLAMA = NormSpec("rms", eps=EPS, cast="before_scale")


def test_an_add_and_norm_conforms_to_its_rounding_of_the_sum():
    assert_conforms(add_rms_rounded, NormSpec(eps=EPS, residual="rounded"), backend="torch", **SMALL)
    assert_conforms(add_rms_float32, NormSpec(eps=EPS, residual="float32"), backend="torch", **SMALL)
    spec = NormSpec(eps=EPS, residual="rounded")
    assert_conforms(add_rms_params, spec, backend="torch", params=True, **SMALL)


def test_the_wrong_rounding_of_the_sum_is_named():
    with pytest.raises(AssertionError) as info:
        assert_conforms(add_rms_rounded, NormSpec(eps=EPS, residual="float32"), backend="torch",
                        dtypes=("bfloat16",), **SMALL)
    assert "bfloat16[5, 7]: h has dtype bfloat16, expected float32" in str(info.value)


def test_a_residual_function_must_return_y_and_h():
    with pytest.raises(AssertionError) as info:
        assert_conforms(lambda x, residual: rms(x + residual).to(x.dtype),
                        NormSpec(eps=EPS, residual="rounded"), backend="torch")
    assert "with residual='rounded' it must return (y, h), two torch.Tensors of the input's " \
        "shape" in str(info.value)
    with pytest.raises(AssertionError, match=r"returned h shape \(5, 1\) for an input"):
        assert_conforms(lambda x, residual: (rms(x).to(x.dtype), (x + residual)[:, :1]),
                        NormSpec(eps=EPS, residual="rounded"), backend="torch")


def test_dyt_conforms_with_its_alpha():
    assert_conforms(dyt, NormSpec("dyt"), backend="torch", params=True, **SMALL)
    spec = NormSpec("dyt", alpha_init=1.0, bias=False)
    assert_conforms(lambda x: torch.tanh(x.float()).to(x.dtype), spec, backend="torch", **SMALL)


def test_dyt_with_the_other_alpha_init_fails():
    with pytest.raises(AssertionError, match=r"y: FAIL"):
        assert_conforms(lambda x: torch.tanh(x.float()).to(x.dtype), NormSpec("dyt"),
                        backend="torch", dtypes=("float32",))


def test_dyt_alpha_without_a_gradient_fails_naming_dalpha():
    def frozen_alpha(x, weight, bias, alpha):
        return dyt(x, weight, bias, alpha.detach())

    with pytest.raises(AssertionError) as info:
        assert_conforms(frozen_alpha, NormSpec("dyt"), backend="torch", params=True,
                        dtypes=("float32",), shapes=((5, 7),))
    message = str(info.value)
    assert "float32[5, 7]: dalpha: FAIL [float32] error 1 max_abs / max|ref|" in message
    assert "dx:" not in message and "dscale:" not in message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hugging_face_llama_trains_as_the_autograd_model(dtype):
    # parameters in the input dtype, as the module after .to(dtype)
    spec = LLAMA.replace(backward="autograd")
    assert_conforms(hf_llama, spec, backend="torch", params=True, param_dtype="input",
                    dtypes=(dtype,))
    # float32 weights with half activations: the output promotes to float32
    assert_conforms(hf_llama, spec.replace(output_dtype="promote"), backend="torch",
                    params=True, dtypes=(dtype,))


def test_hugging_face_llama_is_not_the_exact_gradient():
    with pytest.raises(AssertionError) as info:
        assert_conforms(hf_llama, LLAMA, backend="torch", params=True, param_dtype="input",
                        dtypes=("bfloat16",))
    message = str(info.value)
    assert "bfloat16[4, 256]: dx: FAIL [bfloat16]" in message and "dscale: FAIL" in message
    assert "y: FAIL" not in message  # the forward is the spec's: only the backward rounds


def test_param_dtype_is_checked():
    with pytest.raises(ValueError, match="param_dtype='half' is invalid: expected 'input' or one "
                       "of float16, bfloat16, float32, float64"):
        assert_conforms(hf_llama, LLAMA, backend="torch", params=True, param_dtype="half")


def test_jax_and_tensorflow_add_and_norm_and_dyt():
    jnp = pytest.importorskip("jax.numpy")
    tf = pytest.importorskip("tensorflow")

    def jax_add_rms(x, residual):
        h = x.astype(jnp.float32) + residual.astype(jnp.float32)
        y = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + EPS)
        return y.astype(x.dtype), h

    def tf_dyt(x, weight, bias, alpha):
        y = tf.tanh(tf.cast(alpha, tf.float32) * tf.cast(x, tf.float32))
        return tf.cast(y * tf.cast(weight, tf.float32) + tf.cast(bias, tf.float32), x.dtype)

    small = {"dtypes": ("float32", "bfloat16"), "shapes": ((5, 7),)}
    assert_conforms(jax_add_rms, NormSpec(eps=EPS, residual="float32"), backend="jax", **small)
    assert_conforms(tf_dyt, NormSpec("dyt"), backend="tf", params=True, **small)
