"""The plain program: one pass over the rows for the statistic, one for ``y``, the backward in
the closed form of `normkit.reference.normalize_vjp` (`Rows.input_grad`), and no guard op.

It stands where no row's own ``s`` or ``r`` shows it inaccurate (`statistics` judges them);
otherwise the guarded program (`normkit.tf._careful`) recomputes the input. RMSNorm with eps
inside is differentiated as ``keras.layers.RMSNormalization`` is (`keras_output`), so that
training matches Keras' layer to the bit.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
from keras import ops

from normkit.tf import _ops
from normkit.tf._host import known, on_host, recording
from normkit.tf._programs import cond, separately, separating
from normkit.tf._rows import Rows, affine_step, r_of

__all__ = ["any_bad_now", "keras_output", "plain_output", "statistics"]

Stats = tuple[Any, ...]
"""`statistics`' ``(mean, s, r, ratio, bad)`` per row, each None where absent."""


def statistics(rows: Rows, x: Any, eager: bool, source: Any = None) -> tuple[Stats, bool | None]:
    """``((mean, s, r, ratio, bad), any_bad)`` per row for ``y_hat = c r(s)``, ``c = x`` or
    ``x - mean`` (``mean`` None for the RMS kinds), with no guard op: ``ratio = r'(s) /
    (-r**3 / 2)`` (1 inside, ``1 + eps / sqrt(s)`` outside) for `plain_output`'s backward,
    and whether the row must be recomputed by the guarded program (`Rows.needs_rescaling`, or a
    LayerNorm mean above ``sqrt(s)``, whose rounding the correction pass in `_careful.center`
    recovers: it moves ``y_hat`` by ``|mean| r`` ulps of 1, but relative to the row's own
    ``max|y_hat|``, about ``sqrt(s) r``, by ``|mean| / sqrt(s)`` ulps; a mean above ``1/r``
    missed the rows far below ``sqrt(eps)``, where ``r`` is ``1/sqrt(eps)``: rows of
    1e-20 (10 + N(0, 1)) were 1.2e-6 of their max|y| off).

    Traced, ``bad`` marks those rows, which have ``r = 1`` (their values are replaced), and
    ``any_bad`` is None. ``eager``: the rows are judged on the host from their row-sized
    statistics (`any_bad_now`), ``any_bad`` is whether one is bad (the guarded program
    then recomputes the input) and ``bad`` None: a guard op costs as much as the whole pass
    on one token's row. `plain_output` differentiates through the statistics analytically,
    so they are constants to autodiff (a custom gradient may not close over differentiated
    values on JAX), except with `Rows.keras_order`, differentiated as Keras' layer is; ``s`` is
    given there only (None otherwise), for `keras_output`'s rows whose ``dr`` overflows.
    ``x`` is ``source`` cast to the work dtype (``source`` None: ``x`` itself); LayerNorm's
    two reductions each cast a copy of their own where `separating`."""
    spec = rows.spec
    assert spec.eps is not None
    if not rows.keras_order:
        x = ops.stop_gradient(x)
    mean, s = _moments(rows, x, eager, source)
    kept = s if rows.keras_order else None
    # Traced, per-row clamps that change only rows marked bad, so that their values stay
    # finite; eagerly a bad row sends the whole input to the guarded program instead.
    if rows.outside:
        root = ops.sqrt(s if eager else rows.maximum(s, rows.small))
        r = r_of(s, spec.eps, True, root=root)
        ratio = 1.0 + spec.eps / root
    else:
        floor = None if eager else (lambda total: rows.maximum(total, 1 / rows.clip_r**2))
        r = r_of(s, spec.eps, False, floor=floor)
        ratio = None
    if eager:
        return (mean, kept, r, ratio, None), any_bad_now(rows, s, r, mean)
    bad = rows.needs_rescaling(s, r)
    if mean is not None:
        bad = ops.logical_or(bad, ops.logical_not(ops.abs(mean) <= ops.sqrt(s)))
    return (mean, kept, ops.where(bad, 1.0, r), ratio, bad), None


def _moments(rows: Rows, x: Any, eager: bool, source: Any) -> tuple[Any, Any]:
    """``(mean, s)``: LayerNorm's mean and ``s = mean((x - mean)**2)``, or for the RMS kinds
    None and ``s = mean(x**2)`` (over the first k elements)."""
    if rows.spec.kind != "layer":
        return None, rows.mean_square(x, sliced=True)
    if source is not None and separating(not eager):
        first, second = separately(
            lambda v: ops.cast(ops.stop_gradient(v), rows.work), (source,), 2, traced=True
        )
        mean = _ops.mean(first, rows.axes)
        return mean, _ops.mean(ops.square(second - mean), rows.axes)
    # mean((x - mean)**2) as Keras' LayerNormalization forms it: one op on TensorFlow (a
    # squared difference), where x - mean and its square would be two passes.
    return ops.moments(x, axes=list(rows.axes), keepdims=True)


def any_bad_now(rows: Rows, s: Any, r: Any, mean: Any) -> bool:
    """`statistics`' judgement of the rows on the host, from the row-sized ``s``, ``r`` and
    ``mean`` (None for the RMS kinds): whether a row needs rescaling (`Rows.needs_rescaling`)
    or has a LayerNorm mean above ``sqrt(s)``. A numpy copy of those guards, earned by speed:
    an eager guard op costs as much as the whole pass on one token's row."""
    r_now = on_host(r)
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~((r_now >= 1 / rows.bound_value) & (r_now <= rows.bound_value))
        if rows.outside:
            bad |= on_host(s) < rows.small_value
        if mean is not None:
            bad |= ~(np.abs(on_host(mean)) <= np.sqrt(on_host(s)))
    return bool(bad.any())


def _y_hat_of(x: Any, mean: Any, r: Any) -> Any:
    """``y_hat = c r`` for ``c = x`` (``mean`` None) or ``x - mean``."""
    return (x if mean is None else x - mean) * r


def plain_output(
    rows: Rows,
    source: Any,
    stats: Stats,
    traced: bool,
    scale: Any = None,
    bias: Any = None,
    output_dtype: str | None = None,
) -> Any:
    """``y = c r (* scale) (+ bias)`` from `statistics`' ``stats``, for ``x = source`` cast to
    the work dtype, in ``output_dtype`` (the work dtype for None), with the backward of
    `_backward`. Both casts are inside, so that the backward pass reads ``source`` and ``dy``
    as they are (`separately`).

    With `Rows.keras_order` it is `keras_output`, whose gradient is autodiff's through Keras'
    operations (the same formula, rounded as Keras rounds it), so that training matches
    ``keras.layers.RMSNormalization``'s to the bit.
    """
    mean, s, r, ratio, bad = stats
    work = rows.work
    out = work if output_dtype is None else output_dtype
    if rows.keras_order:
        return ops.cast(keras_output(rows, ops.cast(source, work), s, r, scale, bias), out)

    # The statistics are arguments, not closed over: JAX's custom gradient may not close
    # over values of an enclosing trace. Their own gradients are None (dx holds them).
    own = (mean, r, ratio, bad)
    row_stats = [u for u in own if u is not None]
    present = tuple(p for p in (scale, bias) if p is not None)
    if not recording(source, *present):
        y_hat = _y_hat_of(ops.cast(source, work), mean, r)
        return ops.cast(affine_step(y_hat, (scale, bias), present), out)

    @ops.custom_gradient
    def output(source: Any, *args: Any) -> Any:
        given = iter(args)
        stats = tuple(None if u is None else next(given) for u in own)
        params = tuple(given)
        y_hat = _y_hat_of(ops.cast(source, work), stats[0], stats[1])
        y = ops.cast(affine_step(y_hat, (scale, bias), params), out)

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            dy = args[0] if upstream is None else upstream
            dx, *grads = _backward(rows, source, dy, stats, params, (scale, bias), traced)
            return (dx, *[None] * len(row_stats), *grads)

        return y, grad

    return output(source, *row_stats, *present)


def _backward(
    rows: Rows,
    source: Any,
    dy: Any,
    stats: tuple[Any, ...],
    params: tuple[Any, ...],
    affine: tuple[Any, Any],
    traced: bool,
) -> list[Any]:
    """``[dx, dscale, dbias]`` (the parameters present) of `plain_output`: `Rows.input_grad`
    with ``d = dy * scale`` and ``A = ratio sum(d y_hat)``; ``dscale = sum(dy y_hat)``,
    ``dbias = sum(dy)`` over the other axes (`Rows.param_grads`). Each sum, and dx, reads
    copies of its own (`separately`).

    When ``traced``, the branch may run beside the guarded one (a ``cond`` turned into a
    select), so the rows marked ``bad`` get a zero gradient (``y_hat`` zeroed per row: finite
    wherever ``x`` is)."""
    scale, bias = affine

    def terms(
        source: Any, dy: Any, stats: tuple[Any, ...], params: tuple[Any, ...]
    ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
        """``(dy, d, y_hat, stats)`` in the work dtype, from these or copies."""
        mean, r, _, bad = stats
        if traced:
            # Zero per row, not per element (XLA's CPU reductions fuse no select):
            # y_hat = x 0 on the rows marked bad, 0 for every finite x.
            r = ops.where(bad, ops.zeros_like(r), r)
            mean = None if mean is None else ops.where(bad, ops.zeros_like(mean), mean)
        y_hat = _y_hat_of(ops.cast(source, rows.work), mean, r)
        dy = ops.cast(dy, rows.work)
        return dy, (dy if scale is None else dy * params[0]), y_hat, stats

    projected, averaged, scaled, biased, applied = separately(
        terms, (source, dy, stats, params), 5, traced
    )
    _, d, y_hat, (_, _, ratio, _) = projected
    share = rows.statistic_share(d, y_hat, ratio)
    _, d, y_hat, (mean, r, _, _) = applied
    d_mean = None if mean is None else _ops.mean(averaged[1], rows.axes)
    dx = rows.input_grad(d, y_hat, r, share, d_mean)
    dx = ops.cast(dx, keras.backend.standardize_dtype(source.dtype))
    dy_scaled, _, y_hat_scaled, _ = scaled
    grads = rows.param_grads(dy_scaled, y_hat_scaled, scale, bias, params, biased[0])
    return [dx, *grads]


def keras_output(rows: Rows, x: Any, s: Any, r: Any, scale: Any = None, bias: Any = None) -> Any:
    """``y = x r (* scale) (+ bias)`` in ``keras.layers.RMSNormalization``'s operations,
    with the gradient autodiff forms through them: ``d = dy scale``, ``dx = d r``,
    ``dr = sum(d x)`` over the row (autodiff takes it on through ``r(s)`` to ``x``),
    ``dscale = sum(dy x r)``, ``dbias = sum(dy)`` over the other axes.

    That holds on every row whose statistic's backward stays finite, judged by one scalar
    per row, ``dr r**3`` (autodiff multiplies it by ``-1/2``, then by ``2 x / n``: factors
    that keep it finite). A row where it overflows (``d x`` summed over the row: |x| 1e9
    with |dy| 1e29) gets a zero ``dr`` and the statistic's share as the cotangent of ``s``
    (`_patched_rows`), in a branch the common case skips; the branch outputs row-sized
    tensors only, so every other row's gradient is Keras' own, untouched.
    """
    present = tuple(p for p in (scale, bias) if p is not None)
    if not recording(x, *present):
        return affine_step(x * r, (scale, bias), present)

    @ops.custom_gradient
    def output(x: Any, s: Any, r: Any, *params: Any) -> Any:
        product = x * r
        y = affine_step(product, (scale, bias), params)

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            dy = args[0] if upstream is None else upstream

            d = dy if scale is None else dy * params[0]
            dr = ops.sum(d * x, axis=rows.axes, keepdims=True)
            finite = ops.isfinite(dr * (r * r * r))
            every_row = ops.all(finite)
            now = known(every_row)
            ds = None
            if now is None:
                # The branch forms d again from dy: under XLA, d as its input would be
                # written out, where the common case fuses it into its readers.
                kept, patched = _dr_branches(rows.axes, rows.n)
                gain = params[:1] if scale is not None else ()
                ds, dr = cond(every_row, kept, patched, x, r, dy, dr, finite, *gain)
            elif not now:
                ds, dr = _patched_rows(rows.axes, rows.n, x, r, d, dr, finite)
            return (d * r, ds, dr, *rows.param_grads(dy, product, scale, bias, params))

        return y, grad

    return output(x, s, r, *present)


def _patched_rows(
    axes: tuple[int, ...], n: int, x: Any, r: Any, d: Any, dr: Any, finite: Any
) -> tuple[Any, Any]:
    """``(ds, dr)`` of `keras_output`: on each row not ``finite``, ``dr = 0`` and
    ``ds = r'(s) sum(d x) = -(n/2) r**2 mean(d y_hat)``, ``y_hat = x r``, whose mean (of
    ``d (y_hat / n)``, summed) stays below ``max |d|`` (``y_hat`` has mean square at most 1);
    autodiff then takes ``ds`` to ``x`` through ``s = mean(x**2)``, so that
    ``dx = d r + (2 x / n) ds``, `normkit.reference.normalize_vjp`'s. A row whose ``ds`` is
    not finite either (a NaN or inf cotangent) keeps autodiff's ``dr``; elsewhere ``ds`` is
    0."""
    y_hat = x * r
    mean_d_y_hat = ops.sum(d * (y_hat * (1 / n)), axis=axes, keepdims=True)
    ds = mean_d_y_hat * (r * r) * (-0.5 * n)
    patch = ops.logical_and(ops.logical_not(finite), ops.isfinite(ds))
    return ops.where(patch, ds, ops.zeros_like(ds)), ops.where(patch, ops.zeros_like(dr), dr)


@functools.lru_cache(maxsize=128)
def _dr_branches(axes: tuple[int, ...], n: int) -> tuple[Any, Any]:
    """The branches of `keras_output`'s gradient for rows of ``n`` elements along ``axes``,
    ``(x, r, dy, dr, finite[, scale]) -> (ds, dr)``: every row's ``dr`` kept, or the rows
    whose ``dr`` overflowed patched (`_patched_rows`). One pair per layout, so that `cond`
    traces the same functions each call."""

    def kept(x: Any, r: Any, dy: Any, dr: Any, finite: Any, *scale: Any) -> tuple[Any, Any]:
        return ops.zeros_like(dr), dr

    def patched(x: Any, r: Any, dy: Any, dr: Any, finite: Any, *scale: Any) -> tuple[Any, Any]:
        d = dy * scale[0] if scale else dy
        return _patched_rows(axes, n, x, r, d, dr, finite)

    return kept, patched
