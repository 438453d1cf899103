"""normkit.reference against independent formulas (forward) and finite differences (gradients)."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit import NormSpec, dtypes, reference
from tests.helpers.numerical import numerical_vjp, random_params


def independent_normalize(x, spec, scale=None, bias=None):
    """The spec's formula, element by element, with math.fsum: no shared code with the reference."""
    axes = spec.resolve_axes(x.ndim)
    kept = [a for a in range(x.ndim) if a not in axes]
    out = np.empty(x.shape, dtype=np.float64)
    normalized_ranges = [range(x.shape[a]) for a in axes]
    for outer in itertools.product(*[range(x.shape[a]) for a in kept]):
        positions = []
        for inner in itertools.product(*normalized_ranges):
            index = [0] * x.ndim
            for a, i in zip(kept, outer):
                index[a] = i
            for a, i in zip(axes, inner):
                index[a] = i
            positions.append((tuple(index), inner))
        row = [float(x[index]) for index, _ in positions]
        n = len(row)
        if spec.kind == "layer":
            mu = math.fsum(row) / n
            row = [v - mu for v in row]
        k = max(1, math.floor(n * spec.p)) if spec.kind == "partial_rms" else n
        s = math.fsum(v * v for v in row[:k]) / k
        r = 1 / math.sqrt(s + spec.eps) if spec.eps_placement == "inside" else 1 / (math.sqrt(s) + spec.eps)
        for (index, inner), v in zip(positions, row):
            g = spec.scale_offset + float(scale[inner]) if scale is not None else 1.0
            b = float(bias[inner]) if bias is not None else 0.0
            out[index] = v * r * g + b
    return out


SPECS = [
    NormSpec(),
    NormSpec(eps=1e-3),
    NormSpec(eps_placement="outside", eps=1e-2),
    NormSpec("layer"),
    NormSpec("layer", eps_placement="outside", eps=1e-3, bias=False),
    NormSpec("partial_rms", p=0.25),
    NormSpec("partial_rms", p=0.01, eps_placement="outside", bias=True),  # k = 1
    NormSpec(scale_offset=1.0),
    NormSpec("layer", scale_offset=1.0, axis=(-2, -1)),
    NormSpec(axis=(0, 2)),
    NormSpec("partial_rms", p=0.5, axis=(1, 2), bias=True),
    NormSpec(scale=False),
    NormSpec("layer", scale=False, bias=False, axis=1),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("shape", [(3, 4, 8), (2, 5, 1), (1, 1, 1), (2, 3, 7)])
def test_forward_matches_independent_formula(spec, shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape) * 3 + 0.5
    scale, bias = random_params(spec, shape, rng)
    got = reference.normalize(x, spec, scale, bias)
    want = independent_normalize(x, spec, scale, bias)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_n_equal_one_rms_is_sign_times_shrinkage():
    x = np.array([[3.0], [-2.0], [0.0]])
    spec = NormSpec(eps=1e-2)
    want = x / np.sqrt(x**2 + 1e-2)
    np.testing.assert_allclose(reference.normalize(x, spec), want, rtol=1e-15)
    np.testing.assert_array_equal(reference.normalize(x, NormSpec("layer")), np.zeros_like(x))


def test_partial_statistic_ignores_features_beyond_k():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 16))
    spec = NormSpec("partial_rms", p=0.25)  # k = 4
    y = reference.normalize(x, spec)
    x2 = x.copy()
    x2[:, 4:] *= 10.0
    y2 = reference.normalize(x2, spec)
    np.testing.assert_allclose(y2[:, :4], y[:, :4], rtol=1e-14)
    np.testing.assert_allclose(y2[:, 4:], 10.0 * y[:, 4:], rtol=1e-14)


def test_absent_params_mean_initial_values():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 6))
    for spec in (NormSpec(scale_offset=1.0), NormSpec("layer")):
        init = np.full(6, spec.scale_init)
        np.testing.assert_array_equal(reference.normalize(x, spec), reference.normalize(x, spec, init, None))


def test_float32_input_returns_float32_rounded_once():
    x = np.random.default_rng(3).normal(size=(5, 9)).astype(np.float32)
    spec = NormSpec("layer")
    y = reference.normalize(x, spec)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, reference.normalize(x.astype(np.float64), spec).astype(np.float32))


def test_nan_stays_in_its_row():
    x = np.ones((3, 4))
    x[1, 2] = np.nan
    y = reference.normalize(x, NormSpec("layer"))
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


# ---- gradients -------------------------------------------------------------------------------


spec_strategy = st.builds(
    lambda kind, eps, placement, p, offset, bias, scale, axis: NormSpec(
        kind,
        eps=eps,
        eps_placement=placement,
        p=p if kind == "partial_rms" else None,
        scale=scale or offset != 0,
        scale_offset=offset,
        bias=bias,
        axis=axis,
    ),
    st.sampled_from(["rms", "partial_rms", "layer"]),
    st.sampled_from([1e-6, 1e-3, 0.1]),
    st.sampled_from(["inside", "outside"]),
    st.floats(0.05, 1.0),
    st.sampled_from([0.0, 1.0]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([-1, (-2, -1), (0, 2), 1]),
)


@settings(max_examples=60, deadline=None)
@given(spec=spec_strategy, seed=st.integers(0, 2**31 - 1), n=st.sampled_from([1, 2, 3, 5]))
def test_vjp_matches_finite_differences(spec, seed, n):
    rng = np.random.default_rng(seed)
    shape = (2, 3, n)
    x = rng.normal(size=shape) + rng.normal()
    dy = rng.normal(size=shape)
    scale, bias = random_params(spec, shape, rng)
    got = reference.normalize_vjp(x, dy, spec, scale, bias)
    want = numerical_vjp(x, dy, spec, scale, bias)
    for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * max(np.abs(w).max(), 1e-3), err_msg=name)


def test_partial_gradient_statistic_term_only_in_first_k():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 8))
    dy = rng.normal(size=(2, 8))
    spec = NormSpec("partial_rms", p=0.25)  # k = 2
    dx, _, _ = reference.normalize_vjp(x, dy, spec)
    r = 1 / np.sqrt(np.mean(x[:, :2] ** 2, axis=1, keepdims=True) + spec.eps)
    # beyond k an element only scales by r: its gradient is r * dy exactly
    np.testing.assert_allclose(dx[:, 2:], r * dy[:, 2:], rtol=1e-14)
    assert not np.allclose(dx[:, :2], r * dy[:, :2])


def test_outside_gradient_at_zero_statistic_is_finite():
    x = np.zeros((1, 4))
    dy = np.ones((1, 4))
    dx, ds, _ = reference.normalize_vjp(x, dy, NormSpec(eps_placement="outside", eps=1e-3))
    np.testing.assert_allclose(dx, np.full((1, 4), 1e3))
    np.testing.assert_array_equal(ds, np.zeros(4))


# ---- input checks ----------------------------------------------------------------------------


def test_param_checks_name_the_problem():
    x = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"scale has shape \(3,\), expected \(4,\)"):
        reference.normalize(x, NormSpec(), np.ones(3))
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(3, 4\)"):
        reference.normalize(x, NormSpec("layer", axis=(-2, -1)), None, np.ones(4))
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        reference.normalize(x, NormSpec(), None, np.ones(4))
    with pytest.raises(ValueError, match="scale was given but the spec has scale=False"):
        reference.normalize(x, NormSpec(scale=False), np.ones(4))
    with pytest.raises(TypeError, match="scale has dtype int64"):
        reference.normalize(x, NormSpec(), np.ones(4, dtype=np.int64))
    with pytest.raises(ValueError, match="axis 3 is out of range for an input of rank 3"):
        reference.normalize(x, NormSpec(axis=3))
    with pytest.raises(ValueError, match=r"dy has shape \(2, 3\), expected the shape of x"):
        reference.normalize_vjp(x, np.ones((2, 3)), NormSpec())
    with pytest.raises(ValueError, match="normalized axes .* must not be empty"):
        reference.normalize(np.ones((2, 0)), NormSpec())


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_])
def test_non_float_input_is_a_type_error(dtype):
    with pytest.raises(TypeError, match=f"x has dtype {np.dtype(dtype).name}; normkit supports"):
        reference.normalize(np.ones((2, 4), dtype=dtype), NormSpec())


def test_half_inputs_are_accepted_and_returned_in_their_dtype():
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    for dtype in dtypes.HALF_DTYPES:
        y = reference.normalize(x.astype(dtype), NormSpec())
        assert y.dtype == dtype


@pytest.mark.parametrize("kind", ["rms", "partial_rms", "layer"])
def test_float64_rows_whose_mean_square_overflows_are_refused_by_name(kind):
    """A float64 row of magnitude 1e200 has s = inf: the reference would return zeros (x r with
    r = 0) where the normalized row is of order 1, so it refuses the row instead; the largest
    float32 magnitudes (3e38, squares 1e77) are computed."""
    spec = NormSpec(kind, p=0.5 if kind == "partial_rms" else None)
    x = np.random.default_rng(0).standard_normal((3, 8))
    x[2] *= 1e200
    with pytest.raises(ValueError, match="does not compute row 2: finite values whose mean"):
        reference.normalize(x, spec)
    with pytest.raises(ValueError, match="does not compute row 2"):
        reference.normalize_vjp(x, np.ones_like(x), spec)
    x[2] = x[2] / 1e200 * 3e38
    y = reference.normalize(x, spec)
    assert np.isfinite(y).all() and np.abs(y[2]).max() > 0.5
