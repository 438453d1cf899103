"""normkit.jax at the edges of float32: overflowing statistics, large means, k = 1, eps against
the dtype, module sizes; forward and gradients against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normkit import NormSpec, reference, tolerances
from normkit.jax import functional as F
from normkit.jax import linen, nnx

KINDS = [
    pytest.param({"kind": "rms"}, id="rms"),
    pytest.param({"kind": "partial_rms", "p": 0.5}, id="partial"),
    pytest.param({"kind": "layer"}, id="layer"),
]
PLACEMENTS = ["inside", "outside"]


def check(spec: NormSpec, x: np.ndarray, dy: np.ndarray, what: str) -> None:
    """Forward (jit) and gradients (x and scale) against the reference."""
    w = np.linspace(0.5, 1.5, spec.param_shape(x.shape)[0]).astype(np.float32)
    fn = jax.jit(lambda x, w: F.normalize(x, spec, w))
    y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    expected = reference.normalize(x, spec, w)
    rdx, rdw, _ = reference.normalize_vjp(x, dy, spec, w)
    tolerances.assert_close(np.asarray(y), expected, what=f"{what} y (jit)")
    tolerances.assert_close(np.asarray(dx), rdx, quantity="grad", what=f"{what} dx")
    tolerances.assert_close(np.asarray(dw), rdw, quantity="grad", what=f"{what} dw")


SCALES = np.array([1.0, 1e20, 3e38, 1e15, 1e-30, 1.0])


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_far_from_unit_scale(kind: dict, placement: str) -> None:
    """|x| above 1.8e19 overflows x**2 in float32; those rows are rescaled and match the
    reference, gradients too (dy scaled so that they are normal numbers: XLA flushes
    subnormals to zero). Ordinary rows in the batch are unaffected."""
    rng = np.random.default_rng(0)
    spec = NormSpec(**kind, eps_placement=placement)
    x = rng.standard_normal((len(SCALES), 16)) * SCALES[:, None]
    x[2] = np.sign(x[2]) * 3e38
    dy = rng.standard_normal(x.shape) * np.minimum(SCALES, 1e30)[:, None]
    check(spec, x.astype(np.float32), dy.astype(np.float32), f"{spec} scales {SCALES}")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_large_mean_layer_norm_float32(placement: str) -> None:
    rng = np.random.default_rng(1)
    spec = NormSpec("layer", eps_placement=placement)
    x = (rng.standard_normal((4, 256)) + 1e6).astype(np.float32)
    check(spec, x, rng.standard_normal(x.shape).astype(np.float32), "mean 1e6")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("n", [1, 8])
def test_partial_rms_with_one_statistic_element(placement: str, n: int) -> None:
    """k = 1: element 0's gradient in closed form (dy zero elsewhere: nothing hides an error)."""
    spec = NormSpec("partial_rms", p=1 / 16, eps_placement=placement)
    x = np.linspace(0.5, 3.0, 3 * n).reshape(3, n).astype(np.float32)
    dy = np.zeros_like(x)
    dy[:, 0] = 1.0
    check(spec, x, dy, f"k = 1, n = {n}")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_stay_where_the_reference_has_them(kind: dict, placement: str) -> None:
    spec = NormSpec(**kind, eps_placement=placement)
    x = np.random.default_rng(3).standard_normal((4, 10)).astype(np.float32)
    x[0, 7], x[1, 2], x[2, 0] = np.nan, np.inf, 1e30
    y = jax.jit(lambda x: F.normalize(x, spec))(x)
    tolerances.assert_close(np.asarray(y), reference.normalize(x, spec), what="NaN/inf rows")


@pytest.mark.parametrize("eps, dtype", [(1e-46, "float32"), (1e-39, "bfloat16"), (1e39, "float32")])
def test_eps_out_of_range_for_the_dtype_is_refused(eps: float, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"out of range for a {dtype} input"):
        F.rms_norm(jnp.zeros((2, 4), dtype), eps=eps, eps_placement="outside")


@pytest.mark.parametrize("shape", [True, (4, False)], ids=["bool", "tuple-with-bool"])
def test_nnx_refuses_a_bool_size(shape: object) -> None:
    with pytest.raises(ValueError, match=r"must give one positive size .*\(ints, not bools\)"):
        nnx.RMSNorm(shape, axis=-1 if shape is True else (-2, -1))  # type: ignore[arg-type]


def test_modules_on_overflowing_rows_match_the_reference() -> None:
    x = (np.random.default_rng(4).standard_normal((2, 8)) * 1e20).astype(np.float32)
    expected = reference.normalize(x, NormSpec())
    tolerances.assert_close(np.asarray(nnx.RMSNorm(8)(x)), expected, what="nnx.RMSNorm")
    module = linen.RMSNorm()
    y = module.apply(module.init(jax.random.key(0), x), x)
    tolerances.assert_close(np.asarray(y), expected, what="linen.RMSNorm")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_large_cotangents_on_large_rows(kind: dict, placement: str) -> None:
    """Rows of |x| ~ 1e9 (r ~ 2**-30, still the common program's) with dy ~ 1e29: the sum of
    d x overflows float32 where the sum of d y_hat does not, and the gradient is finite."""
    rng = np.random.default_rng(5)
    spec = NormSpec(**kind, eps_placement=placement)
    x = rng.standard_normal((3, 16)) * np.array([1e9, 1.0, 1e9])[:, None]
    dy = rng.standard_normal(x.shape) * np.array([1e29, 1.0, 1.0])[:, None]
    check(spec, x.astype(np.float32), dy.astype(np.float32), "|x| 1e9, |dy| 1e29")
