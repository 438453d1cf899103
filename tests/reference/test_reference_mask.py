"""The reference's call-time ``mask`` (Flax's): the statistic over the masked-in elements only.

Forward values are checked against an independent per-row formula (math.fsum over the masked-in
elements, no code shared with the reference), gradients against central differences.
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit import NormSpec, dtypes, reference
from tests.helpers.numerical import numerical_vjp, random_params


def masked_normalize(x, mask, spec, scale=None, bias=None):
    """Per row over ``spec.axis``: mean and statistic from the masked-in values (fsum), then
    every value normalized with them. A row with nothing masked in is NaN. ``scale`` and
    ``bias`` are of x's shape (broadcast by the caller)."""
    mask = np.broadcast_to(mask, x.shape)
    axes = spec.resolve_axes(x.ndim)
    kept = [a for a in range(x.ndim) if a not in axes]
    out = np.empty(x.shape)
    for outer in itertools.product(*[range(x.shape[a]) for a in kept]):
        index = [slice(None)] * x.ndim
        for a, i in zip(kept, outer):
            index[a] = i
        row, m = x[tuple(index)].astype(np.float64), mask[tuple(index)]
        picked = [float(v) for v in row[m]]
        if not picked:
            out[tuple(index)] = np.nan
            continue
        mu = math.fsum(picked) / len(picked) if spec.kind == "layer" else 0.0
        s = math.fsum((v - mu) ** 2 for v in picked) / len(picked)
        if spec.eps_placement == "inside":
            r = 1 / math.sqrt(s + spec.eps)
        else:
            r = 1 / (math.sqrt(s) + spec.eps)
        g = 1.0 if scale is None else spec.scale_offset + scale[tuple(index)]
        b = 0.0 if bias is None else bias[tuple(index)]
        out[tuple(index)] = (row - mu) * r * g + b
    return out


SPECS = [
    NormSpec(),
    NormSpec(eps_placement="outside", eps=1e-2),
    NormSpec("layer"),
    NormSpec("layer", eps_placement="outside", eps=1e-3),
    NormSpec("layer", axis=(-2, -1), scale_offset=1.0),
    NormSpec(axis=(0, 2), bias=True),
]
MASK_SHAPES = [(3, 4, 5), (1, 1, 5), (4, 1), (5,)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_forward_matches_independent_masked_formula(spec, mask_shape):
    rng = np.random.default_rng(0)
    shape = (3, 4, 5)
    x = rng.normal(size=shape) * 2 + 1
    mask = rng.random(mask_shape) < 0.6
    scale, bias = random_params(spec, shape, rng)
    layout = [shape[a] if a in spec.resolve_axes(3) else 1 for a in range(3)]
    s = None if scale is None else np.broadcast_to(scale.reshape(layout), shape)
    b = None if bias is None else np.broadcast_to(bias.reshape(layout), shape)
    want = masked_normalize(x, mask, spec, s, b)
    got = reference.normalize(x, spec, scale, bias, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_masked_out_values_do_not_reach_the_statistic():
    """Masked-in outputs are those of the row of masked-in values alone; masked-out ones are
    normalized with the same statistic (RMS: x r), and may be NaN without spreading."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 6))
    mask = np.array([True, False, True, True, False, True])
    for spec in (NormSpec(), NormSpec("layer")):
        y = reference.normalize(x, spec, mask=mask)
        np.testing.assert_allclose(y[:, mask], reference.normalize(x[:, mask], spec), rtol=1e-14)
        poisoned = np.where(mask, x, np.nan)
        y_nan = reference.normalize(poisoned, spec, mask=mask)
        np.testing.assert_array_equal(y_nan[:, mask], y[:, mask])
        assert np.isnan(y_nan[:, ~mask]).all()
    s = np.mean(x[:, mask] ** 2, axis=1, keepdims=True)
    y = reference.normalize(x, NormSpec(), mask=mask)
    np.testing.assert_allclose(y[:, ~mask], x[:, ~mask] / np.sqrt(s + 1e-6), rtol=1e-14)


def test_all_true_mask_is_no_mask_and_integers_mean_nonzero():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    for spec in (NormSpec(), NormSpec("layer"), NormSpec("layer", variance="fast")):
        np.testing.assert_array_equal(
            reference.normalize(x, spec, mask=np.ones(5, bool)), reference.normalize(x, spec)
        )
        ints = np.array([2, 0, 1, 0, -1])
        np.testing.assert_array_equal(
            reference.normalize(x, spec, mask=ints), reference.normalize(x, spec, mask=ints != 0)
        )


def test_row_with_nothing_masked_in_is_nan():
    """As Flax: its mean and statistic are 0 / 0, so every output of that row is NaN, and so
    are its input gradient and the scale's (dbias = sum dy stays finite)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 4))
    dy = rng.normal(size=(3, 4))
    mask = np.array([[True], [False], [True]])
    for spec in (NormSpec(), NormSpec("layer"), NormSpec("layer", variance="fast")):
        scale, bias = np.ones(4), np.zeros(4)
        y = reference.normalize(x.astype(np.float32), spec, mask=mask)
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
        dx, dscale, dbias = reference.normalize_vjp(x, dy, spec, scale, bias if spec.bias else None, mask=mask)
        assert np.isnan(dx[1]).all() and np.isfinite(dx[[0, 2]]).all()
        assert np.isnan(dscale).all()
        if dbias is not None:
            np.testing.assert_allclose(dbias, dy.sum(0), rtol=1e-14)


def test_fast_variance_rounds_the_masked_moments():
    """variance="fast" with a mask: m1 = c(mean_m x), m2 = c(mean_m c(x^2)), v = max(0,
    c(m2 - c(m1^2))), in float32 (the rounding model of NormSpec), over masked-in elements."""
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(6, 16)) + 300).astype(np.float32)  # large mean: the rounding matters
    mask = rng.random((6, 16)) < 0.5
    mask[:, 0] = True
    spec = NormSpec("layer", variance="fast")
    want = np.empty(x.shape)
    for i in range(6):
        picked = x[i][mask[i]].astype(np.float64)
        m1 = np.float32(math.fsum(picked) / len(picked))
        m2 = np.float32(math.fsum(np.float32(picked * picked)) / len(picked))
        v = max(0.0, float(np.float32(float(m2) - float(np.float32(float(m1) * float(m1))))))
        want[i] = (x[i].astype(np.float64) - float(m1)) / math.sqrt(v + spec.eps)
    got = reference.normalize(x, spec, mask=mask)
    np.testing.assert_array_equal(got, dtypes.round_to(want, np.float32))
    assert not np.array_equal(got, reference.normalize(x, spec.replace(variance="two_pass"), mask=mask))


def test_bfloat16_output_is_the_float64_result_rounded_once():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 8)).astype(dtypes.bfloat16)
    mask = rng.random((4, 8)) < 0.5
    mask[:, 0] = True
    for spec in (NormSpec(), NormSpec("layer")):
        got = reference.normalize(x, spec, mask=mask)
        assert got.dtype == dtypes.bfloat16
        want = masked_normalize(x.astype(np.float64), mask, spec)
        np.testing.assert_array_equal(got, dtypes.round_to(want, dtypes.bfloat16))


def test_mask_errors_name_the_problem():
    x = np.ones((3, 5))
    with pytest.raises(ValueError, match=r"mask has shape \(3,\), which does not broadcast to x's shape \(3, 5\)"):
        reference.normalize(x, NormSpec(), mask=np.ones(3, bool))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 5\), which does not broadcast"):
        reference.normalize_vjp(x, x, NormSpec("layer"), mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match="mask applies to kind='rms' and 'layer'.*not 'partial_rms'"):
        reference.normalize(x, NormSpec("partial_rms", p=0.5), mask=np.ones(5, bool))
    with pytest.raises(ValueError, match="mask applies to kind='rms' and 'layer'.*not 'dyt'"):
        reference.normalize_vjp(x, x, NormSpec("dyt"), mask=np.ones(5, bool))
    with pytest.raises(TypeError, match=r"mask has dtype <U1; expected bool or numbers"):
        reference.normalize(x, NormSpec(), mask=np.array(list("abcde")))
    halves = np.array([0.5, 0.0, 2.0, 0.0, 1.0])  # nonzero means True, as in Flax
    np.testing.assert_array_equal(reference.normalize(x + np.arange(5), NormSpec(), mask=halves),
                                  reference.normalize(x + np.arange(5), NormSpec(),
                                                      mask=halves != 0))


# ---- gradients -------------------------------------------------------------------------------


spec_strategy = st.builds(
    lambda kind, eps, placement, offset, bias, axis: NormSpec(
        kind, eps=eps, eps_placement=placement, scale_offset=offset, bias=bias, axis=axis
    ),
    st.sampled_from(["rms", "layer"]),
    st.sampled_from([1e-6, 1e-3, 0.1]),
    st.sampled_from(["inside", "outside"]),
    st.sampled_from([0.0, 1.0]),
    st.booleans(),
    st.sampled_from([-1, (-2, -1), (0, 2)]),
)


@settings(max_examples=60, deadline=None)
@given(
    spec=spec_strategy,
    seed=st.integers(0, 2**31 - 1),
    n=st.sampled_from([1, 2, 3, 5]),
    density=st.sampled_from([0.2, 0.5, 0.9]),
)
def test_vjp_matches_finite_differences(spec, seed, n, density):
    """Random masks, so rows read 1 .. all of their elements (the degenerate K = 1 and, for
    LayerNorm, K = 2 included)."""
    rng = np.random.default_rng(seed)
    shape = (2, 3, n)
    x = rng.normal(size=shape) + rng.normal()
    dy = rng.normal(size=shape)
    mask = rng.random(shape) < density
    # Every row reads at least one element (its first): a row reading none is NaN, and would
    # make the whole loss NaN (see test_row_with_nothing_masked_in_is_nan).
    axes = spec.resolve_axes(3)
    first = np.zeros(shape, bool)
    first[tuple(0 if a in axes else slice(None) for a in range(3))] = True
    mask |= first & ~mask.any(axis=axes, keepdims=True)
    scale, bias = random_params(spec, shape, rng)
    got = reference.normalize_vjp(x, dy, spec, scale, bias, mask=mask)
    h = 1e-6
    want = numerical_vjp(x, dy, spec, scale, bias, h, mask=mask)
    # The differences' own error: the loss's float64 rounding over 2h. It matters where the
    # statistic is tiny (a LayerNorm row reading one element has s = 0, so the elements masked
    # out are scaled by r(0), up to 1/eps).
    y = reference.normalize(x, spec, scale, bias, mask=mask)
    noise = 8 * np.finfo(np.float64).eps * np.abs(dy * y).sum() / (2 * h)
    for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == np.float64
        atol = max(1e-6 * max(np.abs(w).max(), 1e-3), noise)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=atol, err_msg=name)


@pytest.mark.parametrize("kind, picked", [("rms", 1), ("layer", 2)])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_degenerate_rows_keep_their_small_gradient(kind, picked, placement):
    """K = 1 (RMS) or K = 2 (LayerNorm), the other elements' dy zero: the masked-in gradient
    is ``own (d - [layer] mean_R d)``, own = eps r^3 (inside) or eps r^2 (outside), about 1e-6
    of r here, where the sums over the row would cancel; checked against that formula and
    against central differences in float64 with a relative bound."""
    eps = 1e-6
    spec = NormSpec(kind, eps=eps, eps_placement=placement)
    x = np.array([[1.5, -0.5, 3.0, 2.0]])
    dy = np.array([[0.7, -0.2 if picked == 2 else 0.0, 0.0, 0.0]])
    mask = np.array([[True, picked == 2, False, False]])
    dx, _, _ = reference.normalize_vjp(x, dy, spec, mask=mask)
    c = x[0, :picked] - (x[0, :picked].mean() if kind == "layer" else 0.0)
    s = np.mean(c**2)
    r = 1 / np.sqrt(s + eps) if placement == "inside" else 1 / (np.sqrt(s) + eps)
    own = eps * r**3 if placement == "inside" else eps * r**2
    d = dy[0, :picked] - (dy[0, :picked].mean() if kind == "layer" else 0.0)
    np.testing.assert_allclose(dx[0, :picked], own * d, rtol=1e-9)
    np.testing.assert_allclose(dx[0, picked:], 0.0, atol=0)
    want = numerical_vjp(x, dy, spec, None, None, h=1e-4, mask=mask)[0]
    np.testing.assert_allclose(dx, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
