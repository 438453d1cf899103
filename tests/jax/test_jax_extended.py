"""normkit.jax on the extended spec (residual, fast variance, offset dtype, promotion, DyT, the
autograd backward): every output of the conformance hook against the reference, the DyT modules'
parameters, and the errors of residual and alpha arguments."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normkit.jax as nkjax  # noqa: E402
from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402
from normkit.conformance import targets_jax as conformance  # noqa: E402
from normkit.jax import functional as F  # noqa: E402

BF16, F16, F32, F64 = dtypes.bfloat16, dtypes.float16, dtypes.float32, dtypes.float64


def _inputs(spec: NormSpec, dtype: np.dtype, param_dtype: np.dtype, shape: tuple[int, ...], seed: int):
    """x, dy, scale, bias and the keyword inputs (residual, dh, alpha) drawn as conformance does."""
    rng = np.random.default_rng(seed)
    x = dtypes.round_to(rng.standard_normal(shape), dtype)
    dy = dtypes.round_to(rng.standard_normal(shape), dtype)
    pshape = spec.param_shape(shape)
    scale = dtypes.round_to(spec.scale_init + 0.1 * rng.standard_normal(pshape), param_dtype) if spec.scale else None
    bias = dtypes.round_to(0.1 * rng.standard_normal(pshape), param_dtype) if spec.bias else None
    extra: dict[str, np.ndarray] = {}
    if spec.residual is not None:
        extra["residual"] = dtypes.round_to(rng.standard_normal(shape), dtype)
        kept = spec.residual == "float32" and dtypes.is_half(dtype)
        extra["dh"] = dtypes.round_to(rng.standard_normal(shape), F32 if kept else dtype)
    if spec.kind == "dyt":
        assert spec.alpha_init is not None
        extra["alpha"] = dtypes.round_to(spec.alpha_init * (1 + 0.1 * rng.standard_normal(1)), param_dtype)
    return x, dy, scale, bias, extra


def _expected(spec: NormSpec, x, dy, scale, bias, extra) -> dict[str, np.ndarray | None]:
    alpha = extra.get("alpha")
    if spec.residual is None:
        found = {"y": reference.normalize(x, spec, scale, bias, alpha)}
        found.update(reference.normalize_vjp(x, dy, spec, scale, bias, alpha)._asdict())
    else:
        residual, dh = extra["residual"], extra["dh"]
        y, h = reference.add_normalize(x, residual, spec, scale, bias, alpha)
        found = {"y": y, "h": h}
        found.update(reference.add_normalize_vjp(x, residual, dy, dh, spec, scale, bias, alpha)._asdict())
    if spec.kind == "dyt":
        found["dalpha"] = np.asarray(found["dalpha"]).reshape(1)
    return found


def check(
    spec: NormSpec,
    dtype: np.dtype,
    api: str = "functional",
    param_dtype: np.dtype = F32,
    shape: tuple[int, ...] = (4, 48),
    seed: int = 0,
    jit: bool = True,
) -> None:
    """evaluate() against the reference: every quantity, in its dtype, within the tolerances."""
    x, dy, scale, bias, extra = _inputs(spec, dtype, param_dtype, shape, seed)
    outputs = conformance.evaluate(spec, x, dy, scale, bias, api=api, jit=jit, **extra)
    names = ["y", "dx", "dscale", "dbias"]
    names += ["h", "dresidual"] if spec.residual is not None else []
    names += ["dalpha"] if spec.kind == "dyt" else []
    assert len(outputs) == len(names)
    expected = _expected(spec, x, dy, scale, bias, extra)
    half_cast = dtypes.is_half(dtype) and spec.cast == "before_scale"
    for name, got in zip(names, outputs):
        want = expected[name]
        assert (got is None) == (want is None), name
        if got is None:
            continue
        if name in ("y", "h") or spec.backward == "autograd":
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        measured, magnitude = got.dtype, None
        if name == "y" and half_cast:
            values = x.astype(np.float64) + extra.get("residual", np.zeros(shape)).astype(np.float64)
            measured, magnitude = dtype, reference.scaled_magnitude(values, spec, scale, extra.get("alpha"))
        if name in ("dx", "dresidual") and spec.residual is not None:
            magnitude = np.abs(extra["dh"].astype(np.float64))  # dh + dnorm may cancel
        tolerances.assert_close(
            got, want, measured, "forward" if name in ("y", "h") else "grad",
            spec.cast if name == "y" else "after_scale", f"{spec} {api} {name}", magnitude,
        )


FIELDS = [
    (NormSpec("layer", variance="fast"), F32),
    (NormSpec(scale_offset=1.0, offset_dtype="param", cast="before_scale"), BF16),
    (NormSpec(output_dtype="promote", bias=True), F32),
    (NormSpec("dyt"), F32),
    (NormSpec(residual="rounded"), F32),
    (NormSpec("layer", residual="float32"), F32),
    (NormSpec("partial_rms", p=0.5, residual="float32_normalized", cast="before_scale"), F32),
    (NormSpec(backward="autograd", cast="before_scale"), F32),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("spec, param_dtype", FIELDS, ids=[str(s) for s, _ in FIELDS])
def test_each_field_through_the_functional_api(spec: NormSpec, param_dtype: np.dtype, dtype: np.dtype) -> None:
    check(spec, dtype, param_dtype=param_dtype)


@pytest.mark.parametrize(
    "spec", [NormSpec("layer", variance="fast", residual="float32", bias=True), NormSpec("dyt", cast="before_scale")], ids=str
)
def test_float64_runs_in_float64(spec: NormSpec) -> None:
    check(spec, F64)


MODULE_SPECS = [
    NormSpec(
        "layer", variance="fast", residual="rounded", output_dtype="promote", scale_offset=1.0,
        offset_dtype="param", backward="autograd", cast="before_scale",
    ),
    NormSpec("dyt", alpha_init=1.0, residual="float32", output_dtype="promote"),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("spec", MODULE_SPECS, ids=["layer", "dyt"])
def test_modules_on_every_field(spec: NormSpec, api: str) -> None:
    check(spec, BF16, api=api, param_dtype=BF16 if spec.kind == "layer" else F32)


def test_eager_call() -> None:
    check(NormSpec("layer", variance="fast", residual="rounded", bias=True), BF16, jit=False)


def test_autograd_backward_is_the_eager_model_not_the_exact_one() -> None:
    """bfloat16 Llama RMSNorm with float32 weights (float32 out): dx equals the reference's
    autograd model bit for bit (dscale, a float32 sum, within its bound) and misses the exact
    VJP by far more than its bound."""
    spec = NormSpec(eps=1e-5, cast="before_scale", backward="autograd", output_dtype="promote")
    x, dy, scale, _, _ = _inputs(spec, BF16, F32, (16, 256), seed=3)
    y, dx, dscale, _ = conformance.evaluate(spec, x, dy, scale)
    model = reference.normalize_vjp(x, dy.astype(y.dtype), spec, scale)
    np.testing.assert_array_equal(dx, model.dx)
    tolerances.assert_close(dscale, model.dscale, quantity="grad")
    exact = reference.normalize_vjp(x, dy.astype(y.dtype), spec.replace(backward="exact"), scale)
    assert not tolerances.measure(dx, exact.dx, quantity="grad").passed


def test_fast_variance_reproduces_its_rounding_on_rows_with_a_large_mean() -> None:
    """x = 1e4 + N(0, 1): m2 - m1^2 cancels to a few ulps of m2, so every rounding of the model
    shows; the output matches the fast model, which is far from the two-pass one."""
    x = (1e4 + np.random.default_rng(0).standard_normal((16, 512))).astype(np.float32)
    spec = NormSpec("layer", variance="fast")
    y = np.asarray(jax.jit(lambda x: F.normalize(x, spec))(x))
    tolerances.assert_close(y, reference.normalize(x, spec), what="fast model")
    two_pass = reference.normalize(x, spec.replace(variance="two_pass"))
    assert np.max(np.abs(y.astype(np.float64) - two_pass)) > 0.1


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_dyt_modules_parameters(param_dtype) -> None:
    x = np.ones((2, 3, 8), np.float32)
    linen = nkjax.DyT(alpha_init=1.0, param_dtype=param_dtype, output_dtype="input")
    assert linen.spec == NormSpec("dyt", alpha_init=1.0)
    params = linen.init(jax.random.key(0), x)["params"]
    shapes = {name: (v.shape, v.dtype, float(v.ravel()[0])) for name, v in params.items()}
    expected = {"scale": ((8,), param_dtype, 1.0), "bias": ((8,), param_dtype, 0.0), "alpha": ((1,), param_dtype, 1.0)}
    assert shapes == {k: (s, jnp.dtype(d), v) for k, (s, d, v) in expected.items()}
    module = nkjax.nnx.DyT(8, alpha_init=1.0, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    state = nnx.state(module, nnx.Param)
    assert {name: (state[name][...].shape, state[name][...].dtype) for name in ("scale", "bias", "alpha")} == {
        k: (s, jnp.dtype(d)) for k, (s, d, _) in expected.items()
    }
    assert nkjax.nnx.DyT(8, use_bias=False, use_scale=False, output_dtype="input").spec == NormSpec(
        "dyt", bias=False, scale=False
    )
    bare = nkjax.DyT(use_bias=False, use_scale=False)
    assert set(bare.init(jax.random.key(0), x)["params"]) == {"alpha"}
    tolerances.assert_close(module(x), reference.normalize(x, module.spec), what="nnx DyT")


def test_from_spec_builds_every_kind() -> None:
    for spec in (NormSpec("dyt", alpha_init=2.0, residual="rounded"), NormSpec("layer", variance="fast", backward="autograd")):
        assert nkjax.from_spec(spec).spec == spec
        assert nkjax.nnx.from_spec(spec, 8).spec == spec
    with pytest.raises(ValueError, match="axis_name='tp' is invalid for kind='dyt': DyT has no statistic"):
        nkjax.nnx.from_spec(NormSpec("dyt"), 8, axis_name="tp")


def test_module_residual_errors() -> None:
    x = np.ones((2, 8), np.float32)
    added = nkjax.RMSNorm(residual="rounded")
    params = added.init(jax.random.key(0), x, x)
    with pytest.raises(TypeError, match=r"RMSNorm has residual='rounded': call it with the residual, layer\(x, residual\)"):
        added.apply(params, x)
    with pytest.raises(ValueError, match="LayerNorm was given a residual but its spec has residual=None"):
        nkjax.LayerNorm().init(jax.random.key(0), x, x)
    with pytest.raises(TypeError, match="DyT has residual='float32'"):
        nkjax.nnx.DyT(8, residual="float32")(x)
    with pytest.raises(ValueError, match="RMSNorm was given a residual"):
        nkjax.nnx.RMSNorm(8)(x, x)


def test_functional_residual_and_alpha_errors() -> None:
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"normalize: the spec has residual='rounded'.*use add_norm\(x, residual, spec"):
        F.normalize(x, NormSpec(residual="rounded"))
    with pytest.raises(ValueError, match="add_norm needs a spec with a residual rounding"):
        F.add_norm(x, x, NormSpec())
    with pytest.raises(ValueError, match=r"residual has shape \(2, 3\), expected the shape of x, \(2, 4\)"):
        F.add_norm(x, jnp.ones((2, 3)), NormSpec(residual="rounded"))
    with pytest.raises(TypeError, match="residual has dtype float32; residual='rounded' with x of dtype bfloat16 needs bfloat16"):
        F.add_norm(x.astype(jnp.bfloat16), x, NormSpec(residual="rounded"))
    y, h = F.add_norm(x.astype(jnp.bfloat16), x, NormSpec(residual="float32"))  # a float32 stream
    assert (y.dtype, h.dtype) == (jnp.bfloat16, jnp.float32)
    with pytest.raises(ValueError, match="alpha was given but the spec has kind='rms'"):
        F.normalize(x, NormSpec(), alpha=jnp.ones(1))
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected a scalar"):
        F.normalize(x, NormSpec("dyt"), alpha=jnp.ones(2))
    with pytest.raises(TypeError, match="alpha has dtype int32; expected a float dtype"):
        F.normalize(x, NormSpec("dyt"), alpha=jnp.ones(1, jnp.int32))


def test_hook_residual_errors() -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="the spec has residual='rounded', residual given: True, dh given: False"):
        conformance.evaluate(NormSpec(residual="rounded"), x, x, residual=x)
    with pytest.raises(ValueError, match="the spec has residual=None, residual given: True"):
        conformance.evaluate(NormSpec(), x, x, residual=x, dh=x)
    with pytest.raises(ValueError, match=r"alpha has shape \(\), expected \(1,\)"):
        conformance.evaluate(NormSpec("dyt"), x, x, alpha=np.float32(1.0))
