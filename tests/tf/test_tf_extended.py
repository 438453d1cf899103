"""normkit.tf on the spec's extended fields (fast variance, offset and output dtypes, residual
add, DyT, the autograd backward) against the reference, through the conformance hook.

tests/tf/test_tf_keras.py runs `test_handful_on_every_backend` again with KERAS_BACKEND=jax and
=torch, each in its own process.
"""

from __future__ import annotations

import itertools

import keras
import ml_dtypes
import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference, tolerances
from normkit.conformance.targets_keras import evaluate

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)

DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
KIND_ARGS = {"rms": {}, "partial_rms": {"p": 0.3}, "layer": {}, "dyt": {}}


def inputs(
    spec: NormSpec, shape: tuple[int, ...], dtype: str, param_dtype: str, seed: int = 0
) -> dict[str, np.ndarray | None]:
    """x, dy (in the output dtype), the parameters, and residual and dh when the spec adds one."""
    rng = np.random.default_rng(seed)
    t, p = DTYPES[dtype], DTYPES[param_dtype]
    pshape = spec.param_shape(shape)

    def draw(center: float, spread: float, size: tuple[int, ...], d: np.dtype) -> np.ndarray:
        return dtypes.round_to(center + spread * rng.standard_normal(size), d)

    found: dict[str, np.ndarray | None] = {
        "x": draw(0.0, 1.0, shape, t),
        "scale": draw(spec.scale_init, 0.3, pshape, p) if spec.scale else None,
        "bias": draw(0.0, 0.3, pshape, p) if spec.bias else None,
        "alpha": draw(0.8, 0.2, (1,), p) if spec.kind == "dyt" else None,
        "residual": None,
        "dh": None,
    }
    params = (found["scale"], found["bias"], found["alpha"])
    found["dy"] = draw(0.0, 1.0, shape, reference.output_dtype(t, spec, *params))
    if spec.residual is not None:
        found["residual"] = draw(0.0, 1.0, shape, t)
        h = reference.add_normalize(found["x"], found["residual"], spec, *params)[1]
        found["dh"] = draw(0.0, 1.0, shape, h.dtype)
    return found


def expected(spec: NormSpec, a: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """The reference's quantities, named as the hook returns them."""
    params = (a["scale"], a["bias"], a["alpha"])
    if spec.residual is None:
        y = reference.normalize(a["x"], spec, *params)
        grads = reference.normalize_vjp(a["x"], a["dy"], spec, *params)
        found = {"y": y, **grads._asdict()}
    else:
        y, h = reference.add_normalize(a["x"], a["residual"], spec, *params)
        grads = reference.add_normalize_vjp(a["x"], a["residual"], a["dy"], a["dh"], spec, *params)
        found = {"y": y, "h": h, **grads._asdict()}
    return found


def names(spec: NormSpec) -> list[str]:
    """The hook's tuple, in order (the conformance contract)."""
    found = ["y", "dx", "dscale", "dbias"]
    if spec.residual is not None:
        found += ["h", "dresidual"]
    return found + (["dalpha"] if spec.kind == "dyt" else [])


def check(
    spec: NormSpec,
    shape: tuple[int, ...],
    dtype: str,
    param_dtype: str = "float32",
    seed: int = 0,
    **variant: object,
) -> dict[str, np.ndarray]:
    """evaluate() against the reference: every quantity, its dtype, under normkit.tolerances."""
    a = inputs(spec, shape, dtype, param_dtype, seed)
    got = evaluate(
        spec, a["x"], a["dy"], a["scale"], a["bias"], residual=a["residual"], dh=a["dh"],
        alpha=a["alpha"], **variant,
    )
    want = expected(spec, a)
    what = f"{spec} {dtype} params {param_dtype} {shape} {variant}"
    assert len(got) == len(names(spec)), what
    half_cast = spec.cast == "before_scale" and dtypes.is_half(DTYPES[dtype])
    magnitude = reference.scaled_magnitude(a["x"], spec, a["scale"], a["alpha"])
    found = {}
    for name, actual in zip(names(spec), got, strict=True):
        ref = want[name]
        if ref is None:
            assert actual is None, f"{name} {what}"
            continue
        assert actual is not None, f"{name} {what}"
        found[name] = actual
        if name in ("y", "h"):
            assert actual.dtype == ref.dtype, f"{name} {actual.dtype} {what}"
            before = name == "y" and half_cast
            tolerances.assert_close(
                actual, ref, quantity="forward", cast=spec.cast if name == "y" else "after_scale",
                magnitude=magnitude if before else None, what=f"{name} {what}",
            )
            continue
        source = {"dx": "x", "dresidual": "residual", "dscale": "scale", "dbias": "bias"}
        held = a[source.get(name, "alpha")]
        assert held is not None
        assert actual.dtype == held.dtype, f"{name} {actual.dtype} {what}"
        assert actual.shape == held.shape, f"{name} {actual.shape} {what}"
        tolerances.assert_close(actual, ref, quantity="grad", what=f"{name} {what}")
    return found


# (field options, the param dtype for an input dtype): the cases every kind runs in every dtype.
FIELDS = {
    "offset_param": ({"scale_offset": 1.0, "offset_dtype": "param"}, lambda t: t),
    "promote": ({"output_dtype": "promote", "cast": "before_scale"}, lambda t: "float32"),
    "rounded": ({"residual": "rounded"}, lambda t: "float32"),
    "float32": ({"residual": "float32", "cast": "before_scale"}, lambda t: "float32"),
    "float32_normalized": ({"residual": "float32_normalized"}, lambda t: "float32"),
    "autograd": ({"backward": "autograd", "cast": "before_scale"}, lambda t: t),
}


def _grid() -> list[tuple[str, str, str]]:
    cases = [("fast", "layer", dtype) for dtype in DTYPES]
    cases += list(itertools.product(FIELDS, KIND_ARGS, DTYPES))
    return cases


@pytest.mark.parametrize("field,kind,dtype", _grid())
def test_every_field_kind_and_dtype_matches_reference(field, kind, dtype):
    options, param_dtype = FIELDS.get(field, ({"variance": "fast"}, lambda t: "float32"))
    spec = NormSpec(kind, **options, **KIND_ARGS[kind])
    check(spec, (4, 12), dtype, param_dtype(dtype))


HANDFUL = [
    (NormSpec("layer", variance="fast", axis=(1, 2)), (2, 3, 4), "float32", "float32"),
    (NormSpec(scale_offset=1.0, offset_dtype="param"), (3, 16), "float32", "bfloat16"),
    (NormSpec("partial_rms", p=0.5, output_dtype="promote", cast="before_scale", bias=True),
     (3, 16), "bfloat16", "float32"),
    (NormSpec("layer", residual="float32", cast="before_scale"), (3, 16), "float16", "float32"),
    (NormSpec("dyt", residual="rounded", alpha_init=1.0), (3, 16), "bfloat16", "float32"),
    (NormSpec("dyt", output_dtype="promote", axis=(0, 2)), (2, 3, 4), "float64", "float32"),
    (NormSpec(backward="autograd", cast="before_scale", residual="rounded"),
     (8, 32), "bfloat16", "bfloat16"),
]


@pytest.mark.parametrize("spec,shape,dtype,param_dtype", HANDFUL, ids=lambda v: str(v)[:24])
def test_handful_on_every_backend(spec, shape, dtype, param_dtype):
    check(spec, shape, dtype, param_dtype)


@pytest.mark.parametrize("shape,axis", [((2, 3, 8), -1), ((2, 5, 3), 1), ((2, 3, 4, 2), (1, 2))])
@pytest.mark.parametrize(
    "options", [{}, {"scale_offset": 1.0}, {"scale": False}, {"bias": False}], ids=str
)
def test_dyt_options_and_layouts(options, shape, axis):
    for dtype, cast in (("float32", "after_scale"), ("bfloat16", "before_scale")):
        check(NormSpec("dyt", axis=axis, cast=cast, **options), shape, dtype)


def test_dyt_initial_alpha_is_alpha_init():
    spec = NormSpec("dyt", alpha_init=1.5, bias=False)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    y, dx, dscale, _, dalpha = evaluate(spec, x, x)
    tolerances.assert_close(y, reference.normalize(x, spec))
    grads = reference.normalize_vjp(x, x, spec)
    tolerances.assert_close(dx, grads.dx, quantity="grad")
    tolerances.assert_close(dalpha, grads.dalpha.reshape(1), quantity="grad")
    assert dalpha.shape == (1,)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jit_on_every_backend(jit):
    if jit and keras.backend.backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    for spec, shape, dtype, param_dtype in HANDFUL[2:5]:
        check(spec, shape, dtype, param_dtype, jit=jit)


LLAMA = NormSpec(eps=1e-5, cast="before_scale")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "exact", [LLAMA, NormSpec("layer", cast="before_scale", residual="rounded")],
    ids=["llama", "layer-residual"],
)
def test_autograd_is_the_eager_rounding_model_to_the_bit_on_every_backend(exact, jit):
    """bfloat16 Llama with bfloat16 weights: the autograd gradients are the reference's autograd
    model to the bit, where the exact ones are more than the tolerance away from it; under XLA
    too (large enough for XLA's CPU reductions to fuse the roundings)."""
    if jit and keras.backend.backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    autograd = exact.replace(backward="autograd")
    a = inputs(autograd, (64, 128), "bfloat16", "bfloat16", seed=3)
    got = check(autograd, (64, 128), "bfloat16", "bfloat16", seed=3, jit=jit)
    model, ideal = expected(autograd, a), expected(exact, a)
    for name in ("dx", "dscale"):
        np.testing.assert_array_equal(got[name], model[name], err_msg=name)
        away = tolerances.measure(model[name], ideal[name], quantity="grad")
        assert not away.passed, f"{name}: the autograd model is within the exact bound here"
    check(exact, (64, 128), "bfloat16", "bfloat16", seed=3, jit=jit)


def test_fast_variance_loses_what_the_reference_says_on_a_large_mean():
    """Rows with mean 300: the fast variance cancels most of its digits. The layer follows the
    fast reference far closer than the two-pass one (the rest is its float32 summation order)."""
    rng = np.random.default_rng(4)
    x = (300.0 + rng.standard_normal((8, 64))).astype(np.float32)
    fast = NormSpec("layer", variance="fast", bias=False)
    y = evaluate(fast, x, x)[0]
    from_fast = np.abs(y - reference.normalize(x, fast)).max()
    from_two_pass = np.abs(y - reference.normalize(x, fast.replace(variance="two_pass"))).max()
    assert from_two_pass > 1e-3 and from_fast < from_two_pass / 10, (from_fast, from_two_pass)
    # The gradient is the exact function's, the two-pass one.
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = evaluate(fast, x, dy)[1]
    tolerances.assert_close(dx, reference.normalize_vjp(x, dy, fast).dx, quantity="grad")


def test_evaluate_rejects_bad_extended_requests():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"residual and dh are given exactly when the spec has a residual; the spec has residual=None"):
        evaluate(NormSpec(), x, x, residual=x, dh=x)
    with pytest.raises(ValueError, match=r"the spec has residual='rounded', residual given: True, dh given: False"):
        evaluate(NormSpec(residual="rounded"), x, x, residual=x)
    with pytest.raises(ValueError, match=r"dh has shape \(4,\), expected the shape of x, \(2, 4\)"):
        evaluate(NormSpec(residual="rounded"), x, x, residual=x, dh=x[0])
    with pytest.raises(ValueError, match=r"alpha was given but the spec has kind='rms'"):
        evaluate(NormSpec(), x, x, alpha=np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected \(1,\)"):
        evaluate(NormSpec("dyt"), x, x, alpha=np.ones(2, np.float32))
    with pytest.raises(NotImplementedError, match=r"one dtype \(param_dtype\); got scale bfloat16, bias float32"):
        evaluate(NormSpec(bias=True), x, x, np.ones(4, DTYPES["bfloat16"]), np.zeros(4, np.float32))
