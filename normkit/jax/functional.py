"""`NormSpec` as pure JAX functions with an analytic `jax.custom_vjp`.

The backward pass saves only the input and the statistic ``s`` per row (float32, or float64
for float64 inputs), besides references to the parameters. The functions work under ``jit``,
``grad``, ``vmap``, ``remat`` and ``scan``, and inside ``shard_map`` with ``axis_name``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, NormSpec

__all__ = ["normalize", "rms_norm", "partial_rms_norm", "layer_norm"]

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@dataclass(frozen=True)
class _Plan:
    """What the custom_vjp needs besides the arrays; hashable, so it is a static argument."""

    spec: NormSpec
    axes: tuple[int, ...]
    axis_name: str | None


def normalize(
    x: jax.Array,
    spec: NormSpec,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    r"""``spec`` applied to ``x`` (see `NormSpec` for the math and the dtype policy).

    Per row ``x`` over ``spec.axis``: ``y = y_hat * (scale_offset + scale) + bias`` with
    ``y_hat = x r(s)`` (RMS kinds) or ``(x - mean(x)) r(s)`` (LayerNorm, variance computed in two
    passes). Statistics are computed in float32 (float64 for float64 inputs).

    Args:
      x: a floating-point array (float16, bfloat16, float32 or float64).
      spec: the norm.
      scale: ``w``, of shape ``spec.param_shape(x.shape)``, any float dtype; None means its
        initial value (effective scale 1).
      bias: ``b``, of the same shape; None means zero.
      dtype: the dtype to compute in and return; ``x`` is cast to it first. None: ``x.dtype``.
        The output never takes the parameters' dtype.
      axis_name: the mesh axis (``shard_map``/``pmap``) the normalized axes are sharded over;
        the statistics are then reduced across it, so each shard gets the unsharded result.
        With ``kind="partial_rms"`` the statistic reads the first ``k = spec.stat_size(N)``
        elements of the global row of ``N = n * axis_size`` elements (shards in mesh order);
        this needs a single normalized axis.

    Returns:
      An array of ``x``'s shape and of dtype ``dtype`` (default ``x.dtype``).

    Raises:
      TypeError: ``x`` (or ``dtype``, ``scale``, ``bias``) is not floating-point.
      ValueError: an axis is out of range, a parameter has the wrong shape or is given although
        the spec lacks it, partial RMS is sharded over several normalized axes, or ``spec.eps``
        is out of the range of the compute dtype (`NormSpec.check_eps`).
    """
    spec.require_defaults("normkit.jax")
    x = jnp.asarray(x)
    out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"x has dtype {x.dtype}; normkit norms need a floating-point input "
            "(float16, bfloat16, float32 or float64)"
        )
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"dtype={out_dtype} is not a floating-point dtype")
    x = x.astype(out_dtype)
    spec.check_eps(out_dtype.name)
    axes = spec.resolve_axes(x.ndim)
    if spec.kind == "partial_rms" and axis_name is not None and len(axes) != 1:
        raise ValueError(
            f"partial RMS with axis_name={axis_name!r} needs a single normalized axis, got "
            f"axes {axes}: the global order of the first k elements is undefined otherwise"
        )
    expected = spec.param_shape(x.shape)
    for name, value, present in (("scale", scale, spec.scale), ("bias", bias, spec.bias)):
        if value is None:
            continue
        if not present:
            raise ValueError(f"{name} was given but the spec has {name}=False")
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(f"{name} has dtype {jnp.result_type(value)}; expected a float dtype")
        if jnp.shape(value) != expected:
            raise ValueError(
                f"{name} has shape {jnp.shape(value)}, but x of shape {x.shape} normalized over "
                f"axes {axes} needs {expected}: wrong feature size for this layer"
            )
    for a in axes:
        if x.shape[a] == 0:
            raise ValueError(f"x has shape {x.shape}: the normalized axis {a} is empty")
    return _norm(_Plan(spec, axes, axis_name), x, scale, bias)


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = DEFAULT_EPS,
    eps_placement: EpsPlacement = "inside",
    axis: int | tuple[int, ...] = -1,
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """RMSNorm: `normalize` with ``NormSpec(kind="rms", ...)`` built from these arguments.

    The `NormSpec` fields have their NormSpec meaning and defaults (the spec has a bias when
    ``bias`` is given); ``scale``, ``bias``, ``dtype`` and ``axis_name`` are `normalize`'s.
    """
    spec = NormSpec(
        kind="rms", eps=eps, eps_placement=eps_placement, axis=axis,
        scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, scale, bias, dtype=dtype, axis_name=axis_name)


def partial_rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    p: float,
    eps: float = DEFAULT_EPS,
    eps_placement: EpsPlacement = "inside",
    axis: int | tuple[int, ...] = -1,
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Partial RMSNorm (statistic over the first ``spec.stat_size(n)`` elements of a row).

    `normalize` with ``NormSpec(kind="partial_rms", p=p, ...)``; arguments as in `rms_norm`.
    """
    spec = NormSpec(
        kind="partial_rms", p=p, eps=eps, eps_placement=eps_placement, axis=axis,
        scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, scale, bias, dtype=dtype, axis_name=axis_name)


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = DEFAULT_EPS,
    eps_placement: EpsPlacement = "inside",
    axis: int | tuple[int, ...] = -1,
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """LayerNorm: `normalize` with ``NormSpec(kind="layer", ...)``; arguments as in `rms_norm`."""
    spec = NormSpec(
        kind="layer", eps=eps, eps_placement=eps_placement, axis=axis,
        scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, scale, bias, dtype=dtype, axis_name=axis_name)


# --- the custom_vjp ---------------------------------------------------------------------------


def _stat_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _psum(value: jax.Array, plan: _Plan) -> jax.Array:
    return value if plan.axis_name is None else lax.psum(value, plan.axis_name)


def _row_size(x: jax.Array, plan: _Plan) -> int:
    """n: the number of elements in a (global) row."""
    n = int(np.prod([x.shape[a] for a in plan.axes]))
    return n if plan.axis_name is None else n * lax.axis_size(plan.axis_name)


def _row_mean(value: jax.Array, plan: _Plan, n: int) -> jax.Array:
    return _psum(jnp.sum(value, axis=plan.axes, keepdims=True), plan) / n


def _partial_mask(x: jax.Array, plan: _Plan, n: int) -> tuple[jax.Array, int]:
    """The elements the partial statistic reads (broadcastable to x), and their count k."""
    k = plan.spec.stat_size(n)
    shape = [x.shape[a] if a in plan.axes else 1 for a in range(x.ndim)]
    local = lax.broadcasted_iota(jnp.int32, shape, plan.axes[0])
    for a in plan.axes[1:]:
        local = local * x.shape[a] + lax.broadcasted_iota(jnp.int32, shape, a)
    if plan.axis_name is not None:
        local = local + lax.axis_index(plan.axis_name) * x.shape[plan.axes[0]]
    return local < k, k


def _centered(xf: jax.Array, plan: _Plan, n: int) -> jax.Array:
    """``x - mean(x)`` per row for LayerNorm (``x`` for the RMS kinds), with one correction pass:
    the mean of the centered values is subtracted again, recovering what the rounding of a
    large mean loses."""
    if plan.spec.kind != "layer":
        return xf
    if n == 2 and plan.axis_name is None:
        # x - mean(x) = (x - x_other) / 2 (flipping the normalized axes swaps the two elements):
        # one rounding, relative to the centered values; the mean's rounding is relative to |x|,
        # which at n = 2 can dwarf them.
        return (xf - jnp.flip(xf, axis=plan.axes)) / 2
    c = xf - _row_mean(xf, plan, n)
    return c - _row_mean(c, plan, n)


def _statistic(c: jax.Array, plan: _Plan, n: int) -> jax.Array:
    """s per row (keepdims): the mean of c**2 over the row, or over its first k elements."""
    if plan.spec.kind != "partial_rms":
        return _row_mean(c * c, plan, n)
    mask, k = _partial_mask(c, plan, n)
    return _row_mean(jnp.where(mask, c * c, 0), plan, k)


def _r(s: jax.Array, eps: float | jax.Array, spec: NormSpec) -> jax.Array:
    if spec.eps_placement == "inside":
        return lax.rsqrt(s + eps)
    return 1 / (jnp.sqrt(s) + eps)


# Rows whose r(s) falls outside [2**-e, 2**e] (or is NaN on a finite row) are recomputed in
# scaled units: there s, or the sums behind it, may have overflowed or underflowed.
_SAFE_EXPONENT = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.float64): 256}


def _out_of_range(r: jax.Array) -> jax.Array:
    bound = 2.0 ** _SAFE_EXPONENT[jnp.dtype(r.dtype)]
    return ~((r >= 1 / bound) & (r <= bound))


def _row_max(value: jax.Array, plan: _Plan) -> jax.Array:
    m = jnp.max(value, axis=plan.axes, keepdims=True)
    return m if plan.axis_name is None else lax.pmax(m, plan.axis_name)


class _Scaled(NamedTuple):
    """Rows in scaled units: ``c = pre * sigma * centered``, ``s`` its statistic and ``eps`` the
    eps giving the same ``y_hat = c r(s)``; the true ``r`` is ``pre * sigma * r(s)``. ``pre`` is
    1 or a power of two that keeps ``sigma`` a normal number (XLA flushes subnormals to zero)."""

    c: jax.Array
    s: jax.Array
    eps: jax.Array
    sigma: jax.Array
    pre: jax.Array


def _rescaled(xf: jax.Array, plan: _Plan, n: int) -> _Scaled:
    """Every row divided by its largest magnitude (at least eps's), so that s lies in [1/k, 1].

    ``sigma = 1 / max(max|x|, floor)``, ``floor = sqrt(eps)`` (inside) or ``eps`` (outside), over
    the elements the statistic reads; LayerNorm rows are scaled, centered, then scaled again by
    their largest centered value. The scaling is a constant to autodiff: ``y_hat`` does not
    depend on it.
    """
    spec = plan.spec
    assert spec.eps is not None  # a normalization kind
    outside = spec.eps_placement == "outside"
    floor = spec.eps if outside else float(np.sqrt(spec.eps))
    tiny = float(jnp.finfo(xf.dtype).tiny)
    big = 2.0 ** (2 * _SAFE_EXPONENT[jnp.dtype(xf.dtype)])
    magnitude = jnp.abs(xf)
    if spec.kind == "partial_rms":
        magnitude = jnp.where(_partial_mask(xf, plan, n)[0], magnitude, 0)
    largest = lax.stop_gradient(_row_max(magnitude, plan))
    pre = jnp.where(largest > big, 1 / big, 1.0).astype(xf.dtype)
    sigma = 1 / jnp.maximum(largest * pre, jnp.maximum(floor * pre, tiny))
    c = xf * pre * sigma
    scaled_floor = floor * pre * sigma
    if spec.kind == "layer":
        c = _centered(c, plan, n)
        widest = lax.stop_gradient(_row_max(jnp.abs(c), plan))
        second = 1 / jnp.maximum(widest, jnp.maximum(scaled_floor, tiny))
        c, sigma, scaled_floor = c * second, sigma * second, scaled_floor * second
    s = _statistic(c, plan, n)
    eps = jnp.maximum(scaled_floor if outside else scaled_floor * scaled_floor, tiny)
    return _Scaled(c, s, eps, sigma, pre)


def _rows(xf: jax.Array, plan: _Plan, n: int, r: jax.Array | None = None) -> _Scaled:
    """The rows in scaled units: as they are, except those whose ``r`` (the saved true ``r``,
    or else computed here) is out of range, which `_rescaled` recomputes. The rescaling runs
    only when some row needs it."""
    assert plan.spec.eps is not None  # a normalization kind
    c = _centered(xf, plan, n)
    s = _statistic(c, plan, n) if r is None else jnp.zeros_like(r)
    bad = _out_of_range(_r(s, plan.spec.eps, plan.spec) if r is None else r)
    eps = jnp.full_like(s, plan.spec.eps)
    one = jnp.ones_like(s)

    def rescale() -> _Scaled:
        scaled = _rescaled(xf, plan, n)
        # Rows holding an inf or a NaN get sigma = 0 or NaN and keep their plain values.
        use = bad & (scaled.sigma > 0)
        return _Scaled(
            jnp.where(use, scaled.c, c),
            jnp.where(use, scaled.s, s),
            jnp.where(use, scaled.eps, eps),
            jnp.where(use, scaled.sigma, 1),
            jnp.where(use, scaled.pre, 1),
        )

    def plain() -> _Scaled:
        return _Scaled(c, s, eps, one, one)

    any_bad = jnp.any(bad)
    if isinstance(any_bad, jax.core.Tracer):  # traced (jit, grad, vmap): both branches staged
        return lax.cond(any_bad, rescale, plain)
    # Eager: decide in Python, so the common case runs no cond (whose branches, fresh closures
    # here, eager JAX would compile on every call).
    return rescale() if bool(any_bad) else plain()


def _broadcast_param(value: jax.Array, x: jax.Array, plan: _Plan, dtype: jnp.dtype) -> jax.Array:
    shape = [x.shape[a] if a in plan.axes else 1 for a in range(x.ndim)]
    return jnp.reshape(value, shape).astype(dtype)


def _gain(x: jax.Array, scale: jax.Array | None, plan: _Plan, dtype: jnp.dtype) -> jax.Array | None:
    """``scale_offset + w`` broadcastable to x, or None for an effective scale of 1."""
    if scale is None:
        return None
    g = _broadcast_param(scale, x, plan, dtype)
    return g + plan.spec.scale_offset if plan.spec.scale_offset else g


def _forward(
    plan: _Plan, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``(y, r)``: the output and the true ``r(s)`` per row."""
    compute = _stat_dtype(x.dtype)
    n = _row_size(x, plan)
    rows = _rows(x.astype(compute), plan, n)
    r = _r(rows.s, rows.eps, plan.spec)
    y = rows.c * r
    if x.dtype in _HALF and plan.spec.cast == "before_scale":
        y = y.astype(x.dtype).astype(compute)
    g = _gain(x, scale, plan, compute)
    if g is not None:
        y = y * g
    if bias is not None:
        y = y + _broadcast_param(bias, x, plan, compute)
    return y.astype(x.dtype), r * rows.sigma * rows.pre


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(plan: _Plan, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
    return _forward(plan, x, scale, bias)[0]


def _norm_fwd(
    plan: _Plan, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]]:
    y, r = _forward(plan, x, scale, bias)
    return y, (x, r, scale, bias)


def _norm_bwd(
    plan: _Plan,
    residuals: tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None],
    dy: jax.Array,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The gradients of `normkit.reference.normalize_vjp`, in terms of ``y_hat = c r``.

    With ``t = sqrt(s) r = 1 - eps r`` and ``u = y_hat`` (inside) or ``y_hat / sqrt(t)``
    (outside, 0 where s = 0)::

        rms, partial_rms:  dx_i = r (d_i - [i < k] (1/k) u_i sum_j d_j u_j)
        layer:             dx_i = r (d_i - mean(d) - (1/n) u_i sum_j d_j u_j)

    No intermediate leaves the dtype's range (``r**3`` would). Where the statistic reads one
    element (k = 1) or LayerNorm has two, ``1 - u_0**2`` cancels; it is taken in the closed form
    ``eps r**2`` (inside) or ``eps r`` (outside).
    """
    x, r_saved, scale, bias = residuals
    spec = plan.spec
    compute = r_saved.dtype
    n = _row_size(x, plan)
    rows = _rows(x.astype(compute), plan, n, r_saved)
    # Plain rows keep the saved r; rescaled rows (s recomputed, non-zero) take r in scaled units.
    r = jnp.where((rows.sigma == 1) & (rows.pre == 1), r_saved, _r(rows.s, rows.eps, spec))
    dyf = dy.astype(compute)
    g = _gain(x, scale, plan, compute)
    d = dyf if g is None else dyf * g
    y_hat = rows.c * r
    if spec.eps_placement == "outside":
        t = 1 - rows.eps * r
        u = jnp.where(t > 0, y_hat * lax.rsqrt(jnp.where(t > 0, t, 1)), 0)
        rest = rows.eps * r
    else:
        u = y_hat
        rest = rows.eps * r * r
    if spec.kind == "layer":
        centered_d = d - _row_mean(d, plan, n)
        if n <= 2:
            inner = rest * centered_d
        else:
            inner = centered_d - u * _row_mean(d * u, plan, n)
    elif spec.kind == "rms" and n > 1:
        inner = d - u * _row_mean(d * u, plan, n)
    else:
        mask, k = _partial_mask(x, plan, n)
        du = d * u
        if k == 1:
            others = _psum(jnp.sum(jnp.where(mask, 0, du), axis=plan.axes, keepdims=True), plan)
            inner = jnp.where(mask, d * rest - u * others, d)
        else:
            inner = jnp.where(mask, d - u * _row_mean(du, plan, k), d)
    dx = r * inner * rows.sigma * rows.pre
    batch = tuple(a for a in range(x.ndim) if a not in plan.axes)
    dscale = None if scale is None else jnp.sum(dyf * y_hat, axis=batch).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(dyf, axis=batch).astype(bias.dtype)
    return dx.astype(x.dtype), dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)
