"""The guarded program: ``y_hat`` with every guard, for inputs where a row's own ``s`` or ``r``
shows the plain program (`normkit.tf._plain`) inaccurate, and for rows whose statistic reads one
element (LayerNorm: two).

LayerNorm's correction pass, the clip of values whose squares overflow, rows far from unit
scale rescaled by a power of two (`rescaled`), the backward in the reference's closed form in
scaled units (`normalized`), and the exact first and second derivatives of one-element rows
(`degenerate`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops

from normkit.tf import _ops
from normkit.tf._host import known, recording
from normkit.tf._rows import Rows, r_of

__all__ = ["guarded", "one_element"]


def one_element(rows: Rows) -> bool:
    """Whether the statistic reads one element of each row (LayerNorm: two), which always
    takes `guarded` (`degenerate`)."""
    return rows.k == 1 or (rows.spec.kind == "layer" and rows.n == 2)


def guarded(rows: Rows, x: Any) -> Any:
    """``y_hat`` with every guard: LayerNorm's correction pass, the clip of values whose
    squares overflow, rows far from unit scale rescaled, the closed-form gradients of rows
    whose statistic reads one element (LayerNorm: two)."""
    spec = rows.spec
    assert spec.eps is not None
    c = center(rows, x)
    s = statistic(rows, c)
    r, w = careful_r(rows, s, spec.eps)
    bad = rows.needs_rescaling(s, r)
    any_bad = ops.any(bad)
    now = known(any_bad)
    eps: Any = spec.eps
    if now is None:
        c, r, eps, w = ops.cond(
            any_bad,
            lambda: rescaled(rows, x, c, r, w, bad),
            lambda: (c, r, ops.full_like(r, spec.eps), w),
        )
    elif now:
        c, r, eps, w = rescaled(rows, x, c, r, w, bad)
    y = normalized(rows, c, r, w)
    if one_element(rows):
        exact = degenerate(rows, c, r, eps, y)
        y = exact if rows.head is None else ops.where(rows.head, exact, y)
    return y


def center(rows: Rows, x: Any) -> Any:
    """``x`` (RMS kinds) or ``x - mean(x)`` with one correction pass (LayerNorm)."""
    if rows.spec.kind != "layer":
        return x
    if rows.n == 2:
        # c = +-(x0 - x1) / 2 from one subtraction, exact when x0 and x1 are close
        # (Sterbenz); x - mean(x) would carry the rounding of x0 + x1. Linear in x with the
        # Jacobian of x - mean(x), [[1, -1], [-1, 1]] / 2, since the sign pattern is (1, -1).
        sign = ops.cast(np.array([1.0, -1.0]).reshape(rows.target), rows.work)
        c = sign * (ops.sum(x * sign, axis=rows.axes, keepdims=True) * 0.5)
        return bounded(rows, c, x)
    # sum(x / n) cannot overflow where sum(x) / n can; the mean of the centered values,
    # subtracted again, recovers what the rounding of a large mean lost.
    c = bounded(rows, x - ops.sum(x * (1 / rows.n), axis=rows.axes, keepdims=True), x)
    return c - ops.sum(c * (1 / rows.n), axis=rows.axes, keepdims=True)


def bounded(rows: Rows, c: Any, x: Any) -> Any:
    """``c`` with the values of magnitude above `Rows.big` that come from finite ``x`` clipped
    to +-big. Their squares overflow either way, and the rows whose statistic reads them are
    rescaled; the clip keeps the gradient of the unused plain values finite (a branch not
    taken still receives a zero cotangent, and 0 * inf would be NaN)."""
    beyond = ops.logical_and(ops.abs(c) > rows.big, ops.isfinite(x))
    return ops.where(beyond, ops.sign(c) * rows.big, c)


def statistic(rows: Rows, c: Any) -> Any:
    """``s``: the mean of ``c**2`` over the row, or over its first k elements only
    (`Rows.mean_square`), of ``c`` `bounded`."""
    return rows.mean_square(bounded(rows, c, c))


def careful_r(rows: Rows, s: Any, eps: Any, unit: Any = 1.0) -> tuple[Any, Any]:
    """``(r, w)`` of the statistic ``unit**2 s`` (``s`` given in units of ``unit**2``:
    eps outside only; ``unit`` a constant), ``w`` for `normalized`: ``r`` inside, ``unit
    sqrt(s)`` outside (sqrt's infinite derivative at s = 0 taken as 0, as in the
    reference). A NaN statistic stays NaN. Both are differentiable (second derivatives
    through `normalized`'s gradient) with finite derivatives: where a traced ``cond``
    passes them a zero cotangent, ``1 / sqrt(s)``'s would be 0 * inf on tiny rows."""
    if not rows.outside:
        least = 1 / rows.clip_r**2
        r = r_of(s, eps, False, floor=lambda total: _ops.maximum(total, least))
        return r, r
    positive = s > 0
    root = ops.where(
        positive, ops.sqrt(ops.where(positive, s, ops.ones_like(s))), ops.stop_gradient(s)
    )
    least = 1 / rows.clip_r
    r = r_of(s, eps, True, root=unit * root, floor=lambda total: _ops.maximum(total, least))
    return r, unit * root


def normalized(rows: Rows, c: Any, r: Any, w: Any) -> Any:
    """`guarded`'s ``y_hat = c r``, whose gradient reaches ``c`` in the reference's closed
    form (`Rows.input_grad`), in ``c``'s units: ``dc = r (d - [i < k] y_hat sum(d c rho) / k)``
    with ``rho = -2 r'(s) / r**2``, ``r`` inside, ``1 / sqrt(s)`` outside; ``c rho`` is formed
    from `careful_r`'s ``w`` as ``c w`` (inside) or ``c / w`` (outside, 0 where ``w = sqrt(s)``
    is). ``r`` and ``w`` get no gradient of their own (the closed form holds the statistic's);
    a second derivative reaches them through ``dc``.

    Autodiff through ``r(s)`` would form ``sum(d c)`` and ``r'(s)`` apart: on an ordinary
    row beside one that sends the batch here, |x| 1e9 with a cotangent of 1e29, that sum
    overflows float32 where dx is about 1e20, and the row's gradient was NaN. Here the sum
    reads ``c rho``, of the size of ``y_hat``. LayerNorm's centering before is
    differentiated by autodiff (``dx = dc - mean(dc)``, ``c`` having mean 0)."""
    if not recording(c):
        return c * r

    @ops.custom_gradient
    def output(c: Any, r: Any, w: Any) -> Any:
        y_hat = c * r

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, Any, Any]:
            d = args[0] if upstream is None else upstream
            if rows.outside:
                positive = w > 0
                c_rho = c / ops.where(positive, w, ops.ones_like(w))
                c_rho = ops.where(positive, c_rho, ops.zeros_like(c_rho))
            else:
                c_rho = c * w
            return rows.input_grad(d, y_hat, r, rows.statistic_share(d, c_rho)), None, None

        return y_hat, grad

    return output(c, r, w)


def rescaled(rows: Rows, x: Any, c: Any, r: Any, w: Any, bad: Any) -> tuple[Any, Any, Any, Any]:
    """``(c, r, eps, w)`` with the ``bad`` rows divided by their largest magnitude (at
    least eps's: ``sqrt(eps)`` inside, ``eps`` outside) rounded to a power of two
    (`_ops.reciprocal_power_of_two`: exactly), so that their s lies in [1/(4k), 1].

    LayerNorm rows are scaled, centered, then scaled again by their largest centered value.
    The factors are constants to autodiff (``y_hat`` does not depend on them); ``pre``, 1
    or a power of two, keeps them normal numbers (subnormals may be flushed to zero). With
    eps outside, a row smaller than eps has its statistic taken once more in units of its
    largest magnitude ``m``, ``sqrt(s) = m sqrt(mean((c/m)**2))``, so that no square
    underflows (`careful_r`'s ``unit``).
    """
    eps = rows.spec.eps
    assert eps is not None
    floor = eps if rows.outside else float(np.sqrt(eps))
    largest = ops.stop_gradient(ops.max(rows.in_head(ops.abs(x)), axis=rows.axes, keepdims=True))
    pre = ops.cast(ops.where(largest > rows.big, 1 / rows.big, 1.0), largest.dtype)
    extent = rows.maximum(largest * pre, rows.maximum(floor * pre, rows.tiny))
    # Rows holding an inf or a NaN keep their plain values; they are scaled as zeros so
    # that no NaN reaches the gradient through the unused branch.
    use = ops.logical_and(bad, ops.isfinite(extent))
    sigma = _ops.reciprocal_power_of_two(ops.where(use, extent, ops.ones_like(extent)))
    scaled = ops.where(use, x, ops.zeros_like(x)) * ops.where(use, pre, 1.0) * sigma
    scaled_floor = floor * pre * sigma
    if rows.spec.kind == "layer":
        scaled, scaled_floor = _recentered(rows, scaled, scaled_floor)
    scaled_eps = scaled_floor if rows.outside else scaled_floor * scaled_floor
    scaled_eps = rows.maximum(scaled_eps, rows.tiny)
    if rows.outside:
        unit = ops.stop_gradient(
            rows.maximum(
                ops.max(ops.abs(rows.in_head(scaled)), axis=rows.axes, keepdims=True), rows.tiny
            )
        )
        scaled_r, scaled_w = careful_r(rows, statistic(rows, scaled / unit), scaled_eps, unit)
    else:
        scaled_r, scaled_w = careful_r(rows, statistic(rows, scaled), scaled_eps)
    return (
        ops.where(use, scaled, c),
        ops.where(use, scaled_r, r),
        ops.where(use, scaled_eps, ops.full_like(r, eps)),
        ops.where(use, scaled_w, w),
    )


def _recentered(rows: Rows, scaled: Any, scaled_floor: Any) -> tuple[Any, Any]:
    """LayerNorm's scaled rows centered (`center`), then scaled again by their largest centered
    value (at least ``scaled_floor``) rounded to a power of two; ``scaled_floor`` in the same
    units."""
    scaled = center(rows, scaled)
    widest = ops.max(ops.abs(scaled), axis=rows.axes, keepdims=True)
    second = rows.maximum(widest, rows.maximum(scaled_floor, rows.tiny))
    second = ops.stop_gradient(_ops.reciprocal_power_of_two(second))
    return scaled * second, scaled_floor * second


def degenerate(rows: Rows, c: Any, r: Any, eps: Any, y: Any) -> Any:
    """``y = c r`` where the statistic reads one element per row (``f(c) = c r(c**2)``)
    or LayerNorm has two (``c = +-(x0 - x1)/2``), with exact first and second derivatives.

    Autodiff would form ``f'`` as the difference of two nearly equal terms. The closed forms
    (``r = 1/sqrt(c**2 + eps)`` inside, ``1/(|c| + eps)`` outside) are
    ``f' = eps r**3, f'' = -3 eps c r**5`` (inside) and ``f' = eps r**2,
    f'' = -2 eps sign(c) r**3`` (outside); ``y = stop(f) + dc f' + dc**2 f''/2`` with
    ``dc = c - stop(c)`` (zero) has ``f``'s value and its first two derivatives.
    """
    c = rows.in_head(c)
    eps_r = eps * r
    if rows.outside:
        slope = eps_r * r
        curvature = -2.0 * eps_r * ops.sign(c) * r * r
    else:
        slope = eps_r * r * r
        curvature = -3.0 * (eps_r * r) * (c * r) * (r * r)
    dc = c - ops.stop_gradient(c)
    return (
        ops.stop_gradient(y)
        + dc * ops.stop_gradient(slope)
        + 0.5 * dc * dc * ops.stop_gradient(curvature)
    )
