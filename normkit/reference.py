"""The numpy reference: what a `NormSpec` computes, forward and backward, in float64.

Everything else in normkit is checked against these two functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from normkit import dtypes
from normkit.spec import NormSpec

__all__ = ["normalize", "normalize_vjp", "scaled_magnitude", "check_params"]


@dataclass(frozen=True)
class _Rows:
    """An array viewed as rows of the normalized elements, and how to put it back."""

    axes: tuple[int, ...]
    moved_shape: tuple[int, ...]

    @classmethod
    def of(cls, shape: tuple[int, ...], spec: NormSpec) -> _Rows:
        axes = spec.resolve_axes(len(shape))
        if any(shape[a] == 0 for a in axes):
            raise ValueError(f"x has shape {shape}: the normalized axes {axes} must not be empty")
        kept = [d for i, d in enumerate(shape) if i not in axes]
        return cls(axes, tuple(kept) + tuple(shape[a] for a in axes))

    @property
    def trailing(self) -> tuple[int, ...]:
        return tuple(range(len(self.moved_shape) - len(self.axes), len(self.moved_shape)))

    def split(self, a: np.ndarray) -> np.ndarray:
        n = int(np.prod(self.moved_shape[len(self.moved_shape) - len(self.axes) :]))
        return np.moveaxis(a, self.axes, self.trailing).reshape(-1, n)

    def join(self, rows: np.ndarray) -> np.ndarray:
        return np.moveaxis(rows.reshape(self.moved_shape), self.trailing, self.axes)


def _check_input(x: npt.ArrayLike, what: str) -> np.ndarray:
    arr = np.asarray(x)
    dtypes.as_float_dtype(arr.dtype, what)
    return arr


def check_params(
    shape: tuple[int, ...],
    spec: NormSpec,
    scale: npt.ArrayLike | None,
    bias: npt.ArrayLike | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The effective scale ``scale_offset + w`` and the bias for an input of ``shape``, float64.

    An absent ``scale`` means its initial value (effective scale 1), an absent ``bias`` zero.
    A parameter the spec does not have, or one of the wrong shape or dtype, raises
    ValueError/TypeError.
    """
    param_shape = spec.param_shape(shape)

    def checked(name: str, value: npt.ArrayLike, present: bool) -> np.ndarray:
        if not present:
            raise ValueError(f"{name} was given but the spec has {name}=False")
        arr = _check_input(value, name)
        if arr.shape != param_shape:
            raise ValueError(
                f"{name} has shape {arr.shape}, expected {param_shape} (the input's shape "
                f"{shape} over axis {spec.axis})"
            )
        return arr.astype(np.float64)

    g = np.ones(param_shape) if scale is None else checked("scale", scale, spec.scale)
    if scale is not None:
        g += spec.scale_offset
    b = np.zeros(param_shape) if bias is None else checked("bias", bias, spec.bias)
    return g, b


@dataclass(frozen=True)
class _Statistic:
    """Per row: the values the statistic centers (x, or x - mean(x)), s, r(s) and dr/ds."""

    centered: np.ndarray
    k: int
    s: np.ndarray
    r: np.ndarray
    dr_ds: np.ndarray


def _statistic(rows: np.ndarray, spec: NormSpec) -> _Statistic:
    n = rows.shape[1]
    k = spec.stat_size(n)
    centered = rows - rows.mean(axis=1, keepdims=True) if spec.kind == "layer" else rows
    s = np.mean(centered[:, :k] ** 2, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if spec.eps_placement == "inside":
            r = 1.0 / np.sqrt(s + spec.eps)
            dr_ds = -0.5 * r**3
        else:
            root = np.sqrt(s)
            r = 1.0 / (root + spec.eps)
            # sqrt is not differentiable at s = 0; there every x_i in the statistic is 0 and
            # the term's limit along any path is bounded, so the reference takes 0.
            dr_ds = np.where(s > 0, -0.5 * r**2 / np.where(s > 0, root, 1.0), 0.0)
    return _Statistic(centered, k, s, r[:, None], dr_ds[:, None])


def normalize(
    x: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
) -> np.ndarray:
    """``spec`` applied to ``x``, computed in float64 and returned in ``x``'s dtype.

    For float16 and bfloat16 inputs the casts of ``spec.cast`` are reproduced exactly: with
    ``"before_scale"`` the normalized value is rounded to the input dtype before the affine
    step, and the output is rounded (to nearest even, once from float64) to the input dtype.

    Args:
      x: float16, bfloat16 (ml_dtypes), float32 or float64 array.
      spec: the norm.
      scale: ``w``, of shape ``spec.param_shape(x.shape)``; None means its initial value.
      bias: ``b``, of the same shape; None means zero.

    Raises ValueError when ``spec.eps`` is out of the range of ``x``'s compute dtype
    (`NormSpec.check_eps`).
    """
    arr = _check_input(x, "x")
    spec.check_eps(arr.dtype.name)
    g, b = check_params(arr.shape, spec, scale, bias)
    layout = _Rows.of(arr.shape, spec)
    stat = _statistic(layout.split(arr.astype(np.float64)), spec)
    normalized = stat.centered * stat.r
    if dtypes.is_half(arr.dtype) and spec.cast == "before_scale":
        normalized = dtypes.round_to(normalized, arr.dtype).astype(np.float64)
    y = normalized * g.reshape(1, -1) + b.reshape(1, -1)
    return dtypes.round_to(layout.join(y), arr.dtype)


def normalize_vjp(
    x: npt.ArrayLike,
    dy: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    r"""The gradients of ``sum(dy * normalize(x, spec, scale, bias))``, analytic, in float64.

    With ``c`` the centered row, ``y_hat = c r(s)``, ``g = scale_offset + w`` and
    ``d = dy * g``::

        dw = sum over rows of dy * y_hat            db = sum over rows of dy
        rms, partial_rms:  dx_i = r d_i + [i < k] (2 x_i / k) r'(s) sum_j d_j x_j
        layer:             dx_i = r (d_i - mean(d)) + (2 c_i / n) r'(s) sum_j d_j c_j

    with ``r'(s) = -r^3 / 2`` (inside) or ``-r^2 / (2 sqrt(s))`` (outside, 0 at s = 0). The
    roundings of the half-precision policy are not differentiated: the gradient is that of the
    exact function. Returns ``(dx, dscale, dbias)``, with None for parameters the spec lacks.
    """
    arr = _check_input(x, "x")
    grad = _check_input(dy, "dy")
    if grad.shape != arr.shape:
        raise ValueError(f"dy has shape {grad.shape}, expected the shape of x, {arr.shape}")
    spec.check_eps(arr.dtype.name)
    g, _ = check_params(arr.shape, spec, scale, bias)
    layout = _Rows.of(arr.shape, spec)
    stat = _statistic(layout.split(arr.astype(np.float64)), spec)
    dy_rows = layout.split(grad.astype(np.float64))
    d = dy_rows * g.reshape(1, -1)
    c = stat.centered
    n = c.shape[1]
    # Where the statistic reads one value (k = 1; LayerNorm rows of two, c = +-delta), the
    # factor r + 2 s r'(s) of that value's own term cancels even in float64; it is taken in
    # its closed form, eps r**3 (inside) or eps r**2 (outside).
    eps_r = spec.eps * stat.r
    own = eps_r * stat.r * (stat.r if spec.eps_placement == "inside" else 1.0)
    if spec.kind == "layer" and n == 2:
        dx = own * (d - d.mean(axis=1, keepdims=True))
    elif spec.kind == "layer":
        dx = stat.r * (d - d.mean(axis=1, keepdims=True))
        dx += (2.0 / n) * c * stat.dr_ds * np.sum(d * c, axis=1, keepdims=True)
    elif stat.k == 1:
        dx = stat.r * d
        others = np.sum(d[:, 1:] * c[:, 1:], axis=1, keepdims=True)
        dx[:, :1] = own * d[:, :1] + 2.0 * c[:, :1] * stat.dr_ds * others
    else:
        dx = stat.r * d
        k = stat.k
        dx[:, :k] += (2.0 / k) * c[:, :k] * stat.dr_ds * np.sum(d * c, axis=1, keepdims=True)
    param_shape = spec.param_shape(arr.shape)
    dscale = np.sum(dy_rows * c * stat.r, axis=0).reshape(param_shape) if spec.scale else None
    dbias = np.sum(dy_rows, axis=0).reshape(param_shape) if spec.bias else None
    return layout.join(dx), dscale, dbias


def scaled_magnitude(
    x: npt.ArrayLike, spec: NormSpec, scale: npt.ArrayLike | None = None
) -> np.ndarray:
    """``|y_hat * (scale_offset + w)|`` in float64: the size of the term that ``cast="before_scale"``
    rounds at (see `normkit.tolerances`)."""
    arr = _check_input(x, "x")
    return np.abs(normalize(arr.astype(np.float64), spec.replace(bias=False), scale))
