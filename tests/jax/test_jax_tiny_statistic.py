"""normkit.jax gradients where the statistic reads tiny values, eps outside the square root.

The term ``x_i r'(s) = -r**2 x_i / (2 sqrt(s))`` reads ``x_i / sqrt(s)``, which is scale-free:
when the elements the statistic reads are tiny and the others are not (partial RMS, a mask),
that term dominates ``dx`` however small they are, while r stays near ``1 / eps``. Forward and
gradients against the reference, on every path (jit or not, functional, linen, nnx), dtypes and
kinds, down to values whose squares underflow float32 (XLA flushes subnormals to zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import normkit.jax as nkjax
from normkit import NormSpec, reference, tolerances
from normkit.jax import functional as F

# 1e-9 .. 1e-15: sqrt(s) far below eps; 1e-25, 1e-30: the squares underflow float32.
TINY = [1e-9, 1e-12, 1e-15, 1e-25, 1e-30]
PARTIAL = NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside")


def _row(tiny: float, n: int = 16) -> np.ndarray:
    """Rows whose first quarter is tiny (one row, and one of them exactly zero but one), the
    rest of order one; plus an ordinary row."""
    rng = np.random.default_rng(0)
    x = 1 + 0.5 * rng.standard_normal((3, n))
    x[0, : n // 4] = [tiny, 0, 0, 0]
    x[1, : n // 4] = tiny * rng.standard_normal(n // 4)
    return x


def _check_grads(got: tuple, x: np.ndarray, dy: np.ndarray, spec: NormSpec, w, **kw) -> None:
    rdx, rdw, _ = reference.normalize_vjp(x, dy, spec, w, **kw)
    tolerances.assert_close(np.asarray(got[0]), rdx, quantity="grad", what=f"{spec} dx")
    tolerances.assert_close(np.asarray(got[1]), rdw, quantity="grad", what=f"{spec} dscale")


def test_the_issue_example_partial_rms_float32() -> None:
    """x = [1e-12, 0, 0, 0] + [1] * 12, dy ones: dx[0, 0] = -5.99999e10 (was -2.52e10)."""
    x = np.array([[1e-12, 0, 0, 0] + [1] * 12], np.float32)
    dx = jax.grad(lambda x: jnp.sum(F.normalize(x, PARTIAL)))(jnp.asarray(x))
    expected = reference.normalize_vjp(x, np.ones_like(x), PARTIAL)[0]
    assert abs(float(dx[0, 0]) / expected[0, 0] - 1) < 1e-5
    tolerances.assert_close(np.asarray(dx), expected, quantity="grad", what="issue example")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiny", TINY)
def test_functional_partial_rms(tiny: float, jit: bool) -> None:
    x = _row(tiny).astype(np.float32)
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    w = np.linspace(0.5, 1.5, 16).astype(np.float32)
    fn = lambda x, w: F.normalize(x, PARTIAL, w)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(fn) if jit else fn, jnp.asarray(x), jnp.asarray(w))
    tolerances.assert_close(np.asarray(y), reference.normalize(x, PARTIAL, w), what="y")
    _check_grads(vjp(jnp.asarray(dy)), x, dy, PARTIAL, w)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("tiny", TINY)
def test_linen_and_nnx_with_a_mask_reading_tiny_values(tiny: float, kind: str) -> None:
    """Flax's mask= selecting only the small elements, for RMSNorm and LayerNorm."""
    x = _row(tiny).astype(np.float32)
    if kind == "layer":  # tiny centered values: a small spread around a tiny mean
        x[:2, :4] += tiny
    dy = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    mask = np.arange(16) < 4
    spec = NormSpec(kind, eps=1e-5, eps_placement="outside", bias=kind == "layer")
    w = np.linspace(0.5, 1.5, 16).astype(np.float32)
    params = {"scale": w} if kind == "rms" else {"scale": w, "bias": np.zeros(16, np.float32)}
    linen = nkjax.from_spec(spec)
    module = nkjax.nnx.from_spec(spec, 16)
    module.scale[...] = w

    def linen_loss(x, w):
        return jnp.vdot(linen.apply({"params": dict(params, scale=w)}, x, mask=mask), dy)

    rdx, rdw, _ = reference.normalize_vjp(x, dy, spec, w, params.get("bias"), mask=mask)
    dx, dw = jax.grad(linen_loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    nnx_loss = lambda m, x: jnp.vdot(m(x, mask=mask), dy)  # noqa: E731
    state, nnx_dx = nnx.jit(nnx.grad(nnx_loss, argnums=(0, 1)))(module, jnp.asarray(x))
    for name, got_dx, got_dw in (("linen", dx, dw), ("nnx", nnx_dx, state["scale"][...])):
        tolerances.assert_close(np.asarray(got_dx), rdx, quantity="grad", what=f"{name} dx")
        tolerances.assert_close(np.asarray(got_dw), rdw, quantity="grad", what=f"{name} dw")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_other_dtypes(dtype: str) -> None:
    """bfloat16 shares float32's range (1e-25 underflows the squares); float16's smallest
    normal is 6e-5 (its subnormals are normal float32 values); float64 squares underflow below 1e-154."""
    tiny = {"bfloat16": 1e-25, "float16": 1e-6, "float64": 1e-156}[dtype]
    with jax.enable_x64(dtype == "float64"):
        x = jnp.asarray(_row(tiny), dtype)
        dy = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), dtype)
        y, vjp = jax.vjp(jax.jit(lambda x: F.normalize(x, PARTIAL)), x)
        (dx,) = vjp(dy)
        assert dx.dtype == jnp.dtype(dtype)
    xs, dys = np.asarray(x), np.asarray(dy)
    tolerances.assert_close(np.asarray(y), reference.normalize(xs, PARTIAL), what=f"{dtype} y")
    expected = reference.normalize_vjp(xs, dys, PARTIAL)[0]
    tolerances.assert_close(np.asarray(dx), expected, quantity="grad", what=f"{dtype} dx")


def test_eps_inside_is_unaffected() -> None:
    """Inside, the term reads y_hat_i, which vanishes with x_i: nothing to recover, and the
    same inputs still match."""
    spec = PARTIAL.replace(eps_placement="inside")
    x = _row(1e-25).astype(np.float32)
    dy = np.ones_like(x)
    (dx,) = jax.vjp(jax.jit(lambda x: F.normalize(x, spec)), jnp.asarray(x))[1](jnp.asarray(dy))
    expected = reference.normalize_vjp(x, dy, spec)[0]
    tolerances.assert_close(np.asarray(dx), expected, quantity="grad", what="inside")


def test_zero_rows_keep_the_finite_gradient() -> None:
    """s = 0 exactly (every element read is zero): the reference drops the term (0, not 0/0)."""
    x = np.zeros((2, 16), np.float32)
    x[1, 4:] = 1.0
    dy = np.ones_like(x)
    (dx,) = jax.vjp(jax.jit(lambda x: F.normalize(x, PARTIAL)), jnp.asarray(x))[1](jnp.asarray(dy))
    expected = reference.normalize_vjp(x, dy, PARTIAL)[0]
    assert np.isfinite(np.asarray(dx)).all()
    tolerances.assert_close(np.asarray(dx), expected, quantity="grad", what="zero rows")


def test_nnx_module_grad_through_nnx_grad() -> None:
    module = nkjax.nnx.PartialRMSNorm(16, p=0.25, epsilon=1e-5, eps_placement="outside")
    x = _row(1e-12).astype(np.float32)
    dx = nnx.grad(lambda m, x: jnp.sum(m(x)), argnums=1)(module, jnp.asarray(x))
    expected = reference.normalize_vjp(x, np.ones_like(x), module.spec)[0]
    tolerances.assert_close(np.asarray(dx), expected, quantity="grad", what="nnx.grad")
