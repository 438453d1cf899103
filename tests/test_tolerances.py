"""The tolerance policy: bounds per dtype, and the error measurement in abs, rel and ulp units."""

import numpy as np
import pytest

from normkit import dtypes, tolerances

bf16, f16 = dtypes.bfloat16, dtypes.float16


def test_bounds_per_dtype():
    assert tolerances.bound(np.float32) == tolerances.Bound(1e-6, "max_abs / max|ref|")
    assert tolerances.bound(np.float64, "grad") == tolerances.Bound(1e-5, "max_abs / max|ref|")
    assert tolerances.bound(bf16) == tolerances.Bound(1.0, "ulp")
    assert tolerances.bound(f16, cast="before_scale") == tolerances.Bound(2.0, "ulp")
    assert tolerances.bound(bf16, "grad") == tolerances.Bound(2.0, "ulp")
    with pytest.raises(ValueError, match="quantity='fwd' is invalid"):
        tolerances.bound(np.float32, "fwd")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the measured array has dtype int32"):
        tolerances.bound(np.int32)


def steps_away(values, dtype, steps):
    """``values`` moved ``steps`` representable numbers of ``dtype`` towards +inf."""
    v = values.astype(np.float64)
    for _ in range(steps):
        v = v + dtypes.ulp(v, dtype) * np.where(v < 0, 1 - 2**-20, 1)
        v = dtypes.round_to(v, dtype).astype(np.float64)
    return v.astype(dtype)


@pytest.mark.parametrize("dtype", [bf16, f16])
def test_half_forward_one_ulp_passes_two_fail_unless_before_scale(dtype):
    expected = np.linspace(0.5, 3.0, 11).astype(dtype)
    one = steps_away(expected, dtype, 1)
    two = steps_away(expected, dtype, 2)
    m1 = tolerances.measure(one, expected)
    assert m1.max_ulp == pytest.approx(1.0) and m1.passed
    m2 = tolerances.measure(two, expected)
    assert m2.max_ulp == pytest.approx(2.0) and not m2.passed
    assert tolerances.measure(two, expected, cast="before_scale").passed
    assert tolerances.measure(expected, expected).error == 0.0


def test_float32_forward_relative_to_max():
    expected = np.array([4.0, -2.0, 0.5], dtype=np.float32)
    ok = expected + np.array([3e-6, 0, 0], dtype=np.float32)  # 0.75e-6 of max|ref|
    bad = expected + np.array([0, 0, 8e-6], dtype=np.float32)  # 2e-6 of max|ref|
    m = tolerances.measure(ok, expected)
    assert m.passed and m.error == pytest.approx(3e-6 / 4, rel=0.1)
    m = tolerances.measure(bad, expected)
    assert not m.passed and m.worst_index == (2,)
    assert m.max_rel == pytest.approx(8e-6 / 0.5, rel=0.1)
    assert tolerances.measure(bad, expected, quantity="grad").passed


def test_ulps_below_the_floor_are_measured_at_the_floor():
    expected = np.array([1.0, 2.0**-14], dtype=np.float64)
    actual = expected + np.array([0.0, 2.0**-20])
    # at 2**-14 an error of 2**-20 is 2**-20 / 2**-24 = 16 float16 ulps of the element, but the
    # floor is 2**-10 * max|ref| = 2**-10, where the ulp is 2**-20: one ulp.
    m = tolerances.measure(actual.astype(np.float64), expected, dtype=f16, quantity="grad")
    assert m.max_ulp == pytest.approx(1.0)


def test_nonfinite_must_match_the_reference():
    expected = np.array([1.0, np.nan, np.inf], dtype=np.float32)
    assert tolerances.measure(expected.copy(), expected).passed
    wrong = np.array([np.nan, np.nan, np.inf], dtype=np.float32)
    m = tolerances.measure(wrong, expected)
    assert not m.passed and m.nonfinite_mismatch == 1
    assert "1 elements NaN/inf where the reference is not" in m.describe()
    assert not tolerances.measure(np.array([1.0, 0.0, np.inf], np.float32), expected).passed


def test_assert_close_reports_figures():
    expected = np.ones(4, dtype=bf16)
    with pytest.raises(AssertionError, match=r"dx: FAIL \[bfloat16\] error 4 ulp \(bound 2\)"):
        tolerances.assert_close(steps_away(expected, bf16, 4), expected, quantity="grad", what="dx")
    with pytest.raises(ValueError, match=r"actual has shape \(3,\), the reference \(4,\)"):
        tolerances.measure(np.ones(3), np.ones(4))


def test_measurement_to_dict_is_json_ready():
    import json

    d = tolerances.measure(np.ones(3, np.float32), np.ones(3, np.float32)).to_dict()
    assert json.loads(json.dumps(d))["passed"] is True


def test_before_scale_ulps_are_taken_at_the_scaled_term():
    from normkit import NormSpec, reference

    # y_hat = 0.2 (x = [1, 7]); with w = 1 and a bias of -0.19 the output is about 0.01, but the
    # before_scale rounding happened at 0.2: one float16 ulp there (2**-13) is 16 ulps at 0.01 (2**-17).
    x = np.array([[1.0, 7.0]], dtype=f16)
    spec = NormSpec(cast="before_scale", bias=True, eps=1e-12)
    bias = np.array([-0.19, 0.0], np.float32)
    expected = reference.normalize(x, spec, None, bias)
    actual = expected.astype(np.float64) + np.array([[2.0**-13, 0.0]])
    assert tolerances.measure(actual, expected, f16, cast=spec.cast).max_ulp == pytest.approx(16)
    magnitude = reference.scaled_magnitude(x, spec)
    np.testing.assert_allclose(magnitude, [[0.2, 1.4]], rtol=1e-12)
    m = tolerances.measure(actual, expected, f16, cast=spec.cast, magnitude=magnitude)
    assert m.max_ulp == pytest.approx(1.0) and m.passed


def test_a_reference_beyond_the_dtype_range_is_expected_as_infinity():
    expected = np.array([4.2e5, -1.0e6, 1.0])  # float16's largest finite value is 65504
    actual = np.array([np.inf, -np.inf, 1.0], dtype=f16)
    m = tolerances.measure(actual, expected, quantity="grad")
    assert m.passed and m.nonfinite_mismatch == 0
    wrong = np.array([65504.0, -np.inf, 1.0], dtype=f16)
    assert tolerances.measure(wrong, expected, quantity="grad").nonfinite_mismatch == 1
    # float32 holds 4.2e5: there the finite value is the answer
    assert not tolerances.measure(actual.astype(np.float32), expected, quantity="grad").passed
