"""normkit.jax with Flax's call-time ``mask``, against `normkit.reference.normalize(..., mask=)`
and `normalize_vjp(..., mask=)` under `normkit.tolerances` (forward and gradients, float32 and
bfloat16). test_jax_dropin.py compares the same calls with Flax's own layers."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402
from normkit.jax import functional as F  # noqa: E402

DTYPES = {"f32": np.float32, "bf16": dtypes.bfloat16}


def _mask(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random mask whose rows (over the last axis) read 0 (row 0), 1 (row 1), 2 (row 2) or
    about half of their elements."""
    m = rng.random(shape) < 0.5
    m[0] = False
    m[1] = False
    m[1, 3] = True
    m[2] = False
    m[2, [1, 4]] = True
    return m


def _check(spec, x, dy, m, y, grads, scale, bias) -> None:
    """``y`` and ``(dx, dscale, dbias)`` against the reference, NaN where it has NaN."""
    want = reference.normalize(x, spec, scale, bias, mask=m)
    magnitude = reference.scaled_magnitude(x, spec, scale) if spec.cast == "before_scale" else None
    tolerances.assert_close(np.asarray(y), want, cast=spec.cast, magnitude=magnitude, what="y")
    ref = reference.normalize_vjp(x, dy, spec, scale, bias, mask=m)
    for name, got, exp in zip(("dx", "dscale", "dbias"), grads, ref):
        if exp is not None:
            tolerances.assert_close(np.asarray(got), exp, quantity="grad", what=name)


def _module_case(kind: str, fast: bool, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (8, 12)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(DTYPES[dtype])
    dy = rng.standard_normal(shape).astype(DTYPES[dtype])
    scale = (1 + 0.5 * rng.standard_normal(12)).astype(DTYPES[dtype])
    bias = rng.standard_normal(12).astype(DTYPES[dtype]) if kind == "layer" else None
    kwargs = dict(param_dtype=x.dtype)
    if kind == "layer":
        kwargs["use_fast_variance"] = fast
    return x, dy, _mask(shape, rng), scale, bias, kwargs


CASES = [("rms", False), ("layer", True), ("layer", False)]
IDS = ["rms", "layer-fast", "layer-two_pass"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, fast", CASES, ids=IDS)
def test_linen_matches_reference(kind: str, fast: bool, dtype: str) -> None:
    x, dy, m, scale, bias, kwargs = _module_case(kind, fast, dtype)
    module = {"rms": nkjax.RMSNorm, "layer": nkjax.LayerNorm}[kind](**kwargs)
    params = {"scale": jnp.asarray(scale)} | ({} if bias is None else {"bias": jnp.asarray(bias)})
    variables = {"params": params}
    apply = jax.jit(lambda v, x: module.apply(v, x, mask=m))
    y, vjp = jax.vjp(apply, variables, jnp.asarray(x))
    dvars, dx = vjp(jnp.asarray(dy, y.dtype))
    grads = (dx, dvars["params"]["scale"], dvars["params"].get("bias"))
    _check(module.spec, x, dy, m, y, grads, scale, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, fast", CASES, ids=IDS)
def test_nnx_matches_reference(kind: str, fast: bool, dtype: str) -> None:
    x, dy, m, scale, bias, kwargs = _module_case(kind, fast, dtype, seed=1)
    module = {"rms": nkjax.nnx.RMSNorm, "layer": nkjax.nnx.LayerNorm}[kind](12, **kwargs)
    nnx.update(module, nnx.State({"scale": scale} | ({} if bias is None else {"bias": bias})))

    def loss(module, x):
        return jnp.sum(jnp.asarray(dy, jnp.float32) * module(x, mask=m).astype(jnp.float32))

    y = module(jnp.asarray(x), mask=m)
    dmodule, dx = nnx.grad(loss, argnums=(0, 1))(module, jnp.asarray(x))
    grads = (dx, dmodule.scale[...], None if bias is None else dmodule.bias[...])
    _check(module.spec, x, dy, m, y, grads, scale, bias)


SPECS = [
    NormSpec(eps_placement="outside", eps=1e-3, scale_offset=1.0),
    NormSpec("layer", axis=(-2, -1), bias=False),
    NormSpec(cast="before_scale", axis=0),
    NormSpec("layer", variance="fast", eps_placement="outside", eps=1e-5),
    NormSpec(backward="autograd", cast="before_scale"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_functional_spec_options_with_a_broadcast_mask(spec: NormSpec, dtype: str) -> None:
    """Several axes, eps outside, an offset, the before-scale cast and the autograd rounding
    model, with a mask broadcast over the batch (one shape per row) and one per element."""
    rng = np.random.default_rng(2)
    shape = (6, 5, 8)
    x = rng.standard_normal(shape).astype(DTYPES[dtype])
    dy = rng.standard_normal(shape).astype(DTYPES[dtype])
    p_shape = spec.param_shape(shape)
    scale = rng.standard_normal(p_shape).astype(DTYPES[dtype])
    bias = rng.standard_normal(p_shape).astype(DTYPES[dtype]) if spec.bias else None
    for m in (rng.random(shape[1:]) < 0.6, rng.random(shape) < 0.7):
        f = jax.jit(lambda x, w, b, m=m: F.normalize(x, spec, w, b, mask=m))
        y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(scale), None if bias is None else jnp.asarray(bias))
        _check(spec, x, dy, m, y, vjp(jnp.asarray(dy)), scale, bias)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_large_mean_rows_match_the_reference(kind: str) -> None:
    """x = 1e4 + N(0, 1) in float32: the masked statistic has the unmasked path's two-pass
    correction and exactly rounded fast moments, so both variances stay within the bound (the
    fast one against its own rounding model)."""
    rng = np.random.default_rng(3)
    x = (1e4 + rng.standard_normal((16, 64))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    m = rng.random(x.shape) < 0.5
    variances = ["two_pass", "fast"] if kind == "layer" else ["two_pass"]
    for variance in variances:
        spec = NormSpec(kind, variance=variance, scale=False, bias=False)
        y, vjp = jax.vjp(lambda x, spec=spec: F.normalize(x, spec, mask=m), jnp.asarray(x))
        _check(spec, x, dy, m, y, (*vjp(jnp.asarray(dy)), None, None), None, None)


@pytest.mark.parametrize("kind, picked", [("rms", 1), ("layer", 2)])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_degenerate_rows_keep_their_small_gradient(kind: str, picked: int, placement: str) -> None:
    """One element read (RMS) or two (LayerNorm), dy zero elsewhere: the masked-in gradient is
    about eps r^3 of r, what the sums over the row would lose in float32 cancellation."""
    spec = NormSpec(kind, eps=1e-6, eps_placement=placement)
    x = np.array([[1.5, -0.5, 3.0, 2.0]], np.float32)
    dy = np.array([[0.7, -0.2 if picked == 2 else 0.0, 0.0, 0.0]], np.float32)
    m = np.array([[True, picked == 2, False, False]])
    y, vjp = jax.vjp(lambda x: F.normalize(x, spec, mask=m), jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(dy))
    want = reference.normalize_vjp(x, dy, spec, mask=m).dx
    assert 0 < np.abs(want).max() < 1e-4
    tolerances.assert_close(np.asarray(dx), want, quantity="grad")


def test_all_true_mask_is_the_unmasked_norm() -> None:
    """The same function (the reference's are equal exactly); the masked program sums in
    another order, so within the forward bound rather than bit for bit."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 6)).astype(np.float32))
    for spec in (NormSpec(), NormSpec("layer"), NormSpec("layer", variance="fast")):
        unmasked = np.asarray(F.normalize(x, spec))
        tolerances.assert_close(np.asarray(F.normalize(x, spec, mask=np.ones(6, bool))), unmasked)


def test_numeric_masks_mean_nonzero_as_in_flax() -> None:
    """Flax takes any numeric mask, nonzero meaning True; so does normkit, and nothing else."""
    x = jnp.ones((3, 5)) + jnp.arange(5.0)
    for numbers in (np.array([1, 0, 3, 0, 1]), np.array([1.0, 0.0, 0.5, 0.0, 1.0])):
        np.testing.assert_array_equal(F.normalize(x, NormSpec(), mask=numbers),
                                      F.normalize(x, NormSpec(), mask=numbers != 0))
        flax_ln = nn.LayerNorm()
        params = flax_ln.init(jax.random.key(0), x)
        tolerances.assert_close(np.asarray(F.normalize(x, NormSpec("layer"), mask=numbers)),
                                np.asarray(flax_ln.apply(params, x, mask=jnp.asarray(numbers))),
                                what="float mask against flax.linen.LayerNorm")



NOT_ARRAYS = [pytest.param("abc", id="str"), pytest.param(object(), id="object"),
              pytest.param(b"x", id="bytes")]


@pytest.mark.parametrize("mask", NOT_ARRAYS)
@pytest.mark.parametrize("api", ["functional", "jit", "linen", "nnx"])
def test_a_mask_that_is_no_array_is_a_type_error_naming_the_mask(api: str, mask: object) -> None:
    """The documented TypeError naming the mask, not JAX's own about an unnamed 'Value'."""
    x = jnp.ones((2, 4))
    calls = {
        "functional": lambda: F.normalize(x, NormSpec(), mask=mask),
        "jit": lambda: jax.jit(lambda x: F.normalize(x, NormSpec(), mask=mask))(x),
        "linen": lambda: nkjax.RMSNorm().init(jax.random.key(0), x, mask=mask),
        "nnx": lambda: nkjax.nnx.RMSNorm(4)(x, mask=mask),
    }
    with pytest.raises(TypeError, match="^mask must be an array of numbers or bools"):
        calls[api]()


@pytest.mark.parametrize("name", ["x", "scale", "bias", "alpha", "residual"])
def test_other_arguments_that_are_no_arrays_name_themselves(name: str) -> None:
    x, ones = jnp.ones((2, 4)), jnp.ones(4)
    calls = {
        "x": lambda: F.normalize("abc", NormSpec()),  # type: ignore[arg-type]
        "scale": lambda: F.normalize(x, NormSpec(), "abc"),  # type: ignore[arg-type]
        "bias": lambda: F.normalize(x, NormSpec(bias=True), ones, "abc"),  # type: ignore[arg-type]
        "alpha": lambda: F.normalize(x, NormSpec("dyt"), alpha="abc"),  # type: ignore[arg-type]
        "residual": lambda: F.add_norm(x, "abc", NormSpec(residual="rounded")),  # type: ignore[arg-type]
    }
    with pytest.raises(TypeError, match=f"^{name} must be an array of numbers or bools"):
        calls[name]()
    for module in (nkjax.RMSNorm(), nkjax.nnx.RMSNorm(4)):
        with pytest.raises(TypeError, match="^x must be an array of numbers or bools"):
            module.init(jax.random.key(0), "abc") if isinstance(module, nn.Module) else module("abc")


def _huge_masked_out() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``(x, mask, dy, scale)``: four rows, the first three each with one value masked
    out near float32's largest (3e38, -3.3e38, 3e38; in columns of their own, so that the
    scale's gradient sums one of them per column). Rows 0 and 1 read values of size 1.5
    (``r`` about 0.7: ``y_hat`` about 2e38 there); row 2 reads values of size 0.6, so that the
    huge value's ``y_hat`` (about 5e38) exceeds float32, as the reference's ``y`` does there.
    The masked-in elements' ``dx`` (``z_i sum_j d_j y_hat_j / K``) is about 1e37, finite."""
    rng = np.random.default_rng(38)
    x = rng.standard_normal((4, 16)) * np.array([1.5, 1.5, 0.6, 1.0])[:, None]
    mask = np.ones(x.shape, bool)
    for row, (column, value) in enumerate(((5, 3e38), (9, -3.3e38), (13, 3e38))):
        x[row, column], mask[row, column] = value, False
    dy = rng.standard_normal(x.shape)
    scale = 1 + 0.1 * rng.standard_normal(16)
    return x.astype(np.float32), mask, dy.astype(np.float32), scale.astype(np.float32)


@pytest.mark.parametrize("implementation", ["xla", "xla-eager", "pallas"])
@pytest.mark.parametrize("spec", [
    NormSpec(), NormSpec(eps_placement="outside"), NormSpec("layer"),
    NormSpec("layer", eps=1e-5, eps_placement="outside"), NormSpec("layer", variance="fast"),
], ids=["rms", "rms-outside", "layer", "layer-outside", "layer-fast"])
def test_a_huge_value_masked_out_keeps_the_gradients_finite(spec, implementation) -> None:
    """A value near 3e38 masked out: the masked-in elements' dx overflowed (the Pallas kernels
    and the XLA program formed ``z_i sum_j d_j y_hat_j`` before dividing by K, and the huge
    value's ``y_hat`` itself where it exceeds float32), where the reference's is about 1e37."""
    from normkit.jax import pallas

    x, mask, dy, scale = _huge_masked_out()

    def run(x, scale):
        return F.normalize(x, spec, scale, mask=mask,
                           implementation="pallas" if implementation == "pallas" else "xla")

    fn = run if implementation == "xla-eager" else jax.jit(run)
    with pallas.interpreted():
        y, vjp = jax.vjp(fn, x, scale)
        dx, dscale = vjp(jnp.asarray(dy))
    want = reference.normalize(x, spec, scale, mask=mask)
    grads = reference.normalize_vjp(x, dy, spec, scale, mask=mask)
    for row in range(4):
        tolerances.assert_close(np.asarray(y)[row], want[row], what=f"y, row {row}")
        tolerances.assert_close(np.asarray(dx)[row], grads.dx[row], quantity="grad",
                                what=f"dx, row {row}")
    # Column 13's dy y_hat is beyond float32 in row 2, where the reference sums it in float64.
    columns = np.arange(16) != 13
    tolerances.assert_close(np.asarray(dscale)[columns], grads.dscale[columns], quantity="grad",
                            what="dscale")
