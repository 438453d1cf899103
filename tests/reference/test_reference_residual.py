"""reference.add_normalize and its VJP: the three roundings of a fused residual add."""

import math

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference
from tests.helpers.numerical import central_differences

MODES = ("rounded", "float32", "float32_normalized")


def rms_by_hand(row, eps, scale):
    r = 1 / math.sqrt(math.fsum(v * v for v in row) / len(row) + eps)
    return [v * r * w for v, w in zip(row, scale)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_precision_inputs_all_modes_normalize_the_sum(mode, dtype):
    rng = np.random.default_rng(0)
    x, res = (rng.normal(size=(3, 6)).astype(dtype) for _ in range(2))
    w = rng.normal(size=6)
    spec = NormSpec(eps=1e-3, residual=mode)
    y, h = reference.add_normalize(x, res, spec, w)
    assert h.dtype == dtype and y.dtype == dtype
    # numpy's own addition in the input dtype rounds the sum once, like every mode here
    np.testing.assert_array_equal(h, x + res)
    for got, row in zip(y.astype(np.float64), h.astype(np.float64)):
        np.testing.assert_allclose(
            got,
            rms_by_hand(list(row), 1e-3, w),
            rtol=2e-7 if dtype == np.float32 else 1e-13,
        )


def test_bfloat16_sum_on_a_tie_shows_the_three_roundings():
    bf16 = dtypes.bfloat16
    # 1 + 2^-8 lies halfway between the bfloat16 neighbours 1 and 1 + 2^-7: ties to even give 1.
    x = np.array([[1.0, 2.0]], dtype=bf16)
    res = np.array([[2.0**-8, 0.0]], dtype=bf16)
    # float32 weights promote the output to float32, where the normalized sums differ visibly
    spec, w = NormSpec(eps=1e-6, output_dtype="promote"), np.ones(2, dtype=np.float32)
    y_r, h_r = reference.add_normalize(x, res, spec.replace(residual="rounded"), w)
    y_f, h_f = reference.add_normalize(x, res, spec.replace(residual="float32"), w)
    y_n, h_n = reference.add_normalize(
        x, res, spec.replace(residual="float32_normalized"), w
    )
    assert (h_r.dtype, h_f.dtype, h_n.dtype) == (bf16, np.float32, bf16)
    assert h_r.astype(np.float64).tolist() == [[1.0, 2.0]]
    assert h_f.tolist() == [[1.00390625, 2.0]]
    assert h_n.astype(np.float64).tolist() == [[1.0, 2.0]]
    assert y_r.dtype == y_f.dtype == y_n.dtype == np.float32
    np.testing.assert_array_equal(y_r[0], np.float32(rms_by_hand([1.0, 2.0], 1e-6, w)))
    np.testing.assert_array_equal(y_f, y_n)
    np.testing.assert_array_equal(
        y_f[0], np.float32(rms_by_hand([1.00390625, 2.0], 1e-6, w))
    )
    assert not np.array_equal(y_f, y_r)


def test_float32_mode_takes_a_float32_residual_stream_with_half_x():
    x = np.array([[0.5, -1.25, 3.0]], dtype=np.float16)
    res = np.array([[1e-4, 2.0, -0.1]], dtype=np.float32)
    spec = NormSpec(residual="float32", cast="before_scale")
    y, h = reference.add_normalize(x, res, spec)
    want_h = x.astype(np.float32) + res  # one float32 rounding of the exact sum
    np.testing.assert_array_equal(h, want_h)
    assert y.dtype == np.float16
    # y_hat is rounded to float16 (the input dtype) before the affine step, then again
    y_hat = rms_by_hand([float(v) for v in want_h[0]], spec.eps, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(y[0], np.array(y_hat).astype(np.float16))


def test_sum_rounded_through_float32_equals_one_rounding():
    # FlashInfer rounds the float32 sum to the input dtype; for two half operands that is the
    # correctly rounded sum, also across large exponent gaps (where float32 itself rounds).
    rng = np.random.default_rng(1)
    for dtype in dtypes.HALF_DTYPES:
        info = np.finfo(np.float16) if dtype == dtypes.float16 else None
        big = rng.normal(size=4000) * (2.0 ** rng.integers(-6, 6, size=4000))
        small = rng.normal(size=4000) * (2.0 ** rng.integers(-30, 0, size=4000))
        if info is not None:
            small = np.where(np.abs(small) < 2.0**-14, 2.0**-14, small)
        x = dtypes.round_to(big, dtype)[None]
        res = dtypes.round_to(small, dtype)[None]
        _, h_n = reference.add_normalize(
            x, res, NormSpec(residual="float32_normalized")
        )
        _, h_r = reference.add_normalize(x, res, NormSpec(residual="rounded"))
        np.testing.assert_array_equal(h_n.astype(np.float64), h_r.astype(np.float64))


def numerical_add_vjp(x, res, dy, dh, spec, scale, step=1e-6):
    def loss(a, b, w):
        y, h = reference.add_normalize(a, b, spec, w)
        return float(np.sum(dy * y) + np.sum(dh * h))

    return (
        central_differences(x, lambda v: loss(v, res, scale), step),
        central_differences(res, lambda v: loss(x, v, scale), step),
        central_differences(scale, lambda v: loss(x, res, v), step),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["rms", "layer", "dyt"])
def test_vjp_matches_central_differences(mode, kind):
    rng = np.random.default_rng(2)
    x, res, dy, dh = (rng.normal(size=(2, 5)) for _ in range(4))
    spec = NormSpec(kind, residual=mode, bias=False)
    w = rng.normal(size=5)
    got = reference.add_normalize_vjp(x, res, dy, dh, spec, w)
    want = numerical_add_vjp(x, res, dy, dh, spec, w)
    np.testing.assert_array_equal(got.dx, got.dresidual)
    for g, n in zip((got.dx, got.dresidual, got.dscale), want):
        np.testing.assert_allclose(g, n, rtol=1e-6, atol=1e-7)
    assert got.dbias is None
    assert len(got) == (5 if kind == "dyt" else 4)


def test_vjp_is_dh_plus_the_norm_vjp_at_the_normalized_sum():
    rng = np.random.default_rng(3)
    x = dtypes.round_to(rng.normal(size=(3, 8)), dtypes.bfloat16)
    res = dtypes.round_to(rng.normal(size=(3, 8)), dtypes.bfloat16)
    dy, dh = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    spec = NormSpec("layer", residual="rounded")
    _, h = reference.add_normalize(x, res, spec)
    got = reference.add_normalize_vjp(x, res, dy, dh, spec)
    norm = reference.normalize_vjp(h, dy, NormSpec("layer"))
    np.testing.assert_array_equal(got.dx, dh + norm.dx)
    np.testing.assert_array_equal(got.dscale, norm.dscale)
    no_dh = reference.add_normalize_vjp(x, res, dy, None, spec)
    np.testing.assert_array_equal(no_dh.dx, norm.dx)


def test_errors_name_the_problem():
    x = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(
        ValueError, match="add_normalize needs a spec with a residual rounding"
    ):
        reference.add_normalize(x, x, NormSpec())
    with pytest.raises(ValueError, match="normalize: the spec has residual='rounded'"):
        reference.normalize(x, NormSpec(residual="rounded"))
    with pytest.raises(
        ValueError, match="normalize_vjp: the spec has residual='float32'"
    ):
        reference.normalize_vjp(x, x, NormSpec(residual="float32"))
    with pytest.raises(
        ValueError, match=r"residual has shape \(2, 3\), expected the shape of x"
    ):
        reference.add_normalize(x, np.ones((2, 3)), NormSpec(residual="rounded"))
    half = x.astype(np.float16)
    with pytest.raises(
        TypeError, match="residual has dtype float32; residual='rounded' with x"
    ):
        reference.add_normalize(half, x, NormSpec(residual="rounded"))
    with pytest.raises(
        TypeError, match="residual has dtype float64; residual='float32' with x"
    ):
        reference.add_normalize(
            half, x.astype(np.float64), NormSpec(residual="float32")
        )
    with pytest.raises(
        ValueError, match=r"dh has shape \(4,\), expected the shape of x"
    ):
        reference.add_normalize_vjp(x, x, x, np.ones(4), NormSpec(residual="rounded"))
