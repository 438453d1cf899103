"""normkit.torch against normkit.reference, through the conformance hook, on every device torch sees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402
from normkit.conformance import targets_torch as conformance  # noqa: E402

KINDS = [dict(kind="rms"), dict(kind="partial_rms", p=0.3), dict(kind="layer")]
SCALE_OPTIONS = [dict(scale=False), dict(scale=True), dict(scale=True, scale_offset=1.0)]
HALF = [dtypes.float16, dtypes.bfloat16]
ALL_DTYPES = [dtypes.float32, dtypes.float64, *HALF]


def check(
    spec: NormSpec, x: np.ndarray, seed: int = 0, device: str = "cpu", **variant: object
) -> None:
    """evaluate() on x with random dy and parameters; every output against the reference."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    shape = spec.param_shape(x.shape)
    scale = (rng.standard_normal(shape) * 0.5 + spec.scale_init).astype(np.float32) if spec.scale else None
    bias = rng.standard_normal(shape).astype(np.float32) if spec.bias else None
    y, dx, dscale, dbias = conformance.evaluate(spec, x, dy, scale, bias, device=device, **variant)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    tolerances.assert_close(y, reference.normalize(x, spec, scale, bias), cast=spec.cast, what="y")
    expected = reference.normalize_vjp(x, dy, spec, scale, bias)
    for name, got, want in zip(("dx", "dscale", "dbias"), (dx, dscale, dbias), expected):
        assert (got is None) == (want is None), name
        if got is not None:
            assert name == "dx" or got.dtype == np.float32, name  # the parameters' dtype
            tolerances.assert_close(got, want, quantity="grad", cast=spec.cast, what=name)


def _x(shape: tuple[int, ...], dtype: np.dtype, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


FLOAT32_GRID = [
    NormSpec(**kind, eps_placement=placement, **scale, bias=bias)
    for kind, placement, scale, bias in itertools.product(
        KINDS, ("inside", "outside"), SCALE_OPTIONS, (False, True)
    )
]


@pytest.mark.parametrize("api", ["module", "functional"])
@pytest.mark.parametrize("spec", FLOAT32_GRID, ids=str)
def test_every_option_float32(spec: NormSpec, api: str) -> None:
    check(spec, _x((3, 2, 40), np.float32), api=api)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4096, 16384])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_row_sizes_1_to_16384(kind: dict, dtype: np.dtype, n: int) -> None:
    check(NormSpec(**kind, bias=True, scale_offset=1.0), _x((3, n), dtype))


@pytest.mark.parametrize("n", [2, 96, 4096])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_half_before_scale(kind: dict, placement: str, dtype: np.dtype, n: int) -> None:
    check(NormSpec(**kind, eps_placement=placement, cast="before_scale", bias=True), _x((4, n), dtype))


@pytest.mark.parametrize("n", [4096, 16384])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_before_scale_large_rows_without_bias(dtype: np.dtype, n: int) -> None:
    check(NormSpec(cast="before_scale", scale_offset=1.0), _x((4, n), dtype))


def test_half_before_scale_rounding_flip_is_within_the_policy() -> None:
    """A float32 y_hat that rounds to the other float16 neighbour is 1 ulp of y_hat; a bias that
    cancels the scaled term makes it several ulps of y (5 here), which the policy measures at
    |y_hat * g| for before_scale."""
    spec = NormSpec(cast="before_scale", bias=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16384)).astype(np.float16)
    scale = (rng.standard_normal(16384) * 0.5 + 1).astype(np.float32)
    bias = rng.standard_normal(16384).astype(np.float32)
    # The composite path: the CPU kernel rounds y_hat once from float64, so it does not flip.
    y, *_ = conformance.evaluate(spec, x, x, scale, bias, kernel="composite")
    expected = reference.normalize(x, spec, scale, bias)
    assert tolerances.measure(y, expected, cast=spec.cast).max_ulp > 2  # per element of y
    magnitude = reference.scaled_magnitude(x, spec, scale)
    tolerances.assert_close(y, expected, cast=spec.cast, magnitude=magnitude)


@pytest.mark.parametrize(
    "spec, shape",
    [
        (NormSpec(kind="layer", axis=(-2, -1)), (3, 5, 7)),
        (NormSpec(kind="partial_rms", p=0.29, axis=(1, 2)), (2, 10, 10)),
        (NormSpec(kind="rms", axis=0, bias=True), (9, 4)),
        (NormSpec(kind="layer", axis=(0, 2), scale_offset=1.0, eps_placement="outside"), (6, 3, 5)),
    ],
    ids=str,
)
def test_multi_and_leading_axes(spec: NormSpec, shape: tuple[int, ...]) -> None:
    check(spec, _x(shape, np.float32))


@pytest.mark.parametrize("n, p", [(10, 0.05), (100, 0.29), (7, 1.0), (4096, 0.0625)])
def test_partial_rms_statistic_size(n: int, p: float) -> None:
    check(NormSpec(kind="partial_rms", p=p), _x((2, n), np.float32))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_many_rows(kind: dict) -> None:
    """300 rows of 1000, float32 and float64: the eager in-place path at some size."""
    check(NormSpec(**kind, bias=True), _x((300, 1000), np.float32))
    check(NormSpec(**kind, eps_placement="outside"), _x((300, 1000), np.float64))


def test_zero_rows_outside_placement() -> None:
    """s = 0 with eps outside the root: finite output and the reference's zero derivative term."""
    x = _x((3, 8), np.float32)
    x[1] = 0.0
    for kind in KINDS:
        check(NormSpec(**kind, eps_placement="outside"), x)


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_nan_and_inf_stay_in_their_rows(kind: dict, dtype: np.dtype) -> None:
    spec = NormSpec(**kind, bias=True)
    x = _x((4, 32), dtype)
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    dy = _x((4, 32), dtype, seed=2)
    y, dx, _, _ = conformance.evaluate(spec, x, dy)
    tolerances.assert_close(y, reference.normalize(x, spec), cast=spec.cast, what="y")
    tolerances.assert_close(dx, reference.normalize_vjp(x, dy, spec)[0], quantity="grad", what="dx")
    finite_rows = [0, 3]
    assert np.isfinite(y[finite_rows].astype(np.float64)).all()
    assert np.isfinite(dx[finite_rows].astype(np.float64)).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
    kind=st.sampled_from(KINDS),
    placement=st.sampled_from(["inside", "outside"]),
    scale=st.sampled_from(SCALE_OPTIONS),
    bias=st.booleans(),
    dtype=st.sampled_from(ALL_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_random_specs(shape, data, kind, placement, scale, bias, dtype, seed) -> None:
    ndim = len(shape)
    axes = data.draw(st.sets(st.integers(0, ndim - 1), min_size=1).map(sorted), label="axes")
    negative = data.draw(st.booleans(), label="negative axes")
    axis = tuple(a - ndim if negative else a for a in axes)
    spec = NormSpec(**kind, eps_placement=placement, axis=axis, **scale, bias=bias)
    check(spec, _x(shape, dtype, seed + 1), seed)  # dy from another stream than x


def test_devices_lists_cpu_first() -> None:
    assert conformance.devices()[0] == "cpu"


def test_evaluate_errors() -> None:
    spec = NormSpec()
    x = _x((2, 4), np.float32)
    # a variant the hook does not declare is refused, naming those it does
    with pytest.raises(
        ValueError, match=r"unknown variant options \['jit'\]; allowed: \['api', 'compiled', 'kernel'\]"
    ):
        conformance.evaluate(spec, x, x, jit=True)
    with pytest.raises(ValueError, match="kernel='numba' is invalid: expected one of"):
        conformance.evaluate(spec, x, x, kernel="numba")
    with pytest.raises(ValueError, match="api='eager' is invalid: expected one of"):
        conformance.evaluate(spec, x, x, api="eager")
    with pytest.raises(ValueError, match="api='module' is invalid for axis \\(0,\\)"):
        conformance.evaluate(NormSpec(axis=0), x, x, api="module")
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        conformance.evaluate(spec, x, x, bias=np.zeros(4, np.float32))


GPUS = [d for d in conformance.devices() if d != "cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason="torch sees no GPU")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_gpu_matches_reference(kind: dict, dtype: np.dtype) -> None:
    for device in GPUS:
        if device == "mps" and dtype == dtypes.float64:
            continue  # MPS has no float64
        for spec in (NormSpec(**kind, bias=True), NormSpec(**kind, eps_placement="outside", cast="before_scale", scale_offset=1.0)):
            check(spec, _x((16, 1024), dtype), device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason="torch sees no GPU")
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_gpu_agrees_with_cpu(kind: dict) -> None:
    spec = NormSpec(**kind, bias=True)
    x = _x((8, 512), np.float32)
    dy = _x((8, 512), np.float32, seed=3)
    on_cpu = conformance.evaluate(spec, x, dy)
    for device in GPUS:
        for got, want, quantity in zip(conformance.evaluate(spec, x, dy, device=device), on_cpu, ("forward", "grad", "grad", "grad")):
            if want is not None:
                tolerances.assert_close(got, want, quantity=quantity)  # type: ignore[arg-type]


def test_the_cpu_kernel_target_skips_a_gpu_case() -> None:
    """On a GPU machine torch[cpu-kernel] meets cuda:0 cases: a SKIP naming why, not a FAIL."""
    x = np.ones((2, 8), np.float32)
    with pytest.raises(NotImplementedError, match="kernel='cpu' runs on CPU tensors, not on cuda:0"):
        conformance.evaluate(NormSpec("rms"), x, x, device="gpu:0", kernel="cpu")
