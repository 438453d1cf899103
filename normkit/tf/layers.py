"""Keras 3 layers that compute a `NormSpec`, written with ``keras.ops`` for every Keras backend."""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

from normkit import _dyt as _dyt_math
from normkit import _float_pairs, _gating, dtypes, reference
from normkit.spec import (
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    Backward,
    Cast,
    EpsPlacement,
    Gate,
    GateActivation,
    NormSpec,
    OffsetDtype,
    OutputDtype,
    Residual,
    Variance,
)
from normkit.tf import _gated
from normkit.tf._rounding import rounded

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec"]

_HALF = ("float16", "bfloat16")

# The defaults of the Keras layers these replace.
LAYER_NORM_EPSILON = 1e-3  # keras.layers.LayerNormalization
RMS_NORM_EPSILON = 1e-6  # keras.layers.RMSNormalization
WEIGHT_ATTRIBUTES = {"scale": "gamma", "bias": "beta", "alpha": "alpha"}
"""Every layer's attribute for each of its weights, by the name the weight is saved under (and
normkit's files and conformance call it); the attribute is None where the spec has no such
weight."""


def _eagerly(value: Any) -> bool:
    """Whether ``value``, a tensor of this call, is known now (eager execution), not traced.

    On JAX, ``jax.grad`` or ``jax.vjp`` without ``jit`` wraps concrete arrays in tracers: their
    values are known (`_on_host` reads them), and a ``cond`` there would be compiled anew on
    every call."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.executing_eagerly())
    if backend == "jax":
        import jax

        return not isinstance(_without_tangent(value), jax.core.Tracer)
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return True


def _without_tangent(value: Any) -> Any:
    """On JAX, the array under autodiff's tracer of ``value`` (concrete outside ``jit``);
    ``value`` itself elsewhere, or where it is no tracer."""
    if keras.backend.backend() != "jax":
        return value
    import jax

    return jax.lax.stop_gradient(value) if isinstance(value, jax.core.Tracer) else value


def _on_host(value: Any) -> np.ndarray:
    """``value``, known now (`_eagerly`), as a numpy array."""
    return np.asarray(ops.convert_to_numpy(_without_tangent(value)))


def _known(flag: Any) -> bool | None:
    """The value of a boolean scalar tensor when it is known now (eager), None while tracing:
    eager calls branch in Python, which spares JAX compiling both branches of a `cond`."""
    return bool(_on_host(flag)) if _eagerly(flag) else None


def _recording(*inputs: Any) -> bool:
    """Whether a gradient may be taken through this call's ops on ``inputs`` (the input and the
    weights): always while tracing and on the torch backend; eagerly on TensorFlow, whether a
    GradientTape records; on JAX, whether one of them is a tracer (of autodiff, or of a ``jit``
    a gradient may be taken through). Without one the custom gradients are left out (their
    wrapper costs as much as the whole forward on one token's row)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return any(isinstance(v, jax.core.Tracer) for v in inputs)
    if backend != "tensorflow":
        return True
    import tensorflow as tf
    from tensorflow.python.eager import record

    return not tf.executing_eagerly() or bool(record.could_possibly_record())


def _traced_for_xla(x: Any) -> bool:
    """Whether the call on ``x`` is traced for XLA, where the output's bits are XLA's fusions'
    anyway: by TensorFlow (``tf.function(jit_compile=True)``, or Keras' ``jit_compile`` on a
    GPU), or by JAX (``jax.jit``: ``x`` is traced beyond autodiff, `_eagerly`)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return not _eagerly(x)
    if backend != "tensorflow":
        return False
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


class _Rows:
    """The spec's arithmetic on the rows of one input, in the ``work`` dtype.

    Rows whose ``r(s)`` falls outside ``[1/bound, bound]`` (or is NaN on a finite row), and
    with eps outside rows whose ``s`` lies below `small`, are recomputed in scaled units
    (`rescaled`), where neither ``s`` nor the derivatives autodiff forms (``r**3``, and
    ``x_i / sqrt(s)`` outside) leave the dtype's range; ordinary rows skip that branch.
    """

    def __init__(
        self,
        spec: NormSpec,
        axes: tuple[int, ...],
        target: list[int],
        n: int,
        k: int,
        head: np.ndarray | None,
        work: str,
        keras_order: bool = True,
    ) -> None:
        self.spec, self.axes, self.target = spec, axes, target
        self.n, self.k, self.head = n, k, head
        self.work = work
        self.outside = spec.eps_placement == "outside"
        # RMSNorm over all elements with eps inside: keras.layers.RMSNormalization's function,
        # differentiated through Keras' operations (`keras_output`), unless told otherwise.
        self.keras_order = keras_order and spec.kind == "rms" and not self.outside
        exponent = 256 if work == "float64" else 32
        # float64's bounds are tensors of it: a Python float meets a tensor in float32 on some
        # backends (Keras' torch backend: 2**-640 becomes 0, 2**512 inf).
        scalar = (lambda v: ops.convert_to_tensor(v, work)) if work == "float64" else float
        tiny = float(np.finfo(work).tiny)
        self.bound_value = 2.0**exponent
        self.bound = scalar(self.bound_value)
        self.big = scalar(2.0 ** (2 * exponent))
        self.tiny = scalar(tiny)
        # Below this s may have lost digits to squares below `tiny` (flushed, or subnormal):
        # their total error is at most tiny, a quarter ulp of s here. With eps outside,
        # r'(s) x_i = -r**2 x_i / (2 sqrt(s)) needs s to full precision however small it is.
        self.small_value = tiny * 2.0 ** (np.finfo(work).nmant + 3)
        self.small = scalar(self.small_value)
        # The largest r the plain path forms (larger only on rows that `rescaled` replaces):
        # r**3 stays finite, so its gradient does (see `_bounded`).
        self.clip_r = scalar(2.0 ** (1.25 * exponent))
        self.maximum = _maximum if work == "float64" else ops.maximum

    def center(self, x: Any) -> Any:
        """``x`` (RMS kinds) or ``x - mean(x)`` with one correction pass (LayerNorm)."""
        if self.spec.kind != "layer":
            return x
        if self.n == 2:
            # c = +-(x0 - x1) / 2 from one subtraction, exact when x0 and x1 are close
            # (Sterbenz); x - mean(x) would carry the rounding of x0 + x1. Linear in x with the
            # Jacobian of x - mean(x), [[1, -1], [-1, 1]] / 2, since the sign pattern is (1, -1).
            sign = ops.cast(np.array([1.0, -1.0]).reshape(self.target), self.work)
            c = sign * (ops.sum(x * sign, axis=self.axes, keepdims=True) * 0.5)
            return self._bounded(c, x)
        # sum(x / n) cannot overflow where sum(x) / n can; the mean of the centered values,
        # subtracted again, recovers what the rounding of a large mean lost.
        c = self._bounded(x - ops.sum(x * (1 / self.n), axis=self.axes, keepdims=True), x)
        return c - ops.sum(c * (1 / self.n), axis=self.axes, keepdims=True)

    def _bounded(self, c: Any, x: Any) -> Any:
        """``c`` with the values of magnitude above `big` that come from finite ``x`` clipped to
        +-big. Their squares overflow either way, and the rows whose statistic reads them are
        rescaled; the clip keeps the gradient of the unused plain values finite (a branch not
        taken still receives a zero cotangent, and 0 * inf would be NaN)."""
        beyond = ops.logical_and(ops.abs(c) > self.big, ops.isfinite(x))
        return ops.where(beyond, ops.sign(c) * self.big, c)

    def statistic(self, c: Any) -> Any:
        """``s``: the mean of ``c**2`` over the row, or over its first k elements only."""
        c = self._bounded(c, c)
        if self.head is None:
            return _mean(ops.square(c), self.axes)
        # The elements after the first k are masked before squaring: a NaN, an inf or a
        # 1e20 there must not enter s, nor its gradient.
        head = ops.where(self.head, c, ops.zeros_like(c))
        return ops.sum(ops.square(head), axis=self.axes, keepdims=True) / self.k

    def plain(
        self, x: Any, eager: bool, source: Any = None
    ) -> tuple[tuple[Any, Any, Any, Any, Any], bool | None]:
        """``((mean, s, r, ratio, bad), any_bad)`` per row for ``y_hat = c r(s)``, ``c = x`` or
        ``x - mean`` (``mean`` None for the RMS kinds), with no guard op: ``ratio = r'(s) /
        (-r**3 / 2)`` (1 inside, ``1 + eps / sqrt(s)`` outside) for `plain_output`'s backward,
        and whether the row must be recomputed by the guarded program (`needs_rescaling`, or a
        LayerNorm mean above ``sqrt(s)``, whose rounding the correction pass in `center`
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
        values on JAX), except with `keras_order`, differentiated as Keras' layer is; ``s`` is
        given there only (None otherwise), for `keras_output`'s rows whose ``dr`` overflows.
        ``x`` is ``source`` cast to the work dtype (``source`` None: ``x`` itself); LayerNorm's
        two reductions each cast a copy of their own where `_separating`."""
        assert self.spec.eps is not None
        if not self.keras_order:
            x = ops.stop_gradient(x)
        mean = None
        if self.spec.kind == "layer" and source is not None and _separating(not eager):
            first, second = _separately(
                lambda v: ops.cast(ops.stop_gradient(v), self.work), (source,), 2, traced=True
            )
            mean = _mean(first, self.axes)
            s = _mean(ops.square(second - mean), self.axes)
        elif self.spec.kind == "layer":
            # mean((x - mean)**2) as Keras' LayerNormalization forms it: one op on TensorFlow
            # (a squared difference), where x - mean and its square would be two passes.
            mean, s = ops.moments(x, axes=list(self.axes), keepdims=True)
        elif self.head is None:
            s = _mean(ops.square(x), self.axes)
        elif self.axes == (len(self.target) - 1,):
            s = _mean(ops.square(x[..., : self.k]), self.axes)
        else:
            head = ops.where(self.head, x, ops.zeros_like(x))
            s = ops.sum(ops.square(head), axis=self.axes, keepdims=True) / self.k
        kept = s if self.keras_order else None
        # Traced, per-row clamps that change only rows marked bad, so that their values stay
        # finite; eagerly a bad row sends the whole input to the guarded program instead.
        if self.outside:
            root = ops.sqrt(s if eager else self.maximum(s, self.small))
            r = 1.0 / (root + self.spec.eps)
            ratio = 1.0 + self.spec.eps / root
        else:
            total = s + self.spec.eps
            r = ops.rsqrt(total if eager else self.maximum(total, 1 / self.clip_r**2))
            ratio = None
        if eager:
            return (mean, kept, r, ratio, None), self.any_bad_now(s, r, mean)
        bad = self.needs_rescaling(s, r)
        if mean is not None:
            bad = ops.logical_or(bad, ops.logical_not(ops.abs(mean) <= ops.sqrt(s)))
        return (mean, kept, ops.where(bad, 1.0, r), ratio, bad), None

    def any_bad_now(self, s: Any, r: Any, mean: Any) -> bool:
        """`plain`'s judgement of the rows on the host, from the row-sized ``s``, ``r`` and
        ``mean`` (None for the RMS kinds): whether a row needs rescaling (`needs_rescaling`) or
        has a LayerNorm mean above ``sqrt(s)``."""
        r_now = _on_host(r)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~((r_now >= 1 / self.bound_value) & (r_now <= self.bound_value))
            if self.outside:
                bad |= _on_host(s) < self.small_value
            if mean is not None:
                bad |= ~(np.abs(_on_host(mean)) <= np.sqrt(_on_host(s)))
        return bool(bad.any())

    def plain_output(
        self,
        source: Any,
        stats: tuple[Any, Any, Any, Any, Any],
        traced: bool,
        scale: Any = None,
        bias: Any = None,
        output_dtype: str | None = None,
    ) -> Any:
        """``y = c r (* scale) (+ bias)`` from `plain`'s ``stats``, for ``x = source`` cast to
        the work dtype, in ``output_dtype`` (the work dtype for None), with the analytic backward
        of `normkit.reference.normalize_vjp`: for ``d = dy * scale``, ``A = ratio sum(d y_hat)``,
        ``dx = r (d - [i < k] y_hat A / k)`` (RMS kinds) or ``r (d - mean(d) - y_hat A / n)``
        (LayerNorm); ``dscale = sum(dy y_hat)``, ``dbias = sum(dy)`` over the other axes. Both
        casts are inside, so that the backward pass reads ``source`` and ``dy`` as they are
        (`_separately`).

        When ``traced``, the branch may run beside the guarded one (a ``cond`` turned into a
        select), so the rows marked ``bad`` get a zero gradient (``y_hat`` zeroed per row: finite
        wherever ``x`` is).

        With `keras_order` it is `keras_output`, whose gradient is autodiff's through Keras'
        operations (the same formula, rounded as Keras rounds it), so that training matches
        ``keras.layers.RMSNormalization``'s to the bit.
        """
        mean, s, r, ratio, bad = stats
        work = self.work
        out = work if output_dtype is None else output_dtype
        if self.keras_order:
            return ops.cast(self.keras_output(ops.cast(source, work), s, r, scale, bias), out)
        count = self.k if self.spec.kind != "layer" else self.n

        def y_hat_of(x: Any, mean: Any, r: Any) -> Any:
            return (x if mean is None else x - mean) * r

        # The statistics are arguments, not closed over: JAX's custom gradient may not close
        # over values of an enclosing trace. Their own gradients are None (dx holds them).
        own = (mean, r, ratio, bad)
        row_stats = [u for u in own if u is not None]

        present = tuple(p for p in (scale, bias) if p is not None)
        if not _recording(source, *present):
            y_hat = y_hat_of(ops.cast(source, work), mean, r)
            return ops.cast(_affine_step(y_hat, (scale, bias), present), out)

        @ops.custom_gradient
        def output(source: Any, *args: Any) -> Any:
            given = iter(args)
            stats = tuple(None if u is None else next(given) for u in own)
            params = tuple(given)
            y_hat = y_hat_of(ops.cast(source, work), stats[0], stats[1])
            y = ops.cast(_affine_step(y_hat, (scale, bias), params), out)

            def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
                dy = args[0] if upstream is None else upstream

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
                    y_hat = y_hat_of(ops.cast(source, work), mean, r)
                    dy = ops.cast(dy, work)
                    return dy, (dy if scale is None else dy * params[0]), y_hat, stats

                # Each sum, and dx, reads copies of its own (`_separately`).
                projected, averaged, scaled, biased, applied = _separately(
                    terms, (source, dy, stats, params), 5, traced
                )
                _, d, y_hat, (_, _, ratio, _) = projected
                total = ops.sum(d * y_hat, axis=self.axes, keepdims=True)
                factor = total * (1 / count) if ratio is None else total * ratio * (1 / count)
                _, d, y_hat, (mean, r, _, _) = applied
                if mean is None:
                    dx = r * (d - self.head_share(y_hat, factor))
                else:
                    _, d_averaged, _, _ = averaged
                    d_mean = _mean(d_averaged, self.axes)
                    dx = r * (d - d_mean - y_hat * factor)
                dx = ops.cast(dx, keras.backend.standardize_dtype(source.dtype))
                dy_scaled, _, y_hat_scaled, _ = scaled
                dy_biased, _, _, _ = biased
                grads = self.param_grads(
                    dy_scaled, y_hat_scaled, scale, bias, params, dy_biased
                )
                return (dx, *[None] * len(row_stats), *grads)

            return y, grad

        return output(source, *row_stats, *present)

    def head_share(self, y_hat: Any, factor: Any) -> Any:
        """``[i < k] y_hat factor``: the statistic's share of ``dx / r``, on the first k
        elements only. The mask comes last, so that a NaN or infinite ``factor`` (a NaN in the
        tail enters the row's sum) stays out of the tail, as in the reference."""
        share = y_hat * factor
        return share if self.head is None else ops.where(self.head, share, ops.zeros_like(share))

    def normalized(self, c: Any, r: Any, w: Any) -> Any:
        """`_guarded`'s ``y_hat = c r``, whose gradient reaches ``c`` in the reference's closed
        form, in ``c``'s units: ``dc = r (d - [i < k] y_hat sum(d c rho) / k)`` with ``rho =
        -2 r'(s) / r**2``, ``r`` inside, ``1 / sqrt(s)`` outside; ``c rho`` is formed from
        `r`'s ``w`` as ``c w`` (inside) or ``c / w`` (outside, 0 where ``w = sqrt(s)`` is).
        ``r`` and ``w`` get no gradient of their own (the closed form holds the statistic's); a
        second derivative reaches them through ``dc``.

        Autodiff through ``r(s)`` would form ``sum(d c)`` and ``r'(s)`` apart: on an ordinary
        row beside one that sends the batch here, |x| 1e9 with a cotangent of 1e29, that sum
        overflows float32 where dx is about 1e20, and the row's gradient was NaN. Here the sum
        reads ``c rho``, of the size of ``y_hat``. LayerNorm's centering before is
        differentiated by autodiff (``dx = dc - mean(dc)``, ``c`` having mean 0)."""
        if not _recording(c):
            return c * r

        @ops.custom_gradient
        def output(c: Any, r: Any, w: Any) -> Any:
            y_hat = c * r

            def grad(*args: Any, upstream: Any = None) -> tuple[Any, Any, Any]:
                d = args[0] if upstream is None else upstream
                if self.outside:
                    positive = w > 0
                    c_rho = c / ops.where(positive, w, ops.ones_like(w))
                    c_rho = ops.where(positive, c_rho, ops.zeros_like(c_rho))
                else:
                    c_rho = c * w
                total = ops.sum(d * c_rho, axis=self.axes, keepdims=True)
                return r * (d - self.head_share(y_hat, total * (1 / self.k))), None, None

            return y_hat, grad

        return output(c, r, w)

    def param_grads(
        self,
        dy: Any,
        y_hat: Any,
        scale: Any,
        bias: Any,
        params: tuple[Any, ...],
        bias_dy: Any = None,
    ) -> list[Any]:
        """The gradients of the parameters present: ``sum(dy y_hat)`` for the scale,
        ``sum(dy)`` for the bias (of ``bias_dy``, a copy of ``dy``, where given), over the axes
        they broadcast along."""
        grads = []
        if scale is not None:
            grads.append(self.summed(dy * y_hat, params[0]))
        if bias is not None:
            grads.append(self.summed(dy if bias_dy is None else bias_dy, params[-1]))
        return grads

    def summed(self, u: Any, param: Any) -> Any:
        """``u`` summed over the axes ``param`` broadcasts along, in ``param``'s shape."""
        others = tuple(a for a in range(len(self.target)) if a not in self.axes)
        total = ops.sum(u, axis=others) if others else u
        return total if total.shape == param.shape else ops.reshape(total, param.shape)

    def keras_output(self, x: Any, s: Any, r: Any, scale: Any = None, bias: Any = None) -> Any:
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
        if not _recording(x, *present):
            return _affine_step(x * r, (scale, bias), present)

        @ops.custom_gradient
        def output(x: Any, s: Any, r: Any, *params: Any) -> Any:
            product = x * r
            y = _affine_step(product, (scale, bias), params)

            def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
                dy = args[0] if upstream is None else upstream

                d = dy if scale is None else dy * params[0]
                dr = ops.sum(d * x, axis=self.axes, keepdims=True)
                finite = ops.isfinite(dr * (r * r * r))
                every_row = ops.all(finite)
                known = _known(every_row)
                ds = None
                if known is None:
                    # The branch forms d again from dy: under XLA, d as its input would be
                    # written out, where the common case fuses it into its readers.
                    kept, patched = _dr_branches(self.axes, self.n)
                    gain = params[:1] if scale is not None else ()
                    ds, dr = _cond(every_row, kept, patched, x, r, dy, dr, finite, *gain)
                elif not known:
                    ds, dr = _patched_rows(self.axes, self.n, x, r, d, dr, finite)
                return (d * r, ds, dr, *self.param_grads(dy, product, scale, bias, params))

            return y, grad

        return output(x, s, r, *present)

    def needs_rescaling(self, s: Any, r: Any) -> Any:
        """Per row, whether `rescaled` must recompute it: ``r`` outside ``[1/bound, bound]``
        or NaN, or with eps outside ``s`` below `small` (zero rows included: their squares may
        have underflowed)."""
        bad = ops.logical_not(ops.logical_and(r >= 1 / self.bound, r <= self.bound))
        return ops.logical_or(bad, s < self.small) if self.outside else bad

    def r(self, s: Any, eps: Any, unit: Any = 1.0) -> tuple[Any, Any]:
        """``(r, w)`` of the statistic ``unit**2 s`` (``s`` given in units of ``unit**2``:
        eps outside only; ``unit`` a constant), ``w`` for `normalized`: ``r`` inside, ``unit
        sqrt(s)`` outside (sqrt's infinite derivative at s = 0 taken as 0, as in the
        reference). A NaN statistic stays NaN. Both are differentiable (second derivatives
        through `normalized`'s gradient) with finite derivatives: where a traced ``cond``
        passes them a zero cotangent, ``1 / sqrt(s)``'s would be 0 * inf on tiny rows."""
        if not self.outside:
            total = s + eps
            r = ops.rsqrt(ops.where(total < 1 / self.clip_r**2, 1 / self.clip_r**2, total))
            return r, r
        positive = s > 0
        root = ops.where(
            positive, ops.sqrt(ops.where(positive, s, ops.ones_like(s))), ops.stop_gradient(s)
        )
        total = unit * root + eps
        return 1.0 / ops.where(total < 1 / self.clip_r, 1 / self.clip_r, total), unit * root

    def rescaled(
        self, x: Any, c: Any, r: Any, w: Any, bad: Any
    ) -> tuple[Any, Any, Any, Any]:
        """``(c, r, eps, w)`` with the ``bad`` rows divided by their largest magnitude (at
        least eps's: ``sqrt(eps)`` inside, ``eps`` outside) rounded to a power of two
        (`_reciprocal_power_of_two`: exactly), so that their s lies in [1/(4k), 1].

        LayerNorm rows are scaled, centered, then scaled again by their largest centered value.
        The factors are constants to autodiff (``y_hat`` does not depend on them); ``pre``, 1
        or a power of two, keeps them normal numbers (subnormals may be flushed to zero). With
        eps outside, a row smaller than eps has its statistic taken once more in units of its
        largest magnitude ``m``, ``sqrt(s) = m sqrt(mean((c/m)**2))``, so that no square
        underflows (`r`'s ``unit``).
        """
        eps = self.spec.eps
        floor = eps if self.outside else float(np.sqrt(eps))
        magnitude = ops.abs(x)
        if self.head is not None:
            magnitude = ops.where(self.head, magnitude, ops.zeros_like(magnitude))
        largest = ops.stop_gradient(ops.max(magnitude, axis=self.axes, keepdims=True))
        pre = ops.cast(ops.where(largest > self.big, 1 / self.big, 1.0), largest.dtype)
        extent = self.maximum(largest * pre, self.maximum(floor * pre, self.tiny))
        # Rows holding an inf or a NaN keep their plain values; they are scaled as zeros so
        # that no NaN reaches the gradient through the unused branch.
        use = ops.logical_and(bad, ops.isfinite(extent))
        sigma = _reciprocal_power_of_two(ops.where(use, extent, ops.ones_like(extent)))
        scaled = ops.where(use, x, ops.zeros_like(x)) * ops.where(use, pre, 1.0) * sigma
        scaled_floor = floor * pre * sigma
        if self.spec.kind == "layer":
            scaled = self.center(scaled)
            widest = ops.max(ops.abs(scaled), axis=self.axes, keepdims=True)
            second = self.maximum(widest, self.maximum(scaled_floor, self.tiny))
            second = ops.stop_gradient(_reciprocal_power_of_two(second))
            scaled, scaled_floor = scaled * second, scaled_floor * second
        scaled_eps = scaled_floor if self.outside else scaled_floor * scaled_floor
        scaled_eps = self.maximum(scaled_eps, self.tiny)
        if self.outside:
            head = scaled if self.head is None else ops.where(self.head, scaled, 0.0)
            unit = ops.stop_gradient(
                self.maximum(ops.max(ops.abs(head), axis=self.axes, keepdims=True), self.tiny)
            )
            scaled_r, scaled_w = self.r(self.statistic(scaled / unit), scaled_eps, unit)
        else:
            scaled_r, scaled_w = self.r(self.statistic(scaled), scaled_eps)
        return (
            ops.where(use, scaled, c),
            ops.where(use, scaled_r, r),
            ops.where(use, scaled_eps, ops.full_like(r, eps)),
            ops.where(use, scaled_w, w),
        )

    def degenerate(self, c: Any, r: Any, eps: Any, y: Any) -> Any:
        """``y = c r`` where the statistic reads one element per row (``f(c) = c r(c**2)``)
        or LayerNorm has two (``c = +-(x0 - x1)/2``), with exact first and second derivatives.

        Autodiff would form ``f'`` as the difference of two nearly equal terms. The closed forms
        (``r = 1/sqrt(c**2 + eps)`` inside, ``1/(|c| + eps)`` outside) are
        ``f' = eps r**3, f'' = -3 eps c r**5`` (inside) and ``f' = eps r**2,
        f'' = -2 eps sign(c) r**3`` (outside); ``y = stop(f) + dc f' + dc**2 f''/2`` with
        ``dc = c - stop(c)`` (zero) has ``f``'s value and its first two derivatives.
        """
        if self.head is not None:
            c = ops.where(self.head, c, ops.zeros_like(c))
        eps_r = eps * r
        if self.outside:
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


def _patched_rows(
    axes: tuple[int, ...], n: int, x: Any, r: Any, d: Any, dr: Any, finite: Any
) -> tuple[Any, Any]:
    """``(ds, dr)`` of `_Rows.keras_output`: on each row not ``finite``, ``dr = 0`` and
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
    """The branches of `_Rows.keras_output`'s gradient for rows of ``n`` elements along
    ``axes``, ``(x, r, dy, dr, finite[, scale]) -> (ds, dr)``: every row's ``dr`` kept, or the
    rows whose ``dr`` overflowed patched (`_patched_rows`). One pair per layout, so that
    `_cond` traces the same functions each call."""

    def kept(x: Any, r: Any, dy: Any, dr: Any, finite: Any, *scale: Any) -> tuple[Any, Any]:
        return ops.zeros_like(dr), dr

    def patched(x: Any, r: Any, dy: Any, dr: Any, finite: Any, *scale: Any) -> tuple[Any, Any]:
        d = dy * scale[0] if scale else dy
        return _patched_rows(axes, n, x, r, d, dr, finite)

    return kept, patched


def _separating(traced: bool) -> bool:
    """Whether passes over the same tensors should each read copies of their own (`_separately`):
    in a program traced for XLA's CPU backend on Keras' JAX backend, which runs a reduction as a
    YNNPACK fusion that takes what another fusion reads too (the float32 conversion of a half
    input, parameters and row statistics broadcast to its shape) as an array written out."""
    if not traced or keras.backend.backend() != "jax":
        return False
    import jax

    return bool(jax.default_backend() == "cpu")


def _separately(f: Any, values: tuple[Any, ...], count: int, traced: bool) -> list[Any]:
    """``count`` results of ``f(*values)`` (tensors, None allowed), one for each pass that reads
    them: where `_separating`, each formed from copies of its own of ``values``, through one
    optimization barrier, so that each pass converts and broadcasts inside; elsewhere one result
    serves all."""
    if _separating(traced):
        import jax

        return [f(*copy) for copy in jax.lax.optimization_barrier((values,) * count)]
    return [f(*values)] * count


def _cond(pred: Any, true_fn: Any, false_fn: Any, *operands: Any) -> Any:
    """``true_fn(*operands)`` where the traced ``pred`` holds, else ``false_fn(*operands)``. On
    JAX the operands go to `jax.lax.cond` as its arguments: the same functions then give the
    same program, compiled once even outside ``jit`` (where ``jax.vjp`` traces a backward on
    every call, and a cond of fresh closures is compiled anew each time)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    return ops.cond(pred, lambda: true_fn(*operands), lambda: false_fn(*operands))


def _mean(u: Any, axes: tuple[int, ...]) -> Any:
    """The mean of ``u`` over ``axes`` (kept): `ops.mean`, or for float64 the sum over the
    count, since Keras 3 (``BIT64_TO_BIT32_DTYPE``) makes ``ops.mean`` sum a float64 tensor in
    float32 on its JAX and torch backends (a row of 1e-200s has mean 0 there)."""
    if keras.backend.standardize_dtype(u.dtype) != "float64":
        return ops.mean(u, axis=axes, keepdims=True)
    return ops.sum(u, axis=axes, keepdims=True) / math.prod(u.shape[a] for a in axes)


def _reciprocal_power_of_two(m: Any) -> Any:
    """``2**-e`` with ``m 2**-e`` in [1, 2), for positive normal ``m`` below ``2**127``
    (``2**1023`` in float64), from ``m``'s exponent bits: scaling by it is exact, where
    ``1 / m`` rounds every value it scales, by ``2**-24`` of ``|x|``, which centering a large
    mean turns into ``|mean| / std`` times that of the centered values (rows of 1e25 (10 +
    N(0, 1)) were 1.05e-6 of their max|y| off with a gate after the norm)."""
    wide = keras.backend.standardize_dtype(m.dtype) == "float64"
    ints, shift, top = ("int64", 52, 2046) if wide else ("int32", 23, 254)
    biased = ops.bitwise_and(ops.right_shift(ops.view(m, ints), shift), top + 1)
    return ops.view(ops.left_shift(top - biased, shift), m.dtype)


def _fast_moments(x: Any, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """``variance="fast"``'s ``(m1, v)`` over ``axes`` (kept), each step rounded once to ``x``'s
    dtype ``c`` as `normkit.reference` says::

        m1 = c(mean(x))    m2 = c(mean(c(x^2)))    v = max(0, c(m2 - c(m1^2)))

    A float32 ``x`` cannot take these as written where a compiler reorders them: XLA (under
    ``jit_compile`` and ``jax.jit``) divides by ``n`` as a product by ``1 / n`` (float16 rows of
    a large mean came out 32 ulps off) and contracts ``m2 - m1 * m1`` into one fused
    multiply-add, which leaves ``m1^2`` unrounded (and turned ``inf - inf`` into ``inf``). On
    JAX the steps are normkit.jax's (`normkit._jax_exact`); elsewhere the float32 squares are
    summed in float64, each mean is rounded from float64 (correct but within about ``2**-29``
    ulp of a halfway point), and ``m1^2`` is `_rounded_square`. float64 inputs take the steps
    as written."""
    if _float_dtype(x.dtype) == "float64":
        m1 = _mean(x, axes)
        v = _mean(ops.square(x), axes) - m1 * m1
        return m1, _maximum(v, ops.zeros_like(v))
    if keras.backend.backend() == "jax":
        from normkit import _jax_exact

        return _jax_exact.fast_moments(x, axes, math.prod(x.shape[a] for a in axes))
    m1 = ops.cast(_mean(ops.cast(x, "float64"), axes), x.dtype)
    m2 = ops.cast(_mean(ops.cast(x * x, "float64"), axes), x.dtype)
    v = m2 - _rounded_square(m1)
    return m1, _maximum(v, ops.zeros_like(v))


def _rounded_square(m: Any) -> Any:
    """``m * m`` of float32 ``m``, rounded once: on TensorFlow from halves of 12 bits
    (`normkit._float_pairs`), whose products XLA's contraction into a following subtraction
    cannot change (a float64 square cast to float32 becomes the float32 product it equals);
    on torch, whose eager ops are not fused, the float64 square rounded to float32."""
    if keras.backend.backend() != "tensorflow":
        wide = ops.cast(m, "float64")
        return ops.cast(wide * wide, m.dtype)
    import tensorflow as tf

    def split(a: Any) -> tuple[Any, Any]:
        bits = tf.bitwise.bitwise_and(tf.bitcast(a, tf.int32), _float_pairs.LOW_HALF)
        high = tf.bitcast(bits, a.dtype)
        return high, a - high

    plain = m * m
    return tf.where(tf.math.is_inf(plain), plain, _float_pairs.exact_product(m, m, split)[0])


def _tanh(u: Any) -> Any:
    """``tanh(u)`` in ``u``'s dtype: `ops.tanh`, which on Keras' JAX backend computes a float64
    ``u`` in float32 (as `_mean`), so ``jnp.tanh`` there."""
    if keras.backend.backend() != "jax" or keras.backend.standardize_dtype(u.dtype) != "float64":
        return ops.tanh(u)
    import jax.numpy as jnp

    return jnp.tanh(u)


def _dyt(alpha: Any, x: Any, recording: bool) -> Any:
    """DyT's ``tanh(alpha x)``; where a gradient may be taken (``recording``), differentiated
    with the slope ``sech(alpha x)^2`` from ``e^-2|alpha x|`` (`normkit._dyt`), times the
    cotangent before its unit: the backends' ``1 - tanh(u)^2`` is 0 in float32 from
    ``|u| = 9`` on (dx was 0 on rows of 30 with alpha 0.5, the reference's 1e-12)."""
    u = alpha * x
    if not recording:
        return _tanh(u)
    wide = keras.backend.standardize_dtype(u.dtype) == "float64"

    @ops.custom_gradient
    def activated(u: Any) -> Any:
        def grad(*args: Any, upstream: Any = None) -> Any:
            slope, unit = _dyt_math.tanh_slope(u, ops, wide)
            return ((args[0] if upstream is None else upstream) * slope) * unit

        return _tanh(u), grad

    return activated(u)


def _maximum(a: Any, b: Any) -> Any:
    """``max(a, b)`` elementwise in ``a``'s dtype, NaN where ``a`` is NaN: `ops.maximum` for
    float64, which Keras' torch backend computes in float32 (its dtype promotion does not read
    torch's dtypes)."""
    return ops.where(a < b, b, a)


def _promoted(dtype: str, *param_dtypes: str) -> str:
    """The promoted dtype of ``dtype`` and the parameters' dtypes, by the reference's rule
    (`normkit.reference.output_dtype`): the widest; float16 with bfloat16 gives float32."""
    given = [np.empty(0, dtypes.as_float_dtype(d)) for d in param_dtypes]
    return reference.output_dtype(dtype, _PROMOTE, *given).name


_PROMOTE = NormSpec(output_dtype="promote")


class _Norm(keras.layers.Layer):
    """The shared machinery: weights, dtype policy, shape checks and the spec's arithmetic.

    Dtypes, as Keras' layers: a floating input is first cast to the policy's compute dtype
    (float32 under ``"float32"``, bfloat16 under ``"mixed_bfloat16"``, ...), unless the layer is
    built with Keras' ``autocast=False``, which keeps the input's dtype. The spec then applies to
    that input: the statistic and the normalized value in float32 (float64 for float64), the
    output in its dtype (``output_dtype="input"``) or in its promotion with the variables' dtypes
    (``"promote"``). Variables have ``param_dtype``, by default the policy's variable dtype, and
    are never autocast. The weights are ``gamma`` (``w``), ``beta`` (``b``) and ``alpha`` (DyT),
    None where the spec has none, stored under the names ``"scale"``, ``"bias"``, ``"alpha"``.
    """

    def __init__(self, spec: NormSpec, param_dtype: str | None = None, **kwargs: Any) -> None:
        # Keras' autocast argument, applied in `call`: Keras' own cast in __call__ (which reads
        # self.autocast) would also round a float32 residual stream to a half compute dtype.
        autocast = bool(kwargs.pop("autocast", True))
        super().__init__(autocast=False, **kwargs)
        self._autocast_inputs = autocast
        self._warned_of_policy = False  # `_warn_of_policy`
        self._spec = spec
        self._param_dtype = None if param_dtype is None else _float_dtype(param_dtype)
        self.supports_masking = True
        self._param_shape: tuple[int, ...] | None = None
        self.gamma: Any = None
        self.beta: Any = None
        self.alpha: Any = None
        self._grouped: Any = None  # the inner norm of gated and grouped specs (`build`)

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this layer computes."""
        return self._spec

    @property
    def axis(self) -> int | list[int]:
        """The normalized axes as given: an int, or a list of ints for several."""
        axes = self._spec.axis
        return axes[0] if len(axes) == 1 else list(axes)

    @property
    def epsilon(self) -> float | None:
        """``eps`` (None for DyT, which has no statistic)."""
        return self._spec.eps

    @property
    def param_dtype(self) -> str:
        """The dtype of the variables: ``param_dtype``, or the policy's variable dtype."""
        return self._param_dtype or keras.backend.standardize_dtype(self.variable_dtype)

    def _axes(self, shape: tuple[int | None, ...]) -> tuple[int, ...]:
        try:
            return self._spec.resolve_axes(len(shape))
        except ValueError as err:
            raise ValueError(f"{self.name}: input of shape {shape}: {err}") from None

    def _input_dtype(self, dtype: Any) -> str:
        """The dtype the spec sees: the compute dtype (Keras' autocast), or with
        ``autocast=False`` the input's. TypeError for a non-floating input (Keras' own layers
        compute on integers in integer arithmetic)."""
        dtype = keras.backend.standardize_dtype(dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise TypeError(
                f"{self.name}: the input has dtype {dtype}; {type(self).__name__} needs a "
                "floating input (float16, bfloat16, float32 or float64)"
            )
        seen = self.compute_dtype if self._autocast_inputs else dtype
        if dtype in _HALF and seen != dtype and not self._warned_of_policy:
            self._warn_of_policy(dtype, seen)
        return seen

    def _warn_of_policy(self, dtype: str, seen: str) -> None:
        """Warn (once per layer) where the policy casts a half input to another dtype and the
        spec has steps that act on half inputs: they then act on ``seen`` values, and the layer
        no longer computes what the reference and the other adapters compute for ``dtype``."""
        spec = self._spec
        steps = [f"cast={spec.cast!r}"] * (spec.cast == "before_scale")
        steps += [f"backward={spec.backward!r}"] * (spec.backward == "autograd")
        steps += [f"residual={spec.residual!r}"] * (spec.residual in ("rounded",
                                                                      "float32_normalized"))
        if not steps:
            return
        self._warned_of_policy = True
        policy = f"mixed_{dtype}" if self.param_dtype == "float32" else dtype
        warnings.warn(
            f"{self.name}: a {dtype} input is cast to {seen} by the dtype policy "
            f"{self.dtype_policy.name!r} (Keras' autocast), so the spec's half-precision steps "
            f"({', '.join(steps)}) act on {seen} values, not on the {dtype} ones "
            f"normkit.reference, normkit.torch and normkit.jax take them on: y is {seen} and "
            f"differs from theirs by about an ulp of {dtype}. To compute the spec on {dtype} "
            f"inputs, build the layer with dtype={policy!r} (or autocast=False).",
            UserWarning,
            stacklevel=2,
        )

    def _present(self) -> list[str]:
        """The names of the variables the spec has, in the order `build` creates them."""
        spec = self._spec
        names = ["alpha"] if spec.kind == "dyt" else []
        return names + ["scale"] * spec.scale + ["bias"] * bool(spec.bias)

    def _output_dtype(self, dtype: str) -> str:
        """The output dtype for inputs the spec sees as ``dtype`` (see `_input_dtype`)."""
        if self._spec.output_dtype == "input":
            return dtype
        return _promoted(dtype, *[self.param_dtype] * len(self._present()))

    def _h_dtype(self, dtype: str) -> str:
        """The dtype of ``h``: the compute dtype with ``residual="float32"``, else ``dtype``."""
        if self._spec.residual != "float32":
            return dtype
        return "float64" if dtype == "float64" else "float32"

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        shape = tuple(input_shape)
        axes = self._axes(shape)
        param_shape = tuple(shape[a] for a in axes)
        if any(d is None for d in param_shape):
            raise ValueError(
                f"{self.name}: the normalized axes {axes} of input shape {shape} must have known "
                "sizes to create the weights"
            )
        self._param_shape = param_shape
        if self._spec.gate is not None or self._spec.group_size is not None:
            self._spec.group_count(math.prod(param_shape))
            # Each group's statistic, with this layer's guards and exact gradient.
            self._grouped = from_spec(_gating.group_spec(self._spec), autocast=False)
        dtype = self.param_dtype
        if self._spec.kind == "dyt":
            self.alpha = self.add_weight(
                name="alpha",
                shape=(1,),
                initializer=keras.initializers.Constant(self._spec.alpha_init),
                dtype=dtype,
                autocast=False,
            )
        if self._spec.scale:
            self.gamma = self.add_weight(
                name="scale",
                shape=param_shape,
                dtype=dtype,
                autocast=False,
                **self._weight_options("scale"),
            )
        if self._spec.bias:
            self.beta = self.add_weight(
                name="bias",
                shape=param_shape,
                dtype=dtype,
                autocast=False,
                **self._weight_options("bias"),
            )

    def _weight_options(self, name: str) -> dict[str, Any]:
        """The initializer (and regularizer, constraint) of the weight ``name``: ``w`` starts
        at ``1 - scale_offset`` (the effective scale at one), ``b`` at zero."""
        if name == "scale":
            return {"initializer": keras.initializers.Constant(self._spec.scale_init)}
        return {"initializer": "zeros"}

    def _broadcast_shape(self, shape: tuple[int | None, ...]) -> tuple[tuple[int, ...], list[int]]:
        """The normalized axes of ``shape``, checked against the built sizes, and the shape that
        broadcasts a parameter over the input (1 on the other axes)."""
        axes = self._axes(shape)
        assert self._param_shape is not None
        for a, size in zip(axes, self._param_shape, strict=True):
            if shape[a] is not None and shape[a] != size:
                raise ValueError(
                    f"{self.name}: axis {a} of the input (shape {shape}) has size {shape[a]}, but "
                    f"the layer was built for size {size} there (normalized sizes "
                    f"{self._param_shape} over axis {self._spec.axis})"
                )
        target = [1] * len(shape)
        for a, size in zip(axes, self._param_shape, strict=True):
            target[a] = size
        return axes, target

    def _residual_dtype(self, shape: tuple[Any, ...], residual: Any, dtype: str) -> str | None:
        """Check the call's residual against the spec; the dtype to add it in (None: none).

        A floating residual is autocast to the compute dtype, as the input is, except one in
        ``h``'s dtype with ``residual="float32"`` (a float32 residual stream next to half inputs).
        """
        spec = self._spec
        if spec.residual is None:
            if residual is not None:
                raise ValueError(
                    f"{self.name}: a residual was passed, but the layer's spec has residual=None; "
                    "build it with residual='rounded', 'float32' or 'float32_normalized' to add "
                    "one"
                )
            return None
        if residual is None:
            raise ValueError(
                f"{self.name}: the spec has residual={spec.residual!r}; call the layer as "
                "layer(x, residual), which returns (y, h)"
            )
        if tuple(residual.shape) != shape:
            raise ValueError(
                f"{self.name}: the residual has shape {tuple(residual.shape)}, expected the "
                f"input's shape {shape}"
            )
        found = keras.backend.standardize_dtype(residual.dtype)
        stream = self._h_dtype(dtype)
        allowed = {dtype, stream}
        if found in allowed:
            return found
        if self._autocast_inputs and keras.backend.is_float_dtype(found):
            return dtype
        names = " or ".join(sorted(allowed))
        raise TypeError(
            f"{self.name}: the residual has dtype {found}; residual={spec.residual!r} with an "
            f"input of dtype {dtype} needs {names}"
        )

    def call(self, inputs: Any, residual: Any = None, gate: Any = None) -> Any:
        """The spec applied to ``inputs`` (a floating tensor), in the output dtype above; with a
        residual spec, ``(y, h)`` for ``h = inputs + residual``; with a gated spec, the gated
        norm of ``inputs`` and ``gate`` (``layer(x, gate=z)``)."""
        kernels = self._pallas_kernels(inputs, residual, gate)
        return self._call_ops(inputs, residual, gate) if kernels is None else kernels

    def _pallas_kernels(self, inputs: Any, residual: Any, gate: Any) -> Any:
        """On Keras' JAX backend under ``jax.jit``, with normkit's Pallas kernels selected
        (``NORMKIT_JAX_KERNELS=pallas``, docs/jax.md) and computing the call: the kernels on
        NVIDIA GPUs, `_call_ops`' program on every other platform, chosen when the program is
        lowered (`jax.lax.platform_dependent`). None otherwise."""
        if keras.backend.backend() != "jax" or not _traced_for_xla(inputs):
            return None
        from jax import lax

        from normkit import _pallas

        if not _pallas.selected(None):
            return None
        dtype = self._input_dtype(inputs.dtype)
        self._spec.check_eps(dtype)
        added = self._residual_dtype(tuple(inputs.shape), residual, dtype)
        self._check_gate(tuple(inputs.shape), gate)
        x = ops.cast(inputs, dtype)
        second = None if added is None else ops.cast(residual, added)
        weights = [None if w is None else ops.convert_to_tensor(w)
                   for w in (self.gamma, self.beta, self.alpha)]
        axes = self._axes(tuple(x.shape))
        arrays = [second, gate, *weights]
        if not _pallas.supports(x, self._spec, axes, arrays):
            return None

        def on_gpu(x: Any, second: Any, gate: Any, scale: Any, bias: Any, alpha: Any) -> Any:
            return _pallas.run(x, second, self._spec, scale, bias, gate, alpha,
                               self._output_dtype(dtype), interpret=_pallas.interpreting())

        if _pallas.interpreting():
            return on_gpu(x, *arrays)
        return lax.platform_dependent(x, *arrays, cuda=on_gpu,
                                      default=lambda *_: self._call_ops(inputs, residual, gate))

    def _call_ops(self, inputs: Any, residual: Any, gate: Any) -> Any:
        """`call` by the backend's operations (see the module docstring)."""
        spec = self._spec
        dtype = self._input_dtype(inputs.dtype)
        spec.check_eps(dtype)
        shape = tuple(inputs.shape)
        added = self._residual_dtype(shape, residual, dtype)
        work = "float64" if dtype == "float64" else "float32"
        x = _cast_to(inputs, dtype, work)
        self._check_gate(shape, gate)
        if spec.gate is not None or spec.group_size is not None:
            if added is not None:
                raise ValueError(
                    f"{self.name}: normkit.tf does not compute a residual with "
                    f"group_size={spec.group_size} (normkit.torch does); add the residual first"
                )
            scale = None if self.gamma is None else self._effective_scale(work, None)
            bias = None if self.beta is None else self._param(self.beta, work, None)
            return _gated.gated_or_grouped(
                x, gate, spec, dtype, work, scale, bias, self._affine_dtype(dtype),
                self._output_dtype(dtype), self._grouped, gate is not None and _recording(gate),
            )
        if added is None:
            exact = keras.backend.standardize_dtype(inputs.dtype) == dtype
            return self._normalize(x, dtype, work, inputs if exact else x)
        total = _cast_to(residual, added, work) + x
        h = total if spec.residual == "float32" else ops.cast(total, dtype)
        normalized = total
        if spec.residual == "rounded" and spec.backward == "autograd":
            # The eager program: the norm reads the rounded h, so its cotangent is rounded to the
            # input dtype before dh is added (the sum is then rounded once, at x's cast).
            normalized = rounded(total, dtype)
        elif spec.residual == "rounded":
            # The rounded h's value; the gradient reaches the sum unrounded: dx = dh + dnorm.
            normalized = total + ops.stop_gradient(rounded(total, dtype) - total)
        return self._normalize(normalized, dtype, work, normalized), h

    def _check_gate(self, shape: tuple[Any, ...], gate: Any) -> None:
        """A gate exactly when the spec has one: a floating tensor of the input's shape."""
        if self._spec.gate is None:
            if gate is not None:
                raise ValueError(
                    f"{self.name}: a gate was given but the spec has gate=None; build the layer "
                    "with gate='before' or 'after' to gate the norm"
                )
            return
        if gate is None:
            raise ValueError(
                f"{self.name} has gate={self._spec.gate!r}: call it with the gate, "
                "layer(x, gate=z)"
            )
        name = keras.backend.standardize_dtype(gate.dtype)
        if not keras.backend.is_float_dtype(name):
            raise TypeError(f"{self.name}: the gate has dtype {name}; it must be floating")
        if tuple(gate.shape) != shape:
            raise ValueError(f"{self.name}: the gate has shape {tuple(gate.shape)}, x has {shape}")

    def _normalize(self, x: Any, dtype: str, work: str, source: Any) -> Any:
        """The spec on ``x`` (in the ``work`` dtype) with the dtype policy of ``dtype`` inputs;
        ``x`` is ``source`` cast to ``work`` (the branches cast it themselves, so that under XLA
        a half input crosses into them as it is, not as a float32 copy).

        The forward value rounds as the spec says (the fast variance, the before-scale cast);
        the gradient is that of the exact function (`normkit.reference`), or with
        ``backward="autograd"`` that of the eager program in the half dtype (`_eager_affine`).
        """
        spec = self._spec
        axes, target = self._broadcast_shape(tuple(x.shape))
        # Parameters broadcast as they are over trailing axes; elsewhere they are reshaped.
        param_target = None if axes[0] == len(target) - len(axes) else target
        output_dtype = self._output_dtype(dtype)

        def finish(x: Any, y_hat: Any) -> Any:
            return ops.cast(self._finish(x, y_hat, axes, dtype, param_target, work), output_dtype)

        if spec.kind == "dyt":
            alpha = ops.cast(self.alpha, work)
            return finish(x, _dyt(alpha, x, _recording(x, alpha)))
        affine = None
        if spec.variance != "fast" and not (spec.cast == "before_scale" and dtype in _HALF):
            # y = y_hat g + b: the plain rows compute it, and its gradient, in one function.
            scale = None if self.gamma is None else self._effective_scale(work, param_target)
            bias = None if self.beta is None else self._param(self.beta, work, param_target)
            affine = (scale, bias)
        return self._normalized(x, source, axes, target, work, finish, affine, output_dtype)

    def _finish(
        self,
        x: Any,
        y_hat: Any,
        axes: tuple[int, ...],
        dtype: str,
        param_target: list[int] | None,
        work: str,
    ) -> Any:
        """``y`` from ``y_hat`` in the ``work`` dtype: the fast variance's value, the
        before-scale rounding and the affine step, with the gradients `_normalize` states."""
        spec = self._spec
        value = y_hat
        if spec.kind != "dyt" and spec.variance == "fast":
            value = self._fast_normalized(x, axes)
        before_scale = spec.cast == "before_scale" and dtype in _HALF
        if before_scale:
            value = rounded(value, dtype)
        if before_scale and spec.backward == "autograd":
            path, acc = self._eager_affine(y_hat, dtype, param_target, work)
            affine = ops.cast(self._affine(value, param_target, work), acc)
            return path + ops.stop_gradient(affine - path)
        y = self._affine(y_hat, param_target, work)
        if value is y_hat:
            return y
        # The rounded value forward; the exact function's gradient backward.
        return y + ops.stop_gradient(self._affine(value, param_target, work) - y)

    def _normalized(
        self,
        x: Any,
        source: Any,
        axes: tuple[int, ...],
        target: list[int],
        work: str,
        finish: Any,
        affine: tuple[Any, Any] | None,
        output_dtype: str,
    ) -> Any:
        """``finish(x, y_hat)`` for a normalization kind, with exact gradients.

        The plain result (`_Rows.plain_output`, with the affine step ``affine = (g, b)`` when
        ``finish`` is only that step and the cast to ``output_dtype``) stands unless a row's own
        ``s`` or ``r`` shows it inaccurate; then `_guarded` recomputes the input, in a branch
        the common case skips. Rows whose statistic reads one element (or LayerNorm's two)
        always take `_guarded`.
        """
        spec = self._spec
        n = int(np.prod(self._param_shape))
        k = spec.stat_size(n)
        # The first k of the n normalized elements in row-major order, as a boolean mask.
        head = None if k == n else (np.arange(n) < k).reshape(target)
        # Keras' autodiff order makes training bit-identical to Keras' RMSNormalization, in
        # eager calls and graphs. Not where XLA compiles: its fusions decide the bits there,
        # and a branch differentiated in place outputs its intermediates for the backward.
        rows = _Rows(spec, axes, target, n, k, head, work, keras_order=not _traced_for_xla(x))

        def guarded(source: Any, *params: Any) -> Any:
            x = ops.cast(source, work)
            if affine is None:
                return finish(x, self._guarded(x, rows))
            return ops.cast(_affine_step(self._guarded(x, rows), affine, params), output_dtype)

        params = [] if affine is None else [p for p in affine if p is not None]
        if k == 1 or (spec.kind == "layer" and n == 2):
            return guarded(source, *params)
        stats, known = rows.plain(x, _eagerly(x), source)
        row_stats = [u for u in stats if u is not None]

        # Autodiff of Keras' RMSNorm reaches x through r as well: both paths must meet in the
        # work dtype, before the input's cast rounds their sum once. Traced, the value is cast
        # from the source inside the branch and only its gradient goes to x.
        meets_at_x = rows.keras_order and source is not x
        inputs = (source, x) if meets_at_x else (source,)

        def plain(source: Any, *args: Any) -> Any:
            """The plain rows' ``y`` from the input (and ``x`` where the gradient meets there),
            `plain`'s statistics and the parameters (``row_stats`` then ``params``), all as
            arguments so that it may be recomputed."""
            given = iter(args)
            x_work = ops.cast(source, work)
            if meets_at_x:
                x = next(given)
                x_work = _gradient_to(x_work, x) if known is None else x
            row = tuple(None if u is None else next(given) for u in stats)
            if affine is None:
                return finish(x_work, rows.plain_output(x_work, row, known is None))
            step = tuple(None if p is None else next(given) for p in affine)
            # The plain rows cast the source themselves (unless the gradient meets at x).
            plain_source = x_work if meets_at_x else source
            return rows.plain_output(
                plain_source, row, known is None, step[0], step[1], output_dtype
            )

        if known is None:
            # The whole output inside the branches: XLA then writes y once, in the fused pass.
            # With the affine step both branches recompute their values in the backward pass:
            # a traced cond outputs every intermediate either branch's gradient reads (the plain
            # branch's x r for the scale's gradient, whole tensors), where XLA would fuse their
            # recomputation into the backward's passes.
            # Keras' order is not recomputed: a recomputed plain branch differentiates x
            # through the statistics passed in, another order of the same sums.
            recompute = (lambda f: f) if affine is None else _recomputed
            guarded_branch = recompute(guarded)
            plain_branch = plain if rows.keras_order else recompute(plain)
            return ops.cond(
                ops.any(stats[-1]),
                lambda: guarded_branch(source, *params),
                lambda: plain_branch(*inputs, *row_stats, *params),
            )
        # Eagerly x is already in the work dtype: the branches' own casts would be passes more.
        if known:
            return guarded(x, *params)
        return plain(*(x for _ in inputs), *row_stats, *params)

    def _guarded(self, x: Any, rows: _Rows) -> Any:
        """``y_hat`` with every guard: LayerNorm's correction pass, the clip of values whose
        squares overflow, rows far from unit scale rescaled, the closed-form gradients of rows
        whose statistic reads one element (LayerNorm: two)."""
        spec = self._spec
        assert spec.eps is not None
        n, k, head = rows.n, rows.k, rows.head
        c = rows.center(x)
        s = rows.statistic(c)
        r, w = rows.r(s, spec.eps)
        bad = rows.needs_rescaling(s, r)
        any_bad = ops.any(bad)
        known = _known(any_bad)
        eps: Any = spec.eps
        if known is None:
            c, r, eps, w = ops.cond(
                any_bad,
                lambda: rows.rescaled(x, c, r, w, bad),
                lambda: (c, r, ops.full_like(r, spec.eps), w),
            )
        elif known:
            c, r, eps, w = rows.rescaled(x, c, r, w, bad)
        y = rows.normalized(c, r, w)
        if k == 1 or (spec.kind == "layer" and n == 2):
            exact = rows.degenerate(c, r, eps, y)
            y = exact if head is None else ops.where(head, exact, y)
        return y

    def _fast_normalized(self, x: Any, axes: tuple[int, ...]) -> Any:
        """``variance="fast"``'s ``y_hat`` (no gradient): ``(x - m1) r(v)`` with the moments of
        `_fast_moments`."""
        spec = self._spec
        assert spec.eps is not None
        x = ops.stop_gradient(x)
        m1, v = _fast_moments(x, axes)
        if spec.eps_placement == "inside":
            r = ops.rsqrt(v + spec.eps)
        else:
            r = 1.0 / (ops.sqrt(v) + spec.eps)
        return (x - m1) * r

    def _param(self, v: Any, dtype: str, target: list[int] | None) -> Any:
        v = ops.cast(v, dtype)
        return v if target is None else ops.reshape(v, target)

    def _effective_scale(self, dtype: str, target: list[int] | None) -> Any:
        """``scale_offset + w`` in ``dtype``: added there (``offset_dtype="float32"``), or in
        ``w``'s own dtype and rounded there (``"param"``)."""
        offset = self._spec.scale_offset
        if offset and self._spec.offset_dtype == "param":
            # The sum formed in float32 (float64 for float64 weights), rounded once to w's dtype.
            wide = _promoted("float32", self.param_dtype)
            return self._param(rounded(ops.cast(self.gamma, wide) + offset, self.param_dtype),
                               dtype, target)
        g = self._param(self.gamma, dtype, target)
        return g + offset if offset else g

    def _affine(self, y: Any, target: list[int] | None, work: str) -> Any:
        """``y * (scale_offset + w) + b`` in the ``work`` dtype; the weights reshaped to
        ``target`` unless it is None."""
        if self.gamma is not None:
            y = y * self._effective_scale(work, target)
        if self.beta is not None:
            y = y + self._param(self.beta, work, target)
        return y

    def _affine_dtype(self, dtype: str) -> str:
        """The dtype of the eager program's affine step (`normkit.reference`): the input's
        promoted with the effective scale's (``w``'s, or at least float32 when the offset is
        added there) and the bias's."""
        kinds = []
        if self.gamma is not None:
            own = self._spec.offset_dtype == "param" or not self._spec.scale_offset
            kinds.append(self.param_dtype if own else _promoted("float32", self.param_dtype))
        if self.beta is not None:
            kinds.append(self.param_dtype)
        return _promoted(dtype, *kinds)

    def _eager_affine(
        self, y_hat: Any, dtype: str, target: list[int] | None, work: str
    ) -> tuple[Any, str]:
        """``backward="autograd"``: the affine step with the gradient of the eager program, and
        the dtype ``acc`` it is computed in (``work``, or float64 for a float64 affine step).

        The eager program rounds ``z = y_hat`` to ``dtype`` and computes ``z * g + b`` in the
        affine dtype ``a``, so autodiff rounds the products ``dy * g`` (then to ``dtype`` at
        the cast) and ``dy * z`` to ``a``. Here every product is formed in ``acc`` and rounded
        with `rounded`, whose gradient rounds the cotangent the same way: XLA may keep
        half-precision arithmetic in float32, but it keeps that rounding.
        The parameters' gradients are summed in ``acc`` and rounded once to their dtype.
        """
        a = self._affine_dtype(dtype)
        acc = "float64" if a == "float64" else work
        y_hat = ops.cast(y_hat, acc)
        ones = ops.ones_like(y_hat)
        y = rounded(rounded(y_hat, dtype), a)
        if self.gamma is not None:
            y = y * rounded(ones * self._effective_scale(acc, target), a)
        if self.beta is not None:
            y = y + rounded(ones * self._param(self.beta, acc, target), a)
        # The incoming cotangent is rounded to a, as the cast from a to the output dtype does.
        return rounded(y, a), acc

    def compute_output_spec(self, inputs: Any, residual: Any = None, gate: Any = None) -> Any:
        dtype = self._input_dtype(inputs.dtype)
        self._spec.check_eps(dtype)
        shape = tuple(inputs.shape)
        if self.built:
            self._broadcast_shape(shape)
        else:
            self._axes(shape)
        y = keras.KerasTensor(shape, dtype=self._output_dtype(dtype))
        if self._residual_dtype(shape, residual, dtype) is None:
            return y
        return y, keras.KerasTensor(shape, dtype=self._h_dtype(dtype))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> Any:
        """The input's shape (for ``y``, and for ``h`` with a residual); ValueError naming the
        axis when one is out of range for the input's rank."""
        shape = tuple(input_shape)
        self._axes(shape)
        return shape if self._spec.residual is None else (shape, shape)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        """The input's mask, passed through (to ``y`` and ``h`` with a residual)."""
        return mask if self._spec.residual is None else (mask, mask)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            **_spec_kwargs(self._spec),
            "param_dtype": self._param_dtype,
            "autocast": self._autocast_inputs,
        }


def _affine_step(y: Any, affine: tuple[Any, Any], params: tuple[Any, ...]) -> Any:
    """``y * g + b`` for ``affine = (g, b)`` (either may be None), with the present ones taken
    from ``params`` (the tensors a gradient is taken for)."""
    present = iter(params)
    if affine[0] is not None:
        y = y * next(present)
    if affine[1] is not None:
        y = y + next(present)
    return y


def _gradient_to(value: Any, target: Any) -> Any:
    """``value``, whose gradient goes to ``target`` (a tensor equal to it) instead: under XLA
    a branch then reads ``value``'s inputs (a half input, cast inside the fused pass) rather
    than a float32 copy, while the gradient meets the others at ``target``. ``target`` itself
    on backends other than TensorFlow."""
    if keras.backend.backend() != "tensorflow":
        return target
    import tensorflow as tf

    @tf.custom_gradient  # type: ignore[misc]
    def through(value: Any, target: Any) -> Any:
        def grad(upstream: Any) -> tuple[Any, Any]:
            return None, upstream

        return tf.identity(value), grad

    return through(value, target)


def _recomputed(f: Any) -> Any:
    """``f`` (of tensors) whose backward pass recomputes its values instead of keeping them:
    `keras.remat`, or on TensorFlow a custom gradient that differentiates ``f`` again under a
    tape (``tf.recompute_grad`` fails inside a traced ``cond``)."""
    if keras.backend.backend() != "tensorflow":
        return keras.remat(f)
    import tensorflow as tf

    @tf.custom_gradient  # type: ignore[misc]
    def recomputed(*args: Any) -> Any:
        def grad(*upstream: Any) -> Any:
            # Only the floating arguments are watched: a tape warns of any other (the rows'
            # boolean marks), and they have no gradient.
            floating = [a for a in args if a.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(floating)
                y = f(*args)
            grads = iter(tape.gradient(y, floating, output_gradients=upstream))
            return [next(grads) if a.dtype.is_floating else None for a in args]

        return f(*args), grad

    return recomputed


def _cast_to(u: Any, dtype: str, work: str) -> Any:
    """``u`` cast to ``dtype`` (the policy's cast), then to ``work``; where that rounds, the
    rounding is kept under XLA (`rounded`)."""
    cast = ops.cast(ops.cast(u, dtype), work)
    return cast if keras.backend.standardize_dtype(u.dtype) == dtype else rounded(cast, dtype)


def _float_dtype(dtype: Any) -> str:
    """``dtype`` standardized by Keras, or TypeError unless it is a float normkit supports."""
    name = keras.backend.standardize_dtype(dtype)
    if name not in dtypes.DTYPE_NAMES:
        raise TypeError(
            f"param_dtype={name!r} is invalid: expected one of {sorted(dtypes.DTYPE_NAMES)}"
        )
    return name


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# The type each NormSpec field takes from a layer's constructor (None where the spec resolves a
# default), and its description; a value of the right type is checked by NormSpec.
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "axis": (
        lambda v: _is_int(v) or (isinstance(v, (list, tuple)) and all(map(_is_int, v))),
        "an int or a list/tuple of ints",
    ),
    "eps": (lambda v: v is None or _is_real(v), "a float"),
    "p": (_is_real, "a float"),
    "scale_offset": (_is_real, "a float"),
    "alpha_init": (_is_real, "a float"),
    "scale": (lambda v: isinstance(v, bool), "True or False"),
    "bias": (lambda v: v is None or isinstance(v, bool), "True or False"),
    "residual": (lambda v: v is None or isinstance(v, str), "None or a string"),
    **{
        name: (lambda v: isinstance(v, str), "a string")
        for name in ("eps_placement", "cast", "variance", "offset_dtype", "output_dtype",
                     "backward")
    },
}


def _layer_spec(layer: str, **fields: Any) -> NormSpec:
    """``NormSpec(**fields)`` for the constructor of ``layer``: TypeError naming the argument
    whose value has the wrong type, as Keras' layers raise (``epsilon`` for ``eps``, and
    ``center`` for LayerNorm's ``bias``); NormSpec's ValueError for a wrong value."""
    arguments = {"eps": "epsilon", "bias": "center" if fields["kind"] == "layer" else "bias"}
    for field, value in fields.items():
        if field in _FIELD_TYPES and not _FIELD_TYPES[field][0](value):
            raise TypeError(
                f"{layer}: expected {_FIELD_TYPES[field][1]} for the argument "
                f"'{arguments.get(field, field)}', but received {value!r} of type "
                f"{type(value).__name__}"
            )
    return NormSpec(**fields)


def _spec_kwargs(spec: NormSpec) -> dict[str, Any]:
    """The constructor arguments (JSON-compatible) of the layer that computes ``spec``."""
    kwargs: dict[str, Any] = {"axis": spec.axis[0] if len(spec.axis) == 1 else list(spec.axis)}
    if spec.kind == "dyt":
        kwargs["alpha_init"] = spec.alpha_init
    else:
        kwargs["epsilon"] = spec.eps
        kwargs["eps_placement"] = spec.eps_placement
    # LayerNorm names b's switch as Keras' LayerNormalization does: center.
    kwargs["center" if spec.kind == "layer" else "bias"] = spec.bias
    kwargs.update(
        scale=spec.scale,
        scale_offset=spec.scale_offset,
        cast=spec.cast,
        residual=spec.residual,
        offset_dtype=spec.offset_dtype,
        output_dtype=spec.output_dtype,
        backward=spec.backward,
    )
    if spec.kind == "partial_rms":
        kwargs["p"] = spec.p
    if spec.kind == "layer":
        kwargs["variance"] = spec.variance
    for name in ("gate", "gate_activation", "group_size"):
        if getattr(spec, name) is not None:
            kwargs[name] = getattr(spec, name)
    return kwargs


class _ScaleBias(_Norm):
    """The weights under the names of the constructor's switches: ``scale`` (``w``, as
    ``keras.layers.RMSNormalization``'s) and ``bias`` (``b``)."""

    @property
    def scale(self) -> Any:
        """``w``, the weight ``"scale"`` (None before `build` or with ``scale=False``)."""
        return self.gamma

    @property
    def bias(self) -> Any:
        """``b``, the weight ``"bias"`` (None before `build` or with ``bias=False``)."""
        return self.beta


@keras.saving.register_keras_serializable(package="normkit")
class RMSNorm(_ScaleBias):
    """RMSNorm over ``axis``: ``y = x * r(mean(x**2)) * (scale_offset + w) + b``.

    A drop-in for ``keras.layers.RMSNormalization``: the same arguments (``axis=-1,
    epsilon=1e-6``), the attributes ``axis`` and ``epsilon``, and the weight ``scale`` (``w``;
    also ``gamma``, the name every normkit.tf layer gives it; ``b`` is ``bias`` and ``beta``).

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-6``, as ``keras.layers.RMSNormalization``.
      eps_placement: ``"inside"``: ``r(s) = 1 / sqrt(s + eps)`` (default); ``"outside"``:
        ``r(s) = 1 / (sqrt(s) + eps)``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``False``.
      scale: whether there is a weight ``w`` ("scale", the input's shape over ``axis``,
        initialized to ``1 - scale_offset``). Default ``True``.
      scale_offset: the constant added to ``w``; ``1.0`` is Gemma's ``(1 + w)``. Default ``0.0``.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` rounds once at the end (default);
        ``"before_scale"`` rounds ``y_hat`` to the input dtype before the affine step (Llama).
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``); the layer is then called as
        ``layer(x, residual)`` and returns ``(y, h)``.
      offset_dtype: where ``scale_offset + w`` is computed: ``"float32"`` (default) or
        ``"param"`` (in ``w``'s dtype, then upcast).
      output_dtype: ``"input"`` (default) or ``"promote"``, the promoted dtype of the input
        (after the policy's cast) and the variables.
      backward: ``"exact"`` (default): the gradient of the exact function, rounded once;
        ``"autograd"``: that of the eager program in half precision (Hugging Face Llama).
      gate, gate_activation, group_size: the `NormSpec` fields of the gated and grouped norms
        (default None: no gate, the whole row); a gated layer is called as ``layer(x, gate=z)``.
      param_dtype: the variables' dtype; None (default) takes the policy's variable dtype.
      **kwargs: `keras.layers.Layer` arguments: ``name``, ``dtype`` (policy), ``trainable``,
        ``autocast`` (``False`` keeps a floating input's dtype instead of casting it to the
        policy's compute dtype).

    Examples:
      >>> import numpy as np
      >>> layer = RMSNorm()
      >>> y = layer(np.array([[3.0, 4.0]], dtype="float32"))  # [3, 4] / sqrt(12.5)
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [0.8485, 1.1314]
      >>> [tuple(w.shape) for w in layer.get_weights()]
      [(2,)]
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = RMS_NORM_EPSILON,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        spec = _layer_spec(
            type(self).__name__,
            kind="rms", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward, gate=gate,
            gate_activation=gate_activation, group_size=group_size,
        )
        super().__init__(spec, param_dtype, **kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class PartialRMSNorm(_ScaleBias):
    """Partial RMSNorm over ``axis``: ``y = x * r(mean(x[:k]**2)) * (scale_offset + w) + b``.

    ``x[:k]`` are the first ``k = max(1, floor(n * p))`` of a row's ``n`` normalized elements, in
    row-major order over ``axis``; ``y`` normalizes and scales all ``n``.

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      p: the fraction read by the statistic, ``0 < p <= 1``.
      axis, epsilon, eps_placement, bias, scale, scale_offset, cast, residual, offset_dtype,
        output_dtype, backward, gate, gate_activation, group_size, param_dtype, **kwargs: as in
        `RMSNorm`.
    """

    def __init__(
        self,
        p: float,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = DEFAULT_EPS,
        *,
        eps_placement: EpsPlacement = "inside",
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        spec = _layer_spec(
            type(self).__name__,
            kind="partial_rms", eps=epsilon, eps_placement=eps_placement, p=p, axis=axis,
            scale=scale, scale_offset=scale_offset, bias=bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward, gate=gate,
            gate_activation=gate_activation, group_size=group_size,
        )
        super().__init__(spec, param_dtype, **kwargs)


@keras.saving.register_keras_serializable(package="normkit")
class LayerNorm(_Norm):
    """LayerNorm over ``axis``: ``y = c * r(mean(c**2)) * (scale_offset + w) + b``.

    ``c = x - mean(x)``. A drop-in for ``keras.layers.LayerNormalization``: the same arguments,
    in the same order, with the same defaults (``epsilon=1e-3``), and Keras' attributes
    ``axis``, ``epsilon``, ``center`` and ``scale`` (bools), ``gamma`` (``w``) and ``beta``
    (``b``). ``w`` and ``b`` are stored as the weights ``"scale"`` and ``"bias"``.

    Statistics in float32; the output dtype follows the policy and ``output_dtype`` (see
    docs/tf.md).

    Args:
      axis: the normalized axes, an int or a list of ints (negative count from the end).
        Default ``-1``. Their sizes are fixed by the first call.
      epsilon: ``eps``, positive. Default ``1e-3``, as Keras'.
      center: whether there is a weight ``b`` (Keras' ``beta``). Default ``True``.
      scale: whether there is a weight ``w`` (Keras' ``gamma``). Default ``True``.
      beta_initializer, gamma_initializer: the initializers of ``b`` and ``w``; default
        ``"zeros"`` and ``"ones"``. With a nonzero ``scale_offset`` only ``"ones"`` is
        accepted, and it starts ``w`` at ``1 - scale_offset`` (the effective scale at one).
      beta_regularizer, gamma_regularizer, beta_constraint, gamma_constraint: Keras
        regularizers and constraints of ``b`` and ``w`` (default None).
      rms_scaling: only ``False``; Keras' ``rms_scaling=True`` is refused (it divides by the
        variance, not by the mean square: use `RMSNorm`).
      variance: ``"two_pass"`` (default: ``mean(c**2)``, ``c`` computed first, as Keras'
        LayerNormalization does on TensorFlow and JAX) or ``"fast"`` (``max(0, mean(x**2) -
        mean(x)**2)`` in float32, Flax's default); the gradient is the exact function's either
        way.
      eps_placement, scale_offset, cast, residual, offset_dtype, output_dtype, backward, gate,
        gate_activation, group_size, param_dtype, **kwargs: as in `RMSNorm`.

    Examples:
      >>> import numpy as np
      >>> layer = LayerNorm()
      >>> y = layer(np.array([[1.0, 3.0]], dtype="float32"))  # [-1, 1] / sqrt(1 + 1e-3)
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [-0.9995, 0.9995]
      >>> [tuple(w.shape) for w in (layer.gamma, layer.beta)]
      [(2,), (2,)]
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = LAYER_NORM_EPSILON,
        center: bool = True,
        scale: bool = True,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        *,
        rms_scaling: bool = False,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        cast: Cast = "after_scale",
        variance: Variance = "two_pass",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        gate: Gate | None = None,
        gate_activation: GateActivation | None = None,
        group_size: int | None = None,
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        if rms_scaling:
            raise ValueError(
                "LayerNorm(rms_scaling=True) is refused: Keras' rms_scaling divides x by "
                "sqrt(variance + eps), the variance of x about its mean, not by the root mean "
                "square of x, so it is neither LayerNorm nor RMSNorm (Keras 3.15 deprecates "
                "it); use normkit.tf.RMSNorm, which is keras.layers.RMSNormalization's drop-in"
            )
        spec = _layer_spec(
            type(self).__name__,
            kind="layer", eps=epsilon, eps_placement=eps_placement, axis=axis, scale=scale,
            scale_offset=scale_offset, bias=center, cast=cast, variance=variance,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward, gate=gate, gate_activation=gate_activation,
            group_size=group_size,
        )
        gamma_init = keras.initializers.get(gamma_initializer)
        if scale_offset and not isinstance(gamma_init, keras.initializers.Ones):
            raise ValueError(
                f"LayerNorm: gamma_initializer={gamma_initializer!r} with "
                f"scale_offset={scale_offset}: with an offset only 'ones' is accepted (w then "
                f"starts at 1 - scale_offset, so that scale_offset + w starts at one)"
            )
        super().__init__(spec, param_dtype, **kwargs)
        self.gamma_initializer = gamma_init
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.beta_constraint = keras.constraints.get(beta_constraint)

    @property
    def center(self) -> bool:
        """Whether there is a weight ``b`` (``beta``), as Keras' ``center``."""
        return bool(self._spec.bias)

    @property
    def scale(self) -> bool:
        """Whether there is a weight ``w`` (``gamma``), as Keras' ``scale``."""
        return self._spec.scale

    def _weight_options(self, name: str) -> dict[str, Any]:
        if name == "scale":
            initializer = self.gamma_initializer
            if isinstance(initializer, keras.initializers.Ones):
                initializer = keras.initializers.Constant(self._spec.scale_init)
            return {
                "initializer": initializer,
                "regularizer": self.gamma_regularizer,
                "constraint": self.gamma_constraint,
            }
        return {
            "initializer": self.beta_initializer,
            "regularizer": self.beta_regularizer,
            "constraint": self.beta_constraint,
        }

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "rms_scaling": False,
            "beta_initializer": keras.initializers.serialize(self.beta_initializer),
            "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
            "beta_regularizer": keras.regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": keras.regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": keras.constraints.serialize(self.beta_constraint),
            "gamma_constraint": keras.constraints.serialize(self.gamma_constraint),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LayerNorm:
        """The layer of ``config``; configs saved before ``center`` name it ``bias``."""
        config = dict(config)
        if "bias" in config:
            config["center"] = config.pop("bias")
        return super().from_config(config)  # type: ignore[no-any-return]


@keras.saving.register_keras_serializable(package="normkit")
class DyT(_ScaleBias):
    """Dynamic Tanh over ``axis``: ``y = tanh(alpha * x) * (scale_offset + w) + b``.

    ``alpha`` is a learned scalar (the weight "alpha", shape ``(1,)``, initialized to
    ``alpha_init``); there is no statistic, so no eps. ``tanh`` is computed in float32 (float64
    for a float64 input); the output dtype follows the policy and ``output_dtype``.

    Args:
      alpha_init: the initial ``alpha``, positive. Default ``0.5`` (the DyT paper's; 1.0 in
        x-transformers).
      axis: the axes ``w`` and ``b`` span, an int or a list of ints. Default ``-1``.
      bias: whether there is a weight ``b`` ("bias", zeros). Default ``True``.
      scale, scale_offset, cast, residual, offset_dtype, output_dtype, backward, param_dtype,
        **kwargs: as in `RMSNorm`.

    Examples:
      >>> import numpy as np
      >>> layer = DyT(alpha_init=1.0, bias=False)
      >>> y = layer(np.array([[0.0, 1.0]], dtype="float32"))  # tanh([0, 1])
      >>> [round(float(v), 4) for v in keras.ops.convert_to_numpy(y)[0]]
      [0.0, 0.7616]
      >>> [w.name for w in layer.weights]
      ['alpha', 'scale']
    """

    def __init__(
        self,
        alpha_init: float = DEFAULT_ALPHA_INIT,
        axis: int | list[int] | tuple[int, ...] = -1,
        *,
        scale: bool = True,
        scale_offset: float = 0.0,
        bias: bool = True,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        param_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        spec = _layer_spec(
            type(self).__name__,
            kind="dyt", alpha_init=alpha_init, axis=axis, scale=scale, scale_offset=scale_offset,
            bias=bias, cast=cast, residual=residual, offset_dtype=offset_dtype,
            output_dtype=output_dtype, backward=backward,
        )
        super().__init__(spec, param_dtype, **kwargs)


_LAYERS: dict[str, type[_Norm]] = {
    "rms": RMSNorm,
    "partial_rms": PartialRMSNorm,
    "layer": LayerNorm,
    "dyt": DyT,
}


def from_spec(spec: NormSpec, **kwargs: Any) -> RMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The layer that computes ``spec``; ``kwargs`` go to the layer (``param_dtype``) and to
    `keras.layers.Layer` (``name``, ``dtype``)."""
    if not isinstance(spec, NormSpec):
        raise TypeError(f"from_spec needs a normkit.NormSpec, got {type(spec).__name__}")
    return _LAYERS[spec.kind](**_spec_kwargs(spec), **kwargs)  # type: ignore[return-value]
