"""offset_dtype ("float32" or "param") and output_dtype ("input" or "promote") in the reference."""

import math

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference

BF16 = dtypes.bfloat16


def round_bits(v, bits):
    """``v`` to ``bits`` significant bits, ties to even (normal range), by hand."""
    if v == 0:
        return 0.0
    _, e = math.frexp(v)
    return math.ldexp(round(math.ldexp(v, bits - e)), e - bits)


def rms_rows(x, eps=1e-6):
    return [
        [v / math.sqrt(math.fsum(u * u for u in row) / len(row) + eps) for v in row]
        for row in x
    ]


def test_param_offset_rounds_one_plus_w_in_bfloat16():
    # bfloat16 spacing is 2^-7 above 1 and 2^-8 below: 1 + 2^-9 rounds to 1, 1 + 3 * 2^-9 up to
    # 1 + 2^-7, and 1 - 2^-9 (halfway between 1 - 2^-8 and 1) to the even neighbour 1.
    w = np.array([2.0**-9, 3 * 2.0**-9, -(2.0**-9), 0.5], dtype=BF16)
    x = np.array([[1.0, -2.0, 3.0, 0.25]])
    spec = NormSpec(scale_offset=1.0, offset_dtype="param")
    g_param = [1.0, 1 + 2.0**-7, 1.0, 1.5]
    g_float32 = [1 + float(v) for v in w.astype(np.float64)]
    y_hat = rms_rows(x.tolist())[0]
    np.testing.assert_allclose(
        reference.normalize(x, spec, w)[0], np.multiply(y_hat, g_param), rtol=1e-15
    )
    float32_offset = reference.normalize(x, spec.replace(offset_dtype="float32"), w)[0]
    np.testing.assert_allclose(
        float32_offset, np.multiply(y_hat, g_float32), rtol=1e-15
    )
    g, _ = reference.check_params(x.shape, spec, w, None)
    assert g.tolist() == g_param


def test_param_offset_in_float32_and_float64_params():
    rng = np.random.default_rng(0)
    w32 = rng.normal(size=5).astype(np.float32) * np.float32(1e-3)
    g, _ = reference.check_params(
        (2, 5), NormSpec(scale_offset=1.0, offset_dtype="param"), w32, None
    )
    np.testing.assert_array_equal(g, (np.float32(1.0) + w32).astype(np.float64))
    w64 = w32.astype(np.float64)
    g64, _ = reference.check_params(
        (2, 5), NormSpec(scale_offset=1.0, offset_dtype="param"), w64, None
    )
    np.testing.assert_array_equal(g64, 1.0 + w64)


def test_param_offset_gradient_uses_the_rounded_scale_and_does_not_differentiate_rounding():
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    w = dtypes.round_to(rng.normal(size=6) * 0.01, BF16)
    spec = NormSpec(scale_offset=1.0, offset_dtype="param")
    got = reference.normalize_vjp(x, dy, spec, w)
    g = np.array([round_bits(1 + v, 8) for v in w.astype(np.float64)])
    want = reference.normalize_vjp(x, dy, NormSpec(), g)
    np.testing.assert_allclose(got.dx, want.dx, rtol=1e-14)
    np.testing.assert_allclose(got.dscale, want.dscale, rtol=1e-14)


@pytest.mark.parametrize(
    "x_dtype, scale_dtype, bias_dtype, out",
    [
        (BF16, np.float32, None, np.float32),
        (BF16, BF16, None, BF16),
        (np.float16, BF16, None, np.float32),
        (np.float16, None, np.float16, np.float16),
        (np.float32, np.float64, None, np.float64),
        (BF16, BF16, np.float32, np.float32),
        (np.float64, np.float16, None, np.float64),
        (BF16, None, None, BF16),
    ],
)
def test_promote_output_dtype(x_dtype, scale_dtype, bias_dtype, out):
    spec = NormSpec(output_dtype="promote", bias=bias_dtype is not None)
    x = np.linspace(-1, 2, 8).reshape(2, 4).astype(x_dtype)
    w = None if scale_dtype is None else np.full(4, 1.5, dtype=scale_dtype)
    b = None if bias_dtype is None else np.full(4, 0.25, dtype=bias_dtype)
    y = reference.normalize(x, spec, w, b)
    assert y.dtype == np.dtype(out)
    assert reference.output_dtype(x.dtype, spec, w, b) == np.dtype(out)
    assert reference.normalize(
        x, spec.replace(output_dtype="input"), w, b
    ).dtype == np.dtype(x_dtype)


def test_promote_rounds_once_to_the_promoted_dtype():
    rng = np.random.default_rng(2)
    x = dtypes.round_to(rng.normal(size=(4, 8)), BF16)
    w = rng.normal(size=8).astype(np.float32)
    y = reference.normalize(x, NormSpec(output_dtype="promote"), w)
    want = np.array(rms_rows(x.astype(np.float64).tolist())) * w.astype(np.float64)
    np.testing.assert_array_equal(y, want.astype(np.float32))


def test_promote_with_before_scale_rounds_y_hat_to_the_input_dtype_first():
    rng = np.random.default_rng(3)
    x = dtypes.round_to(rng.normal(size=(4, 8)), BF16)
    w = rng.normal(size=8).astype(np.float32)
    y = reference.normalize(x, NormSpec(output_dtype="promote", cast="before_scale"), w)
    y_hat = [
        [round_bits(v, 8) for v in row]
        for row in rms_rows(x.astype(np.float64).tolist())
    ]
    want = np.array(y_hat) * w.astype(np.float64)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, want.astype(np.float32))


def test_promote_does_not_change_gradients():
    rng = np.random.default_rng(4)
    x, dy = rng.normal(size=(2, 5)).astype(np.float16), rng.normal(size=(2, 5))
    w = rng.normal(size=5)
    a = reference.normalize_vjp(x, dy, NormSpec(output_dtype="promote"), w)
    b = reference.normalize_vjp(x, dy, NormSpec(), w)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
