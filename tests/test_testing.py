"""normkit.testing.assert_conforms: passes right implementations, names what is wrong otherwise."""

import pytest

from normkit import NormSpec
from normkit.testing import assert_conforms

torch = pytest.importorskip("torch")

SPEC = NormSpec("rms", eps=1e-5)


def rms_norm(x, eps=1e-5):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eps_outside(x):
    x32 = x.float()
    return (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5)).to(x.dtype)


def subtracts_mean(x):
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=1e-5).to(x.dtype)


def llama_order(x, weight, bias):
    return weight.to(x.dtype) * rms_norm(x)  # rounds the normalized value before the weight


def gemma_order(x, weight, bias):
    return (rms_norm(x.float()) * weight.float()).to(x.dtype)


def test_a_correct_implementation_passes():
    assert_conforms(rms_norm, SPEC, backend="torch")
    assert_conforms(gemma_order, SPEC, backend="torch", params=True)
    # forward only: autograd through the bfloat16 rounding is not the exact function's gradient
    assert_conforms(llama_order, SPEC.replace(cast="before_scale"), backend="torch", params=True, grad=False)


def test_eps_outside_the_sqrt_fails_with_figures():
    with pytest.raises(AssertionError) as info:
        assert_conforms(eps_outside, SPEC, backend="torch")
    message = str(info.value)
    assert message.startswith("eps_outside does not conform to NormSpec('rms', eps=1e-05) in ")
    assert message.splitlines()[1] == (
        "Likely difference (identify's reading of eps_outside): eps_placement='outside', not "
        "'inside' (identify: eps 1e-05 (outside the sqrt))"
    )
    assert "float32[" in message and "y: FAIL [float32]" in message and "(bound 1e-06)" in message


def test_mean_subtraction_fails():
    with pytest.raises(AssertionError) as info:
        assert_conforms(subtracts_mean, SPEC, backend="torch")
    assert str(info.value).splitlines()[1].startswith(
        "Likely difference (identify's reading of subtracts_mean): kind='layer', not 'rms'"
    )


def test_wrong_cast_order_fails_in_half_precision():
    with pytest.raises(AssertionError) as info:
        assert_conforms(llama_order, SPEC, backend="torch", params=True, dtypes=("bfloat16", "float16"), grad=False)
    message = str(info.value)
    assert "y: FAIL [bfloat16]" in message or "y: FAIL [float16]" in message
    assert "ulp (bound 1)" in message


def test_dtype_promotion_is_named():
    with pytest.raises(AssertionError, match="y has dtype float32, expected bfloat16"):
        assert_conforms(lambda x: rms_norm(x).float(), SPEC, backend="torch", dtypes=("bfloat16",))


def test_other_frameworks_through_their_bridges():
    jnp = pytest.importorskip("jax.numpy")
    tf = pytest.importorskip("tensorflow")

    def jax_rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)

    def tf_rms(x):
        x32 = tf.cast(x, tf.float32)
        return tf.cast(x32 * tf.math.rsqrt(tf.reduce_mean(x32 * x32, axis=-1, keepdims=True) + 1e-5), x.dtype)

    assert_conforms(jax_rms, SPEC, backend="jax")
    assert_conforms(tf_rms, SPEC, backend="tf")
    with pytest.raises(AssertionError, match="does not conform"):
        assert_conforms(jax_rms, SPEC.replace(kind="layer", bias=False), backend="jax")
    with pytest.raises(ValueError, match="unknown backend 'mxnet'"):
        assert_conforms(jax_rms, SPEC, backend="mxnet")
