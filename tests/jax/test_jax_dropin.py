"""normkit.jax's linen and NNX norms as drop-in replacements for Flax's RMSNorm and LayerNorm.

Modelled on Flax's own tests (tests/linen/linen_test.py NormalizationTest and
tests/nnx/nn/normalization_test.py TestLinenConsistency): the same constructor calls, attribute
reads and call conventions, compared with Flax's layers.

Tolerance: normkit and Flax evaluate the same formula in float32 but not the same program
(normkit rounds the fast variance's steps exactly and multiplies ``(x - mean) r`` by the scale;
Flax multiplies ``r`` by the scale first and XLA orders its sums freely), so outputs agree within
`normkit.tolerances`' forward bound for their dtype (1e-6 of max|y| in float32; 1 ulp in half
precision, where the final rounding can go the other way), not bit for bit. Initial parameters
come from the same initializers and keys and are compared exactly, as are normkit's linen and
NNX modules with each other (Flax's consistency test compares its own two exactly).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.jax import functional  # noqa: E402

KINDS = ["rms", "layer"]
FLAX_LINEN = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}
OURS_LINEN = {"rms": nkjax.RMSNorm, "layer": nkjax.LayerNorm}
FLAX_NNX = {"rms": nnx.RMSNorm, "layer": nnx.LayerNorm}
OURS_NNX = {"rms": nkjax.nnx.RMSNorm, "layer": nkjax.nnx.LayerNorm}
MASK = np.array([True, False, True, False, True])


def _x(shape=(10, 5), seed=0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


def _same(ours: jax.Array, theirs: jax.Array, what: str) -> None:
    """Same dtype and shape, NaN where Flax has NaN, values within the forward bound."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    tolerances.assert_close(np.asarray(ours), np.asarray(theirs), what=what)


def test_defaults_are_flax_defaults() -> None:
    fast_promoted = NormSpec("layer", variance="fast", output_dtype="promote")
    assert nkjax.LayerNorm().spec == fast_promoted
    assert nkjax.nnx.LayerNorm(8).spec == fast_promoted
    assert nkjax.RMSNorm().spec == NormSpec(output_dtype="promote")
    assert nkjax.nnx.RMSNorm(8).spec == NormSpec(output_dtype="promote")
    assert nkjax.LayerNorm(use_fast_variance=False).spec.variance == "two_pass"
    # An explicit normkit option wins over the Flax default it refines.
    assert nkjax.LayerNorm(variance="two_pass").spec.variance == "two_pass"
    assert nkjax.nnx.LayerNorm(8, output_dtype="input").spec.output_dtype == "input"
    # Flax's dtype: the output is that dtype, the spec's "input" with x cast to it.
    assert nkjax.RMSNorm(dtype=jnp.float32).spec.output_dtype == "input"
    assert nkjax.nnx.LayerNorm(8, dtype=jnp.bfloat16).spec.output_dtype == "input"


@pytest.mark.parametrize(
    "spec",
    [
        NormSpec("layer"),
        NormSpec("rms", output_dtype="promote", axis=(-2, -1)),
        NormSpec("layer", variance="fast", scale_offset=1.0, eps=1e-5),
        NormSpec("partial_rms", p=0.5),
        NormSpec("dyt"),
    ],
    ids=str,
)
def test_from_spec_builds_the_spec_given(spec: NormSpec) -> None:
    assert nkjax.from_spec(spec).spec == spec
    assert nkjax.from_spec(spec, dtype=jnp.bfloat16).spec == spec
    assert nkjax.nnx.from_spec(spec, (4, 8) if len(spec.axis) == 2 else 8).spec == spec


def test_flax_attribute_reads() -> None:
    kwargs = dict(
        epsilon=1e-5, dtype=jnp.float32, param_dtype=jnp.bfloat16, use_bias=False,
        reduction_axes=(-2, -1), feature_axes=-1, use_fast_variance=False,
    )
    theirs, ours = nnx.LayerNorm(6, rngs=nnx.Rngs(0), **kwargs), nkjax.nnx.LayerNorm(6, **kwargs)
    for name in [*kwargs, "num_features", "use_scale", "axis_name", "axis_index_groups"]:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.bias is None and theirs.bias is None
    linen_theirs, linen_ours = nn.LayerNorm(**kwargs), nkjax.LayerNorm(**kwargs)
    for name in kwargs:
        assert getattr(linen_ours, name) == getattr(linen_theirs, name), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.float16], ids=["pf32", "pf16"])
@pytest.mark.parametrize("use_fast_variance", [True, False], ids=["fast", "two_pass"])
@pytest.mark.parametrize("mask", [None, MASK], ids=["nomask", "mask"])
def test_linen_and_nnx_match_flax(kind, dtype, param_dtype, use_fast_variance, mask) -> None:
    """TestLinenConsistency's product, each normkit layer against Flax's own (the NNX one with
    its default promote_dtype, which casts x and the parameters to dtype), then normkit's linen
    against its NNX exactly where Flax's two compute the same. Linen gets x in ``dtype``: a wider x is refused (see
    test_linen_dtype_narrower_than_input_is_refused)."""
    x = _x()
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, use_fast_variance=use_fast_variance)
    theirs = FLAX_LINEN[kind](**kwargs)
    variables = theirs.init(jax.random.key(1), x)
    variables = jax.tree_util.tree_map(lambda p: p + 0.25 * _x(p.shape, 2).astype(p.dtype), variables)
    xd = x.astype(dtype)
    linen_out = OURS_LINEN[kind](**kwargs).apply(variables, xd, mask=mask)
    _same(linen_out, theirs.apply(variables, xd, mask=mask), f"linen {kind}")

    flax_nnx = FLAX_NNX[kind](5, rngs=nnx.Rngs(42), **kwargs)
    ours_nnx = OURS_NNX[kind](5, rngs=nnx.Rngs(42), **kwargs)
    nnx.update(flax_nnx, nnx.State(variables["params"]))
    nnx.update(ours_nnx, nnx.State(variables["params"]))
    nnx_out = ours_nnx(x, mask=mask)
    _same(nnx_out, flax_nnx(x, mask=mask), f"nnx {kind}")
    if jnp.promote_types(param_dtype, dtype) == dtype:
        # NNX casts the parameters to dtype (Flax's promote_dtype) where linen does not: the
        # same computation when that cast is exact.
        np.testing.assert_array_equal(ours_nnx(xd, mask=mask), linen_out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=["pf32", "pbf16"])
def test_default_dtype_promotes_as_flax(kind, x_dtype, param_dtype) -> None:
    """No ``dtype``: Flax returns the promoted dtype of x and the parameters, and so does
    normkit's default ``output_dtype="promote"``, in values too."""
    x = _x().astype(x_dtype)
    theirs = FLAX_LINEN[kind](param_dtype=param_dtype)
    variables = theirs.init(jax.random.key(1), x)
    variables = jax.tree_util.tree_map(lambda p: p + 0.25 * _x(p.shape, 2).astype(p.dtype), variables)
    expected = theirs.apply(variables, x)
    assert expected.dtype == jnp.promote_types(x_dtype, param_dtype)
    _same(OURS_LINEN[kind](param_dtype=param_dtype).apply(variables, x), expected, f"linen {kind}")

    flax_nnx = FLAX_NNX[kind](5, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    ours_nnx = OURS_NNX[kind](5, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    nnx.update(flax_nnx, nnx.State(variables["params"]))
    nnx.update(ours_nnx, nnx.State(variables["params"]))
    _same(ours_nnx(x), flax_nnx(x), f"nnx {kind}")


def test_linen_dtype_narrower_than_input_is_refused() -> None:
    """Flax linen normalizes float32 x and rounds to dtype; the spec has no such output dtype.
    The fix the message names is what Flax computes."""
    x = _x()
    theirs = nn.LayerNorm(dtype=jnp.float16)
    variables = theirs.init(jax.random.key(1), x)
    with pytest.raises(ValueError, match=r"LayerNorm\(dtype=float16\) got x of dtype float32: "
                       r"Flax normalizes .* \(norm\(x\)\.astype\(float16\) is what Flax computes\)"):
        nkjax.LayerNorm(dtype=jnp.float16).apply(variables, x)
    ours = nkjax.LayerNorm().apply(variables, x).astype(jnp.float16)
    _same(ours, theirs.apply(variables, x), "linen, output cast")
    # An explicit output_dtype makes dtype normkit's compute dtype: x rounded to it first.
    explicit = nkjax.LayerNorm(dtype=jnp.float16, output_dtype="input")
    y = explicit.apply(variables, x)
    tolerances.assert_close(y, reference.normalize(np.asarray(x, np.float16), explicit.spec))


@pytest.mark.parametrize("kind", KINDS)
def test_mask_as_flax_defines_it(kind: str) -> None:
    """Flax's mask tests: NaN outside the mask does not reach the statistics, the masked
    outputs have mean 0 and variance 1 (RMS: mean square 1), and equal Flax's."""
    key, mask_key = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key, (3, 4, 5))
    m = jax.random.choice(mask_key, 2, x.shape).astype(bool).at[..., :2].set(True)
    x = jnp.where(m, x, jnp.nan)
    ours = OURS_LINEN[kind]()
    y, variables = ours.init_with_output(jax.random.key(0), x, mask=m)
    theirs = FLAX_LINEN[kind]().apply(variables, x, mask=m)
    _same(y, theirs, kind)
    assert bool(jnp.all(jnp.isnan(y) == ~m))
    if kind == "layer":
        np.testing.assert_allclose(y.mean(-1, where=m), 0, atol=1e-4)
        np.testing.assert_allclose(y.var(-1, where=m), 1, atol=1e-4)
    else:
        np.testing.assert_allclose(jnp.square(y).mean(-1, where=m), 1, atol=1e-4)
    np.testing.assert_array_equal(OURS_NNX[kind](5)(x, mask=m), y)


def test_mask_gradient_matches_flax() -> None:
    x, m = _x(), jnp.asarray(MASK)
    variables = nn.LayerNorm().init(jax.random.key(1), x)

    def loss(module, params, x):
        return jnp.sum(jnp.sin(module.apply(params, x, mask=m)))

    ours = jax.grad(loss, argnums=(1, 2))(nkjax.LayerNorm(), variables, x)
    theirs = jax.grad(loss, argnums=(1, 2))(nn.LayerNorm(), variables, x)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        tolerances.assert_close(np.asarray(a), np.asarray(b), quantity="grad")


def test_custom_initializers_give_flax_initial_values() -> None:
    x = _x((2, 3, 4, 5))
    inits = dict(scale_init=nn.initializers.uniform(), bias_init=nn.initializers.normal(0.5))
    theirs = nn.LayerNorm(**inits).init(jax.random.key(1), x)
    ours = nkjax.LayerNorm(**inits).init(jax.random.key(1), x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, ours, theirs)
    assert float(jnp.std(ours["params"]["bias"])) > 0.1  # drawn, not the constant 0
    flax_nnx = nnx.LayerNorm(5, rngs=nnx.Rngs(3), **inits)
    ours_nnx = nkjax.nnx.LayerNorm(5, rngs=nnx.Rngs(3), **inits)
    np.testing.assert_array_equal(ours_nnx.scale[...], flax_nnx.scale[...])
    np.testing.assert_array_equal(ours_nnx.bias[...], flax_nnx.bias[...])


@pytest.mark.parametrize(
    "flax_kwargs",
    [
        dict(reduction_axes=(1, 2, 3)),  # Flax's LayerNorm vs GroupNorm(num_groups=1) case
        dict(reduction_axes=(1, 2, 3), feature_axes=(2, 3)),
        dict(reduction_axes=(-2, -1), feature_axes=(-2, -1)),
    ],
    ids=["features-last", "features-2", "equal"],
)
def test_reduction_and_feature_axes(flax_kwargs) -> None:
    x = _x((2, 3, 4, 5))
    inits = dict(scale_init=nn.initializers.uniform(), bias_init=nn.initializers.uniform())
    theirs = nn.LayerNorm(**flax_kwargs, **inits)
    ours = nkjax.LayerNorm(**flax_kwargs, **inits)
    variables = theirs.init(jax.random.key(1), x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, ours.init(jax.random.key(1), x), variables)
    _same(ours.apply(variables, x), theirs.apply(variables, x), str(flax_kwargs))
    assert ours.spec.axis == nkjax.LayerNorm(axis=flax_kwargs["reduction_axes"]).spec.axis


@pytest.mark.parametrize("reduction_axes", [-1, 1, (1, 2)])
def test_rms_reduction_axes_without_parameters(reduction_axes) -> None:
    """Flax's test_rms_norm: feature_axes (-1) need not be reduced when there is no scale."""
    x = _x((2, 3, 4))
    ours = nkjax.RMSNorm(use_scale=False, epsilon=1e-5, reduction_axes=reduction_axes)
    y, _ = ours.init_with_output(jax.random.key(0), x)
    theirs = nn.RMSNorm(use_scale=False, epsilon=1e-5, reduction_axes=reduction_axes)
    _same(y, theirs.apply({}, x), str(reduction_axes))
    _same(nkjax.nnx.RMSNorm(4, use_scale=False, epsilon=1e-5, reduction_axes=reduction_axes)(x),
          y, "nnx")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_swap_keeps_later_initial_weights(kind: str, use_bias: bool) -> None:
    """The norm draws one rngs.params() key per parameter, as Flax's does."""

    class Model(nnx.Module):
        def __init__(self, norm, rngs: nnx.Rngs) -> None:
            self.first = nnx.Linear(3, 5, rngs=rngs)
            kwargs = {"use_bias": use_bias} if kind == "layer" else {}
            self.norm = norm(5, rngs=rngs, **kwargs)
            self.last = nnx.Linear(5, 2, rngs=rngs)

    theirs, ours = Model(FLAX_NNX[kind], nnx.Rngs(0)), Model(OURS_NNX[kind], nnx.Rngs(0))
    np.testing.assert_array_equal(ours.last.kernel[...], theirs.last.kernel[...])
    np.testing.assert_array_equal(ours.first.kernel[...], theirs.first.kernel[...])
    # Without the key draws the later kernel would differ: this test can fail.
    assert not np.array_equal(Model(OURS_NNX[kind], nnx.Rngs(1)).last.kernel[...],
                              theirs.last.kernel[...])


def test_twenty_sgd_steps_track_flax() -> None:
    """Dense -> LayerNorm -> Dense trained 20 steps with plain SGD, once with each LayerNorm.

    The forward outputs agree within the float32 bound, and normkit's exact VJP differs from
    autodiff through Flax's formula by float32 roundings, so every parameter ends within
    `normkit.tolerances`' float32 gradient bound (1e-5 of its largest magnitude)."""

    class Model(nn.Module):
        norm: type[nn.Module]

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(3)(self.norm()(nn.Dense(16)(x)))

    x, target = _x((32, 8), 1), _x((32, 3), 2)

    def train(norm: type[nn.Module]) -> dict:
        model = Model(norm)
        params = model.init(jax.random.key(0), x)

        @jax.jit
        def step(params: dict) -> dict:
            grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - target) ** 2))(params)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

        for _ in range(20):
            params = step(params)
        return params

    ours, theirs = train(nkjax.LayerNorm), train(nn.LayerNorm)
    start = Model(nn.LayerNorm).init(jax.random.key(0), x)
    moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), theirs, start)
    assert min(jax.tree_util.tree_leaves(moved)) > 1e-3  # training changed every parameter
    paths = jax.tree_util.tree_leaves_with_path(ours)
    for (path, a), b in zip(paths, jax.tree_util.tree_leaves(theirs)):
        tolerances.assert_close(np.asarray(a), np.asarray(b), quantity="grad", what=str(path))


# --- errors ------------------------------------------------------------------------------------


def test_conflicting_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"axis=-2 and reduction_axes=\(1, 2\) conflict"):
        _ = nkjax.LayerNorm(axis=-2, reduction_axes=(1, 2)).spec
    with pytest.raises(ValueError, match=r"axis=\(1, 2\) and feature_axes=1 conflict"):
        nkjax.nnx.RMSNorm((3, 4), axis=(1, 2), feature_axes=1)
    assert nkjax.LayerNorm(axis=(1, 2), reduction_axes=(1, 2)).spec.axis == (1, 2)
    with pytest.raises(ValueError, match="variance='fast' and use_fast_variance=False conflict"):
        nkjax.nnx.LayerNorm(8, variance="fast", use_fast_variance=False)
    with pytest.raises(ValueError, match=r"axis_index_groups=\[\[0, 1\]\] is not supported"):
        _ = nkjax.RMSNorm(axis_index_groups=[[0, 1]]).spec


def test_feature_axes_errors() -> None:
    x = _x((2, 3, 4))
    with pytest.raises(ValueError, match=r"feature_axes=\(0,\) must be among the reduction axes \(-1,\)"):
        nkjax.LayerNorm(feature_axes=0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"feature_axes=\(5,\): axis 5 is out of range for an input of rank 3"):
        nkjax.RMSNorm(feature_axes=5, use_scale=False).init(jax.random.key(0), x)
    module = nkjax.nnx.LayerNorm(3, reduction_axes=(-2, -1), feature_axes=-2)
    with pytest.raises(ValueError, match=r"a parameter has shape \(3,\), but x of shape \(2, 5, 4\) has "
                       r"\(5,\) features over the feature axes \(1,\)"):
        module(_x((2, 5, 4)))


def test_mask_errors() -> None:
    x, m = _x(), MASK
    with pytest.raises(ValueError, match="mask applies to kind='rms' and 'layer'.*not 'partial_rms'"):
        nkjax.nnx.PartialRMSNorm(5, p=0.5)(x, mask=m)
    with pytest.raises(ValueError, match="mask applies to kind='rms' and 'layer'.*not 'dyt'"):
        nkjax.nnx.DyT(5)(x, mask=m)
    with pytest.raises(ValueError, match="mask with axis_name='i' is not supported"):
        functional.normalize(x, NormSpec(), mask=m, axis_name="i")
    with pytest.raises(ValueError, match=r"mask has shape \(3,\), which does not broadcast to x's shape \(10, 5\)"):
        nkjax.nnx.RMSNorm(5)(x, mask=np.ones(3, bool))
    with pytest.raises(ValueError, match="RMSNorm has residual='rounded': mask is supported without a residual"):
        nkjax.nnx.RMSNorm(5, residual="rounded")(x, x, mask=m)
    linen = nkjax.LayerNorm(residual="float32")
    with pytest.raises(ValueError, match="LayerNorm has residual='float32': mask is supported without"):
        linen.init(jax.random.key(0), x, x, mask=m)
    with pytest.raises(ValueError, match=r"Flax's mask is keyword-only here: layer\(x, mask=mask\)"):
        nkjax.nnx.RMSNorm(5)(x, m)


def test_initializer_without_rngs_is_refused() -> None:
    with pytest.raises(ValueError, match="LayerNorm: bias_init needs rngs to draw its key from"):
        nkjax.nnx.LayerNorm(5, bias_init=nn.initializers.normal())
    assert float(nkjax.nnx.LayerNorm(5).scale[...][0]) == 1.0  # constants need no rngs
