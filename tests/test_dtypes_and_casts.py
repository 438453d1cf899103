"""Exact rounding, ulps, and the reference's emulation of the half-precision cast policy."""

import ml_dtypes
import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference

bf16, f16 = dtypes.bfloat16, dtypes.float16


def test_round_to_bfloat16_rounds_once_from_float64():
    # Just above the midpoint between 1 and 1 + 2**-7: correct rounding goes up. Going through
    # float32 first (what ml_dtypes' float64 cast does) lands exactly on the midpoint and ties
    # to even, i.e. down.
    v = 1 + 2**-8 + 2**-30
    assert float(dtypes.round_to(v, bf16)) == 1 + 2**-7
    assert float(np.float64(v).astype(bf16)) == 1.0


def test_round_to_agrees_with_single_roundings():
    rng = np.random.default_rng(0)
    v32 = (rng.normal(size=20000) * np.exp2(rng.integers(-140, 120, size=20000))).astype(np.float32)
    # float32 -> bfloat16 in ml_dtypes is a single correct rounding
    np.testing.assert_array_equal(dtypes.round_to(v32.astype(np.float64), bf16), v32.astype(bf16))
    v64 = rng.normal(size=20000) * np.exp2(rng.integers(-30, 17, size=20000))
    # numpy's float64 -> float16 is a single correct rounding, subnormals and overflow included
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(dtypes.round_to(v64, f16), v64.astype(f16))


def test_round_to_ties_to_even_and_overflows_to_inf():
    assert float(dtypes.round_to(1 + 2**-8, bf16)) == 1.0  # tie, 1.0 is even
    assert float(dtypes.round_to(1 + 3 * 2**-8, bf16)) == 1 + 2**-6  # tie, rounds up to even
    big = float(ml_dtypes.finfo(bf16).max)
    half_ulp = 2.0**119  # half the spacing at bfloat16's largest finite value
    assert float(dtypes.round_to(big + half_ulp, bf16)) == np.inf  # a tie, and big is odd
    assert float(dtypes.round_to(-(big + half_ulp / 2), bf16)) == -big
    assert np.isnan(dtypes.round_to(np.nan, f16))


def test_ulp():
    np.testing.assert_array_equal(dtypes.ulp([1.0, 1.99, 2.0, -0.5], bf16), [2**-7, 2**-7, 2**-6, 2**-8])
    np.testing.assert_array_equal(dtypes.ulp([0.0, 1e-7, 1.0], f16), [2**-24, 2**-24, 2**-10])
    assert dtypes.ulp(1.0, np.float32) == 2**-23
    assert np.isnan(dtypes.ulp(np.inf, f16))


def test_as_float_dtype_names_the_dtype():
    assert dtypes.as_float_dtype("bfloat16") == bf16
    with pytest.raises(TypeError, match="scale has dtype int8; normkit supports float16, bfloat16, float32, float64"):
        dtypes.as_float_dtype(np.int8, "scale")


# ---- the cast policy, against values computed by hand -----------------------------------------
#
# x = [1, 7]: mean(x^2) = 25, so (eps negligible) the normalized row is exactly [0.2, 1.4].


def test_bfloat16_cast_order_hand_computed():
    x = np.array([1.0, 7.0], dtype=bf16)
    w = np.array([1 + 2**-7, 1 + 2**-7], dtype=bf16)  # 1.0078125
    spec = NormSpec(eps=1e-12)
    # after_scale: 0.2 * 1.0078125 = 0.2015625 -> 206.4 * 2**-10 -> 206 * 2**-10 = 0.201171875
    #              1.4 * 1.0078125 = 1.4109375 -> 180.6 * 2**-7  -> 181 * 2**-7  = 1.4140625
    after = reference.normalize(x, spec, w)
    assert after.dtype == bf16
    np.testing.assert_array_equal(after.astype(np.float64), [206 / 1024, 181 / 128])
    # before_scale: bf16(0.2) = 205 * 2**-10 = 0.2001953125; times w = 0.2017593383... = 206.6 * 2**-10 -> 207
    #               bf16(1.4) = 179 * 2**-7 = 1.3984375;     times w = 1.4093627929... = 180.4 * 2**-7  -> 180
    before = reference.normalize(x, spec.replace(cast="before_scale"), w)
    np.testing.assert_array_equal(before.astype(np.float64), [207 / 1024, 180 / 128])


def test_float16_cast_order_hand_computed_with_ties():
    x = np.array([1.0, 7.0], dtype=f16)
    w = np.array([1.5, 1.5], dtype=f16)
    spec = NormSpec(eps=1e-12)
    # after_scale: 0.3 -> 1228.8 * 2**-12 -> 1229 * 2**-12;  2.1 -> 1075.2 * 2**-9 -> 1075 * 2**-9
    after = reference.normalize(x, spec, w)
    assert after.dtype == f16
    np.testing.assert_array_equal(after.astype(np.float64), [1229 / 4096, 1075 / 512])
    # before_scale: f16(0.2) = 1638 * 2**-13, times 1.5 = 1228.5 * 2**-12: a tie, to even 1228
    #               f16(1.4) = 1434 * 2**-10, times 1.5 = 1075.5 * 2**-9:  a tie, to even 1076
    before = reference.normalize(x, spec.replace(cast="before_scale"), w)
    np.testing.assert_array_equal(before.astype(np.float64), [1228 / 4096, 1076 / 512])


def test_cast_has_no_effect_on_float32_and_float64():
    x = np.random.default_rng(1).normal(size=(4, 8))
    w = np.random.default_rng(2).normal(size=8)
    for dtype in (np.float32, np.float64):
        a = reference.normalize(x.astype(dtype), NormSpec(), w)
        b = reference.normalize(x.astype(dtype), NormSpec(cast="before_scale"), w)
        np.testing.assert_array_equal(a, b)


def test_half_output_is_the_correctly_rounded_float64_result():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 64)).astype(bf16)
    w = rng.normal(size=64).astype(np.float32)
    b = rng.normal(size=64).astype(np.float32)
    spec = NormSpec("layer")
    exact = reference.normalize(x.astype(np.float64), spec, w, b)
    np.testing.assert_array_equal(reference.normalize(x, spec, w, b), dtypes.round_to(exact, bf16))
