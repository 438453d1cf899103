"""The rows of one input as normkit.tf's programs see them, and the row math those programs
share, each written once: ``r(s)``, the statistic's mean of squares, the guard that marks rows
for rescaling, the closed-form backward of `normkit.reference.normalize_vjp`, the parameters'
gradients and the affine step.

The plain program (`normkit.tf._plain`) and the guarded one (`normkit.tf._careful`) compute
with these; the layers (`normkit.tf.layers`) choose between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from keras import ops

from normkit.spec import NormSpec
from normkit.tf import _ops

__all__ = ["Rows", "affine_step", "r_of"]


def r_of(
    s: Any,
    eps: Any,
    outside: bool,
    root: Any = None,
    floor: Callable[[Any], Any] | None = None,
) -> Any:
    """``r(s) = 1 / sqrt(s + eps)`` (eps inside) or ``1 / (sqrt(s) + eps)`` (outside), where
    ``root`` stands for ``sqrt(s)`` when the caller forms it itself. ``floor`` bounds the
    denominator's ``s + eps`` (inside) or ``sqrt(s) + eps`` (outside) from below: a guard's
    clamp, which changes only rows the guarded program replaces."""
    if outside:
        total = (ops.sqrt(s) if root is None else root) + eps
        return 1.0 / (total if floor is None else floor(total))
    total = s + eps
    return ops.rsqrt(total if floor is None else floor(total))


def affine_step(y: Any, affine: tuple[Any, Any], params: tuple[Any, ...]) -> Any:
    """``y * g + b`` for ``affine = (g, b)`` (either may be None), with the present ones taken
    from ``params`` (the tensors a gradient is taken for)."""
    present = iter(params)
    if affine[0] is not None:
        y = y * next(present)
    if affine[1] is not None:
        y = y + next(present)
    return y


class Rows:
    """The layout of one input's rows (normalized ``axes``, a parameter's broadcast ``target``
    shape, ``n`` elements of which the statistic reads the first ``k``, marked by ``head``), the
    ``work`` dtype, and the bounds of the guards.

    Rows whose ``r(s)`` falls outside ``[1/bound, bound]`` (or is NaN on a finite row), and
    with eps outside rows whose ``s`` lies below `small`, are recomputed in scaled units
    (`normkit.tf._careful.rescaled`), where neither ``s`` nor the derivatives autodiff forms
    (``r**3``, and ``x_i / sqrt(s)`` outside) leave the dtype's range; ordinary rows skip that
    branch.
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
        # differentiated through Keras' operations (`_plain.keras_output`), unless told
        # otherwise.
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
        # r**3 stays finite, so its gradient does (see `_careful.bounded`).
        self.clip_r = scalar(2.0 ** (1.25 * exponent))
        self.maximum = _ops.maximum if work == "float64" else ops.maximum

    def in_head(self, u: Any) -> Any:
        """``u`` on the first k elements of each row, 0 after them (``u`` where k = n)."""
        return u if self.head is None else ops.where(self.head, u, ops.zeros_like(u))

    def mean_square(self, c: Any, sliced: bool = False) -> Any:
        """``s``: the mean of ``c**2`` over the row, or over its first k elements only. The
        elements after the first k are masked before squaring (a NaN, an inf or a 1e20 there
        must not enter s, nor its gradient), or, ``sliced`` over the last axis, left out."""
        if self.head is None:
            return _ops.mean(ops.square(c), self.axes)
        if sliced and self.axes == (len(self.target) - 1,):
            return _ops.mean(ops.square(c[..., : self.k]), self.axes)
        return ops.sum(ops.square(self.in_head(c)), axis=self.axes, keepdims=True) / self.k

    def needs_rescaling(self, s: Any, r: Any) -> Any:
        """Per row, whether the guarded program must rescale it: ``r`` outside
        ``[1/bound, bound]`` or NaN, or with eps outside ``s`` below `small` (zero rows
        included: their squares may have underflowed)."""
        bad = ops.logical_not(ops.logical_and(r >= 1 / self.bound, r <= self.bound))
        return ops.logical_or(bad, s < self.small) if self.outside else bad

    def statistic_share(self, d: Any, u: Any, ratio: Any = None) -> Any:
        """``A / k`` of the closed-form backward (`input_grad`): ``A = ratio sum(d u)`` over the
        row, ``u = -2 r'(s) c / r**2``, which is ``y_hat`` times ``ratio`` (1 inside, None for
        1; ``1 + eps / sqrt(s)`` outside)."""
        total = ops.sum(d * u, axis=self.axes, keepdims=True)
        return total * (1 / self.k) if ratio is None else total * ratio * (1 / self.k)

    def input_grad(self, d: Any, y_hat: Any, r: Any, share: Any, d_mean: Any = None) -> Any:
        """The closed-form backward of `normkit.reference.normalize_vjp` for ``d = dy * scale``
        and ``share = A / k`` (`statistic_share`): ``dx = r (d - [i < k] y_hat A / k)`` (RMS
        kinds), or with ``d_mean = mean(d)`` ``r (d - mean(d) - y_hat A / n)`` (LayerNorm)."""
        inner = d if d_mean is None else d - d_mean
        return r * (inner - self.head_share(y_hat, share))

    def head_share(self, y_hat: Any, share: Any) -> Any:
        """``[i < k] y_hat share``: the statistic's share of ``dx / r``, on the first k
        elements only. The mask comes last, so that a NaN or infinite ``share`` (a NaN in the
        tail enters the row's sum) stays out of the tail, as in the reference."""
        return self.in_head(y_hat * share)

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
