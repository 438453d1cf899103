"""normkit.jax against normkit.reference, through the conformance hook, for every API under jit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from normkit import NormSpec, dtypes, reference, tolerances  # noqa: E402
from normkit.conformance import targets_jax as conformance  # noqa: E402

SCALE_OPTIONS = [dict(scale=False), dict(scale=True), dict(scale=True, scale_offset=1.0)]
KINDS = [dict(kind="rms"), dict(kind="partial_rms", p=0.3), dict(kind="layer")]


def check(spec: NormSpec, x: np.ndarray, api: str, seed: int = 0, device: str = "cpu") -> None:
    """evaluate() on x with random dy and parameters; every output against the reference."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    shape = spec.param_shape(x.shape)
    scale = (rng.standard_normal(shape) * 0.5 + spec.scale_init).astype(np.float32) if spec.scale else None
    bias = rng.standard_normal(shape).astype(np.float32) if spec.bias else None
    y, dx, dscale, dbias = conformance.evaluate(spec, x, dy, scale, bias, device=device, api=api)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    tolerances.assert_close(y, reference.normalize(x, spec, scale, bias), cast=spec.cast, what="y")
    expected = reference.normalize_vjp(x, dy, spec, scale, bias)
    for name, got, want in zip(("dx", "dscale", "dbias"), (dx, dscale, dbias), expected):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == np.float32 or name == "dx"
            tolerances.assert_close(got, want, quantity="grad", cast=spec.cast, what=name)


def _x(shape: tuple[int, ...], dtype: np.dtype, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


FLOAT32_GRID = [
    NormSpec(**kind, eps_placement=placement, **scale, bias=bias)
    for kind, placement, scale, bias in itertools.product(
        KINDS, ("inside", "outside"), SCALE_OPTIONS, (False, True)
    )
]
# Every option through the functional API, whose core the modules share; the linen and nnx
# modules (their parameters' plumbing) on every kind with every parameter. The conformance
# matrix (normkit conformance) runs the full grid on all three.
MODULE_GRID = [
    NormSpec(**kind, eps_placement=placement, scale_offset=1.0, bias=True)
    for kind, placement in itertools.product(KINDS, ("inside", "outside"))
]
GRID_CASES = [(spec, "functional") for spec in FLOAT32_GRID] + [
    (spec, api) for api in conformance.APIS if api != "functional" for spec in MODULE_GRID
]


@pytest.mark.parametrize("spec, api", GRID_CASES, ids=[f"{s}-{a}" for s, a in GRID_CASES])
def test_every_option_float32(spec: NormSpec, api: str) -> None:
    check(spec, _x((3, 2, 40), np.float32), api)


@pytest.mark.parametrize("api", conformance.APIS)
@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("cast", ["after_scale", "before_scale"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_half_precision_cast_orders(kind: dict, cast: str, dtype: np.dtype, api: str) -> None:
    spec = NormSpec(**kind, cast=cast, scale_offset=1.0, bias=True)
    check(spec, _x((4, 96), dtype), api)


@pytest.mark.parametrize("api", conformance.APIS)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_float64_runs_in_float64(kind: dict, api: str) -> None:
    check(NormSpec(**kind, bias=True), _x((4, 33), np.float64), api)


@pytest.mark.parametrize("api", conformance.APIS)
@pytest.mark.parametrize(
    "spec, shape",
    [
        (NormSpec(kind="layer", axis=(-2, -1)), (3, 5, 7)),
        (NormSpec(kind="partial_rms", p=0.29, axis=(1, 2)), (2, 10, 10)),
        (NormSpec(kind="rms", axis=0, bias=True), (9, 4)),
        (NormSpec(kind="layer", axis=(0, 2), scale_offset=1.0), (6, 3, 5)),
    ],
    ids=str,
)
def test_multi_and_leading_axes(spec: NormSpec, shape: tuple[int, ...], api: str) -> None:
    check(spec, _x(shape, np.float32), api)


@pytest.mark.parametrize("n, p", [(10, 0.05), (100, 0.29), (7, 1.0), (4096, 0.0625)])
def test_partial_rms_statistic_size(n: int, p: float) -> None:
    check(NormSpec(kind="partial_rms", p=p), _x((2, n), np.float32), "functional")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_large_rows(kind: dict) -> None:
    check(NormSpec(**kind, bias=True), _x((64, 4096), np.float32), "linen")


HALF_AND_FLOAT32 = [dtypes.float32, dtypes.float16, dtypes.bfloat16]


def _degenerate_x(n: int, dtype: np.dtype) -> np.ndarray:
    # No zero row here: its dx = d r (1e3 d, or 1e6 d outside) would set max|ref| and hide the
    # error of the others (test_degenerate_zero_rows covers s = 0). At n = 1, dscale is about
    # sum(dy * sign(x)) over the rows, one number: the seed keeps it from cancelling (seed 1
    # gives 2e-3, where float32 rounding of O(1) terms alone exceeds the relative bound).
    return _x((8, n), dtype, seed=n + 1)


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT32, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", KINDS[:2], ids=lambda k: k["kind"])
def test_rms_rows_of_one_element(kind: dict, placement: str, offset: float, dtype: np.dtype) -> None:
    """n = 1: dx = d eps r^3 (inside) or d eps r^2 (outside) is O(eps); the general formula
    would get it as a difference of O(1) float32 terms, far outside the gradient bound."""
    spec = NormSpec(**kind, eps_placement=placement, scale_offset=offset)
    check(spec, _degenerate_x(1, dtype), "functional")


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT32, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_layer_rows_of_two_elements(placement: str, offset: float, dtype: np.dtype) -> None:
    """n = 2: dx0 = -dx1 = eps rho (d0 - d1) / 2, rho = r^3 (inside) or r^2 (outside)."""
    spec = NormSpec(kind="layer", eps_placement=placement, scale_offset=offset)
    check(spec, _degenerate_x(2, dtype), "functional")


@pytest.mark.parametrize("api", conformance.APIS)
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_layer_rows_of_one_element_have_zero_dx(placement: str, api: str) -> None:
    spec = NormSpec(kind="layer", eps_placement=placement)
    x = _degenerate_x(1, np.float32)
    check(spec, x, api)
    _, dx, _, _ = conformance.evaluate(spec, x, np.ones_like(x), api=api)
    assert not np.any(dx)


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_degenerate_zero_rows(kind: dict, placement: str) -> None:
    """s = 0 in rows of 1 (RMS kinds) or 2 (LayerNorm): dx = d r, with r'(0) = 0 outside."""
    n = 2 if kind["kind"] == "layer" else 1
    check(NormSpec(**kind, eps_placement=placement), np.zeros((3, n), np.float32), "functional")


def test_zero_rows_outside_placement() -> None:
    """s = 0 with eps outside the root: finite output and the reference's zero derivative term."""
    x = _x((3, 8), np.float32)
    x[1] = 0.0
    for kind in KINDS:
        check(NormSpec(**kind, eps_placement="outside"), x, "functional")


def test_devices_lists_cpu() -> None:
    assert conformance.devices()[0] == "cpu"


def test_evaluate_errors() -> None:
    spec = NormSpec()
    x = _x((2, 4), np.float32)
    with pytest.raises(ValueError, match="api='keras' is invalid"):
        conformance.evaluate(spec, x, x, api="keras")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device 'tpu:7' is not one jax sees: \['cpu'\]"):
        conformance.evaluate(spec, x, x, device="tpu:7")
    with pytest.raises(ValueError, match="dy has shape"):
        conformance.evaluate(spec, x, x[:1])
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        conformance.evaluate(spec, x, x, bias=np.zeros(4, np.float32))


GPUS = [d for d in conformance.devices() if d.startswith("gpu")]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason="JAX sees no GPU")
@pytest.mark.parametrize("api", conformance.APIS)
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["kind"])
def test_gpu(kind: dict, dtype: np.dtype, api: str) -> None:
    check(NormSpec(**kind, bias=True, scale_offset=1.0), _x((16, 1024), dtype), api, device=GPUS[0])
