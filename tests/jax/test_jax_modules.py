"""The linen and NNX modules: spec, from_spec, init, Flax parameter loading, dtypes, errors."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402

SPECS = [
    NormSpec(),
    NormSpec(kind="partial_rms", p=0.125, eps=1e-8, eps_placement="outside", bias=True),
    NormSpec(kind="layer", eps=1e-5, axis=(-2, -1), scale_offset=1.0, cast="before_scale"),
    NormSpec(kind="layer", scale=False, bias=False),
]


def _x(shape=(4, 3, 16), dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_from_spec_round_trips_and_initialises(spec: NormSpec) -> None:
    x = _x()
    linen = nkjax.from_spec(spec)
    assert linen.spec == spec
    params = linen.init(jax.random.key(0), x).get("params", {})
    shape = spec.param_shape(x.shape)
    assert set(params) == {n for n, on in (("scale", spec.scale), ("bias", spec.bias)) if on}
    if spec.scale:
        np.testing.assert_array_equal(params["scale"], np.full(shape, spec.scale_init, np.float32))
    if spec.bias:
        np.testing.assert_array_equal(params["bias"], np.zeros(shape, np.float32))
    tolerances.assert_close(linen.apply({"params": params} if params else {}, x), reference.normalize(x, spec))

    module = nkjax.nnx.from_spec(spec, shape, rngs=nnx.Rngs(0))
    assert module.spec == spec
    state = nnx.state(module, nnx.Param)
    for name in params:
        np.testing.assert_array_equal(state[name][...], params[name])
    tolerances.assert_close(module(x), reference.normalize(x, spec))


def test_constructors_follow_the_spec_defaults() -> None:
    # The Flax defaults (fast variance, promoted output) are the spec's with these two options.
    spec_defaults = dict(output_dtype="input")
    layer_defaults = dict(output_dtype="input", use_fast_variance=False)
    assert nkjax.RMSNorm(**spec_defaults).spec == NormSpec()
    assert nkjax.LayerNorm(**layer_defaults).spec == NormSpec(kind="layer")
    assert nkjax.PartialRMSNorm(p=0.5, **spec_defaults).spec == NormSpec(kind="partial_rms", p=0.5)
    assert nkjax.nnx.RMSNorm(8, **spec_defaults).spec == NormSpec()
    assert nkjax.nnx.LayerNorm(8, **layer_defaults).spec == NormSpec(kind="layer")
    assert nkjax.nnx.PartialRMSNorm(8, p=0.5, **spec_defaults).spec == NormSpec(kind="partial_rms", p=0.5)
    assert nkjax.LayerNorm(epsilon=1e-5, use_bias=False, axis=(1, 2), **layer_defaults).spec == NormSpec(
        kind="layer", eps=1e-5, bias=False, axis=(1, 2)
    )



def test_nnx_modules_take_the_kind_defaults_and_refuse_another_kind_s_fields() -> None:
    # Flax's use_bias defaults: False for the RMS kinds, True for LayerNorm; p is partial RMS's.
    assert nkjax.nnx.RMSNorm(8).bias is None and nkjax.nnx.PartialRMSNorm(8, p=0.5).bias is None
    assert nkjax.nnx.LayerNorm(8).bias is not None
    assert nkjax.nnx.LayerNorm(8, use_bias=False).bias is None
    with pytest.raises((TypeError, ValueError), match="p"):
        nkjax.nnx.PartialRMSNorm(8)
    with pytest.raises((TypeError, ValueError), match="p"):
        nkjax.nnx.RMSNorm(8, p=0.5)
    with pytest.raises((TypeError, ValueError), match="variance"):
        nkjax.nnx.RMSNorm(8, variance="fast")

@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16], ids=str)
def test_no_silent_promotion_unlike_flax(dtype: np.dtype) -> None:
    """Half input with float32 params: with output_dtype="input" normkit returns the input
    dtype, flax float32."""
    x = _x(dtype=dtype)
    ours = nkjax.LayerNorm(output_dtype="input")
    y = ours.apply(ours.init(jax.random.key(0), x), x)
    assert y.dtype == dtype
    tolerances.assert_close(np.asarray(y), reference.normalize(x, ours.spec))
    module = nkjax.nnx.RMSNorm(16, output_dtype="input")
    assert module(x).dtype == dtype
    theirs = nn.LayerNorm()
    assert theirs.apply(theirs.init(jax.random.key(0), x), x).dtype == jnp.float32


def test_dtype_and_param_dtype() -> None:
    x = _x()
    module = nkjax.RMSNorm(
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, use_bias=True, output_dtype="input"
    )
    params = module.init(jax.random.key(0), x)
    assert {v.dtype for v in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    y = module.apply(params, x)
    assert y.dtype == jnp.bfloat16
    tolerances.assert_close(np.asarray(y), reference.normalize(x.astype(dtypes.bfloat16), module.spec))
    n = nkjax.nnx.LayerNorm(16, dtype=jnp.float16, param_dtype=jnp.float16)
    assert n.scale[...].dtype == jnp.float16 and n(x).dtype == jnp.float16


def _perturbed(params, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: p + rng.standard_normal(p.shape).astype(p.dtype), params)


@pytest.mark.parametrize(
    "theirs, ours",
    [
        (nn.RMSNorm(), nkjax.RMSNorm()),
        (nn.RMSNorm(epsilon=1e-5, use_scale=False), nkjax.RMSNorm(epsilon=1e-5, use_scale=False)),
        (nn.LayerNorm(), nkjax.LayerNorm()),
        (nn.LayerNorm(use_fast_variance=False, use_bias=False), nkjax.LayerNorm(use_bias=False)),
        (
            nn.LayerNorm(epsilon=1e-3, reduction_axes=(-2, -1), feature_axes=(-2, -1)),
            nkjax.LayerNorm(epsilon=1e-3, axis=(-2, -1)),
        ),
    ],
    ids=["rms", "rms-no-scale", "layer", "layer-no-bias", "layer-2-axes"],
)
def test_flax_linen_params_load_with_equal_outputs(theirs: nn.Module, ours: nkjax.RMSNorm) -> None:
    x = _x()
    params = _perturbed(theirs.init(jax.random.key(0), x))
    expected = theirs.apply(params, x)
    got = ours.apply(params, x)
    tolerances.assert_close(got, expected)
    p = params.get("params", {})
    tolerances.assert_close(got, reference.normalize(x, ours.spec, p.get("scale"), p.get("bias")))


@pytest.mark.parametrize(
    "theirs, ours",
    [
        (lambda: nnx.RMSNorm(16, rngs=nnx.Rngs(0)), lambda: nkjax.nnx.RMSNorm(16)),
        (lambda: nnx.LayerNorm(16, rngs=nnx.Rngs(0)), lambda: nkjax.nnx.LayerNorm(16)),
    ],
    ids=["rms", "layer"],
)
def test_flax_nnx_state_loads_with_equal_outputs(theirs, ours) -> None:
    x = _x()
    flax_module, module = theirs(), ours()
    nnx.update(flax_module, _perturbed(nnx.state(flax_module, nnx.Param)))
    nnx.update(module, nnx.state(flax_module, nnx.Param))
    tolerances.assert_close(module(x), flax_module(x))
    tolerances.assert_close(
        module(x),
        reference.normalize(
            x, module.spec, module.scale[...], None if module.bias is None else module.bias[...]
        ),
    )


def test_nnx_trains_under_jit() -> None:
    """nnx.grad through the custom VJP: the parameter gradients are the reference's."""
    x, dy = _x(), _x(seed=3)
    module = nkjax.nnx.LayerNorm(16, scale_offset=1.0)

    @nnx.jit
    def grads(m):
        return nnx.grad(lambda m: jnp.sum(m(x) * dy))(m)

    g = grads(module)
    _, rdw, rdb = reference.normalize_vjp(x, dy, module.spec, module.scale[...], module.bias[...])
    tolerances.assert_close(g["scale"][...], rdw, quantity="grad")
    tolerances.assert_close(g["bias"][...], rdb, quantity="grad")


def test_wrong_feature_size_at_apply_time() -> None:
    module = nkjax.LayerNorm()
    params = module.init(jax.random.key(0), _x((2, 8)))
    with pytest.raises(ValueError, match=r"LayerNorm: x of shape \(2, 9\) has \(9,\) features over axis \(-1,\), but the layer's 'scale' has shape \(8,\)"):
        module.apply(params, _x((2, 9)))
    with pytest.raises(ValueError, match=r"scale has shape \(8,\), but x of shape \(2, 9\).*needs \(9,\)"):
        nkjax.nnx.RMSNorm(8)(_x((2, 9)))


def test_axis_out_of_range_and_integer_input() -> None:
    with pytest.raises(ValueError, match="axis 3 is out of range for an input of rank 2"):
        nkjax.RMSNorm(axis=3).init(jax.random.key(0), _x((2, 8)))
    with pytest.raises(ValueError, match="axis -4 is out of range for an input of rank 3"):
        nkjax.nnx.RMSNorm(8, axis=-4)(_x((2, 3, 8)))
    with pytest.raises(TypeError, match="x has dtype int32; normkit norms need a floating-point input"):
        nkjax.nnx.LayerNorm(8)(jnp.ones((2, 8), jnp.int32))
    with pytest.raises(TypeError, match="x has dtype int32"):
        nkjax.LayerNorm().init(jax.random.key(0), jnp.ones((2, 8), jnp.int32))


def test_invalid_options_are_reported() -> None:
    with pytest.raises(ValueError, match="kind='partial_rms' needs a fraction"):
        nkjax.PartialRMSNorm().init(jax.random.key(0), _x((2, 8)))
    with pytest.raises(ValueError, match=r"shape=\(8, 2\) must give one positive size per normalized axis \(-1,\)"):
        nkjax.nnx.RMSNorm((8, 2))
    with pytest.raises(ValueError, match="shape=0 must give one positive size"):
        nkjax.nnx.LayerNorm(0)


@pytest.mark.parametrize("blocked", ["jax", "flax"])
def test_missing_framework_names_the_extra(blocked: str) -> None:
    import subprocess
    import sys

    code = f"import sys; sys.modules[{blocked!r}] = None; import normkit; import normkit.jax"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: normkit.jax needs JAX and Flax: pip install 'normkit[jax]'" in done.stderr
