"""The numpy reference: what a `NormSpec` computes, forward and backward, in float64.

Everything else in normkit is checked against these functions: `normalize` and `normalize_vjp`,
`add_normalize` and `add_normalize_vjp` for the specs with a residual, and `gated_normalize` and
`gated_normalize_vjp` for the specs with a gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from normkit import _dyt, dtypes
from normkit.spec import NormSpec

__all__ = [
    "AddDytGrads",
    "AddNormGrads",
    "DytGrads",
    "GatedNormGrads",
    "NormGrads",
    "add_normalize",
    "add_normalize_vjp",
    "check_params",
    "gated_normalize",
    "gated_normalize_vjp",
    "normalize",
    "normalize_vjp",
    "output_dtype",
    "scaled_magnitude",
]


class NormGrads(NamedTuple):
    """`normalize_vjp` of a normalization kind: ``(dx, dscale, dbias)``."""

    dx: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None


class DytGrads(NamedTuple):
    """`normalize_vjp` of ``kind="dyt"``: ``(dx, dscale, dbias, dalpha)``."""

    dx: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None
    dalpha: np.ndarray


class AddNormGrads(NamedTuple):
    """`add_normalize_vjp` of a normalization kind: ``(dx, dresidual, dscale, dbias)``."""

    dx: np.ndarray
    dresidual: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None


class AddDytGrads(NamedTuple):
    """`add_normalize_vjp` of ``kind="dyt"``: ``(dx, dresidual, dscale, dbias, dalpha)``."""

    dx: np.ndarray
    dresidual: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None
    dalpha: np.ndarray


class GatedNormGrads(NamedTuple):
    """`gated_normalize_vjp`: ``(dx, dgate, dscale, dbias)``."""

    dx: np.ndarray
    dgate: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None


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
    With ``offset_dtype="param"`` the sum is rounded to ``scale``'s dtype.
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
        if spec.offset_dtype == "param":
            g = dtypes.round_to(g, np.asarray(scale).dtype).astype(np.float64)
    b = np.zeros(param_shape) if bias is None else checked("bias", bias, spec.bias)
    return g, b


def _check_mask(mask: npt.ArrayLike, shape: tuple[int, ...], spec: NormSpec) -> np.ndarray:
    """``mask`` as booleans of ``shape`` (nonzero values mean True, as in Flax)."""
    spec.check_maskable()
    arr = np.asarray(mask)
    if arr.dtype != np.bool_ and not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"mask has dtype {arr.dtype}; expected bool or numbers (nonzero: True)")
    try:
        return np.broadcast_to(arr != 0, shape)
    except ValueError:
        raise ValueError(
            f"mask has shape {arr.shape}, which does not broadcast to x's shape {shape}"
        ) from None


def _reads(rows: np.ndarray, spec: NormSpec, mask: np.ndarray | None) -> np.ndarray:
    """Per row, the elements the statistic reads: ``mask``, or the first ``spec.stat_size(n)``
    (all of them but for partial RMS)."""
    if mask is not None:
        return mask
    n = rows.shape[1]
    return np.broadcast_to(np.arange(n) < spec.stat_size(n), rows.shape)


def _mean(values: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """Per row (keepdims), the mean of ``values`` over the elements ``reads`` marks; NaN for a
    row that marks none (0 / 0). Unmarked elements are not read, NaN or not."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sum(values, axis=1, keepdims=True, where=reads) / reads.sum(1, keepdims=True)


@dataclass(frozen=True)
class _Statistic:
    """Per row: the values the statistic centers (x, or x - mean(x)), the elements it reads and
    their count K, s and r(s) (of shape (rows, 1)), and per element ``c_i r'(s)``."""

    centered: np.ndarray
    reads: np.ndarray
    count: np.ndarray
    s: np.ndarray
    r: np.ndarray
    slope: np.ndarray


def _statistic(
    rows: np.ndarray,
    spec: NormSpec,
    reads: np.ndarray,
    moments: tuple[np.ndarray, np.ndarray] | None = None,
) -> _Statistic:
    """The exact statistic over the elements ``reads`` marks (LayerNorm's mean over them too),
    or the given ``(centered, s)`` (those of ``variance="fast"``)."""
    assert spec.eps is not None, "a normalization kind has an eps"
    if moments is None:
        centered = rows - _mean(rows, reads) if spec.kind == "layer" else rows
        with np.errstate(over="ignore"):
            s = _mean(centered**2, reads)
        overflowed = np.isinf(s) & np.isfinite(np.where(reads, centered, 0.0)).all(1, keepdims=True)
        if overflowed.any():
            row = int(np.argmax(overflowed[:, 0]))
            raise ValueError(
                f"the reference does not compute row {row}: finite values whose mean square "
                "overflows float64 (magnitudes above about 1e154, float64 inputs only)"
            )
    else:
        centered, s = moments
    with np.errstate(divide="ignore", invalid="ignore"):
        if spec.eps_placement == "inside":
            r = 1.0 / np.sqrt(s + spec.eps)
            slope = -0.5 * r**3 * centered
        else:
            r = 1.0 / (np.sqrt(s) + spec.eps)
            slope = -0.5 * r**2 * _over_root(centered, reads, s)
    return _Statistic(centered, reads, reads.sum(axis=1, keepdims=True), s, r, slope)


def _over_root(centered: np.ndarray, reads: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``c_i / sqrt(s)``, the factor of eps outside's ``c_i r'(s) = -r^2 c_i / (2 sqrt(s))``.

    It is scale-free (at most sqrt(K) on the elements read), so a row whose ``s`` is too small
    for float64 (its squares underflow, even to 0) takes it from the row divided by its largest
    magnitude over those elements. sqrt is not differentiable at s = 0; there every c_i read is
    0 and the term's limit along any path is bounded, so the reference takes 0.
    """
    tiny = s < np.finfo(np.float64).tiny / np.finfo(np.float64).eps
    largest = np.max(np.abs(centered), axis=1, keepdims=True, where=reads, initial=0.0)
    unit = np.where(tiny & (largest > 0), largest, 1.0)
    scaled = np.where(reads, centered, 0.0) / unit
    s_scaled = np.where(tiny, _mean(scaled**2, reads), s)
    positive = s_scaled > 0
    return np.where(positive, scaled / np.sqrt(np.where(positive, s_scaled, 1.0)), 0.0)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a spec computes in for inputs of ``dtype``: float32, or float64 for float64."""
    return dtypes.float64 if dtype == dtypes.float64 else dtypes.float32


def _fast_moments(
    rows: np.ndarray, dtype: np.dtype, reads: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``variance="fast"``: ``(x - m1, v)`` with ``c`` the compute dtype of ``dtype`` and

        m1 = c(mean(x))    m2 = c(mean(c(x_i^2)))    v = max(0, c(m2 - c(m1^2)))

    where ``c(.)`` rounds to ``c`` once and the means, over the elements ``reads`` marks, are
    taken in float64 (the ideal of the float32 reduction: an implementation's summation order
    adds its own error). ``max`` keeps a NaN (a row that reads nothing).
    """
    c = _compute_dtype(dtype)

    def rounded(values: np.ndarray) -> np.ndarray:
        return dtypes.round_to(values, c).astype(np.float64)

    m1 = rounded(_mean(rows, reads))
    m2 = rounded(_mean(rounded(rows**2), reads))
    v = np.maximum(0.0, rounded(m2 - rounded(m1 * m1)))
    return rows - m1, v


def _promote(*kinds: np.dtype) -> np.dtype:
    """The promoted dtype of float dtypes: the widest; float16 with bfloat16 gives float32."""
    present = set(kinds)
    if dtypes.float64 in present:
        return dtypes.float64
    if dtypes.float32 in present or len(present) > 1:
        return dtypes.float32
    return kinds[0]


@dataclass(frozen=True)
class _Params:
    """The checked parameters in float64 (``g`` the effective scale) and their dtypes."""

    g: np.ndarray
    b: np.ndarray
    alpha: np.ndarray
    scale_dtype: np.dtype | None
    bias_dtype: np.dtype | None
    alpha_dtype: np.dtype | None

    def given_dtypes(self) -> tuple[np.dtype, ...]:
        found = (self.scale_dtype, self.bias_dtype, self.alpha_dtype)
        return tuple(d for d in found if d is not None)


def _check_alpha(spec: NormSpec, alpha: npt.ArrayLike | None) -> tuple[np.ndarray, np.dtype | None]:
    if spec.kind != "dyt":
        if alpha is not None:
            raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
        return np.zeros(()), None
    if alpha is None:
        assert spec.alpha_init is not None
        return np.asarray(spec.alpha_init, dtype=np.float64), None
    arr = _check_input(alpha, "alpha")
    if arr.shape not in ((), (1,)):
        raise ValueError(f"alpha has shape {arr.shape}, expected a scalar (shape () or (1,))")
    return arr.astype(np.float64), arr.dtype


def _params(
    shape: tuple[int, ...],
    spec: NormSpec,
    scale: npt.ArrayLike | None,
    bias: npt.ArrayLike | None,
    alpha: npt.ArrayLike | None,
) -> _Params:
    g, b = check_params(shape, spec, scale, bias)
    a, alpha_dtype = _check_alpha(spec, alpha)
    return _Params(
        g,
        b,
        a,
        None if scale is None else np.asarray(scale).dtype,
        None if bias is None else np.asarray(bias).dtype,
        alpha_dtype,
    )


def output_dtype(
    dtype: npt.DTypeLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
) -> np.dtype:
    """The dtype of ``normalize``'s output for an input of ``dtype`` and these parameters.

    ``output_dtype="input"``: ``dtype``. ``"promote"``: the promoted dtype of ``dtype`` and the
    dtypes of the parameters given (absent ones take no part): the widest, with float16 and
    bfloat16 together promoting to float32.
    """
    resolved = dtypes.as_float_dtype(dtype, "x")
    if spec.output_dtype == "input":
        return resolved
    given = (v for v in (scale, bias, alpha) if v is not None)
    return _promote(resolved, *(dtypes.as_float_dtype(np.asarray(v).dtype) for v in given))


def _refuse_residual(spec: NormSpec, who: str) -> None:
    if spec.residual is not None:
        raise ValueError(
            f"{who}: the spec has residual={spec.residual!r}, which describes an add and norm; "
            "use add_normalize / add_normalize_vjp"
        )


def _refuse_gate(spec: NormSpec, who: str) -> None:
    if spec.gate is not None:
        raise ValueError(
            f"{who}: the spec has gate={spec.gate!r}, a norm of x and a gate z; use "
            "gated_normalize / gated_normalize_vjp"
        )


def _check_gate(
    gate: npt.ArrayLike, shape: tuple[int, ...], spec: NormSpec, who: str
) -> np.ndarray:
    """The gate ``z`` in float64, for a spec with a gate; ValueError/TypeError otherwise."""
    if spec.gate is None:
        raise ValueError(
            f"{who} needs a spec with a gate ('before' or 'after'), got gate=None; use normalize "
            "/ normalize_vjp"
        )
    arr = _check_input(gate, "gate")
    if arr.shape != shape:
        raise ValueError(f"gate has shape {arr.shape}, expected the shape of x, {shape}")
    return arr.astype(np.float64)


def _activation(z: np.ndarray, spec: NormSpec) -> tuple[np.ndarray, np.ndarray]:
    """``a(z)`` and ``a'(z)`` in float64 for ``spec.gate_activation``::

        sigmoid(z) = 1 / (1 + e^-z)     sigmoid' = sigmoid(z) sigmoid(-z)
        silu(z) = z sigmoid(z)          silu' = sigmoid(z) (1 + z sigmoid(-z))

    with ``sigmoid(z)`` and ``sigmoid(-z)`` both taken from ``e^-|z|`` (no overflow, no
    cancellation in ``1 - sigmoid(z)``).
    """
    e = np.exp(-np.abs(z))
    positive = z >= 0
    sig = np.where(positive, 1.0, e) / (1.0 + e)
    sig_neg = np.where(positive, e, 1.0) / (1.0 + e)
    if spec.gate_activation == "sigmoid":
        return sig, sig * sig_neg
    return z * sig, sig * (1.0 + z * sig_neg)


def _grouped(rows: np.ndarray, spec: NormSpec) -> np.ndarray:
    """Rows of ``n`` as rows of ``group_size``, one per group (unchanged without groups);
    ValueError unless ``group_size`` divides ``n``."""
    groups = spec.group_count(rows.shape[1])
    return rows.reshape(rows.shape[0] * groups, rows.shape[1] // groups)


def _normalized_rows(
    rows: np.ndarray,
    spec: NormSpec,
    dtype: np.dtype,
    alpha: np.ndarray,
    exact: bool,
    mask: np.ndarray | None,
) -> tuple[np.ndarray, _Statistic | None]:
    """``y_hat`` per row (and the statistic, per group with ``group_size``), for inputs of
    ``dtype``; ``exact`` ignores the roundings of ``variance="fast"`` (the gradient is that of
    the exact function). ``mask`` (rows of booleans, or None; never with groups) restricts the
    elements the statistic reads."""
    if spec.kind == "dyt":
        return np.tanh(float(alpha.reshape(())) * rows), None
    groups = _grouped(rows, spec)
    reads = _reads(groups, spec, mask)
    fast = spec.variance == "fast" and not exact
    stat = _statistic(groups, spec, reads, _fast_moments(groups, dtype, reads) if fast else None)
    return (stat.centered * stat.r).reshape(rows.shape), stat


def _forward(
    values: np.ndarray,
    dtype: np.dtype,
    out: np.dtype,
    spec: NormSpec,
    p: _Params,
    mask: np.ndarray | None = None,
    gate: np.ndarray | None = None,
) -> np.ndarray:
    """The spec on float64 ``values`` with the dtype policy of inputs of ``dtype``, in ``out``;
    ``mask``, of ``values``' shape, restricts the statistic; ``gate`` is ``z`` (float64, of
    ``values``' shape) for a gated spec."""
    layout = _Rows.of(values.shape, spec)
    mask_rows = None if mask is None else layout.split(mask)
    rows = layout.split(values)
    act = None if gate is None else _activation(layout.split(gate), spec)[0]
    if spec.gate == "before":
        rows = rows * act
    normalized, _ = _normalized_rows(rows, spec, dtype, p.alpha, exact=False, mask=mask_rows)
    before_scale = dtypes.is_half(dtype) and spec.cast == "before_scale"
    if before_scale:
        normalized = dtypes.round_to(normalized, dtype).astype(np.float64)
    y = normalized * p.g.reshape(1, -1) + p.b.reshape(1, -1)
    if spec.gate == "after":
        if before_scale:
            y = _round_half(y, _affine_dtype(dtype, spec, p))
        y = y * act
    return dtypes.round_to(layout.join(y), out)


def normalize(
    x: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
    *,
    mask: npt.ArrayLike | None = None,
) -> np.ndarray:
    """``spec`` applied to ``x``, computed in float64 and returned in the output dtype.

    For float16 and bfloat16 inputs the casts of ``spec.cast`` are reproduced exactly: with
    ``"before_scale"`` the normalized value is rounded to the input dtype before the affine
    step, and the output is rounded (to nearest even, once from float64) to the output dtype
    (`output_dtype`: ``x``'s, or the promoted one). ``variance="fast"`` reproduces its roundings
    (see `NormSpec`); ``offset_dtype="param"`` rounds ``scale_offset + w`` to ``scale``'s dtype.
    With ``group_size`` each group of ``group_size`` consecutive elements of a row has its own
    statistic. A spec with a gate goes to `gated_normalize`.

    Args:
      x: float16, bfloat16 (ml_dtypes), float32 or float64 array.
      spec: the norm; one with a ``residual`` goes to `add_normalize` instead.
      scale: ``w``, of shape ``spec.param_shape(x.shape)``; None means its initial value.
      bias: ``b``, of the same shape; None means zero.
      alpha: DyT's ``alpha``, a scalar (shape ``()`` or ``(1,)``); None means
        ``spec.alpha_init``. Only for ``kind="dyt"``.
      mask: Flax's call-time ``mask``, for ``kind="rms"`` and ``"layer"``: a bool (or numeric,
        nonzero meaning True) array broadcastable to ``x``. The statistic of a row reads only
        its K elements where ``mask`` is True: with ``mean_m(v) = sum_{mask} v / K``, ``s =
        mean_m(x^2)`` (RMS) or ``mean_m((x - mean_m(x))^2)`` (LayerNorm; ``variance="fast"``:
        ``max(0, mean_m(x^2) - mean_m(x)^2)`` with its roundings). Every element, masked in or
        out, is then normalized with that statistic and gets the affine step; masked-out values
        never reach the statistic (they may be NaN). A row with no element masked in (K = 0)
        is NaN throughout. None: every element is read.

    Examples:
      >>> import numpy as np
      >>> from normkit import NormSpec
      >>> normalize(np.array([[3.0, 4.0]]), NormSpec("rms")).round(4)  # [3, 4] / sqrt(12.5)
      array([[0.8485, 1.1314]])
      >>> normalize(np.array([[1.0, 3.0]]), NormSpec("layer"), [2.0, 2.0], [0.5, 0.5]).round(4)
      array([[-1.5,  2.5]])

    Raises ValueError when ``spec.eps`` is out of the range of ``x``'s compute dtype
    (`NormSpec.check_eps`), ``group_size`` does not divide the normalized size
    (`NormSpec.group_count`), or ``mask`` is given for another kind or spec with a gate or
    groups, or does not broadcast to ``x``; TypeError when ``mask`` is neither bool nor numeric.
    """
    arr = _check_input(x, "x")
    spec.check_eps(arr.dtype.name)
    _refuse_residual(spec, "normalize")
    _refuse_gate(spec, "normalize")
    p = _params(arr.shape, spec, scale, bias, alpha)
    m = None if mask is None else _check_mask(mask, arr.shape, spec)
    out = output_dtype(arr.dtype, spec, scale, bias, alpha)
    return _forward(arr.astype(np.float64), arr.dtype, out, spec, p, m)


def _round_half(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` rounded to ``dtype`` if it is a half dtype (float64 result); else unchanged.

    For sums: a float32 reduction's rounding depends on its order, so it is not modelled."""
    if not dtypes.is_half(dtype):
        return values
    return dtypes.round_to(values, dtype).astype(np.float64)


def _round_product(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Elementwise products rounded to ``dtype`` (float64 result), float32 included: an IEEE
    product is rounded once, whatever the order of evaluation."""
    return dtypes.round_to(values, dtype).astype(np.float64)


def _affine_dtype(dtype: np.dtype, spec: NormSpec, p: _Params) -> np.dtype:
    """The dtype of the eager program's affine step: that of ``y_hat`` (the input's, after the
    before-scale cast) promoted with the effective scale's and the bias's."""
    kinds = [dtype]
    if p.scale_dtype is not None:
        in_own_dtype = spec.offset_dtype == "param" or spec.scale_offset == 0
        kinds.append(p.scale_dtype if in_own_dtype else _promote(dtypes.float32, p.scale_dtype))
    if p.bias_dtype is not None:
        kinds.append(p.bias_dtype)
    return _promote(*kinds)


@dataclass(frozen=True)
class _RawGrads:
    """Float64 gradients before the final rounding to each array's dtype."""

    dx: np.ndarray
    dscale: np.ndarray | None
    dbias: np.ndarray | None
    dalpha: np.ndarray
    dgate: np.ndarray | None = None


def _grads(
    values: np.ndarray,
    dtype: np.dtype,
    dy: np.ndarray,
    spec: NormSpec,
    p: _Params,
    mask: np.ndarray | None = None,
    gate: np.ndarray | None = None,
) -> _RawGrads:
    r"""The VJP at float64 ``values`` with the dtype policy of inputs of ``dtype``.

    ``backward="autograd"`` with a half input and ``cast="before_scale"`` rounds as autograd
    through the eager forward does, ``a`` being `_affine_dtype` and ``z`` the rounded ``y_hat``:
    ``dz = t(a(dy g))``, ``dscale = a(sum_rows a(dy z))``, ``dbias = a(sum_rows dy)``, where
    ``t(.)`` and ``a(.)`` round to the input and the affine dtype: products always, sums only to
    a half dtype (a float32 sum's rounding depends on its order). ``mask`` and ``gate`` as in
    `_forward`; the gradient of ``gate`` is ``dgate``.
    """
    layout = _Rows.of(values.shape, spec)
    rows = layout.split(values)
    dy_rows = layout.split(dy)
    g = p.g.reshape(1, -1)
    mask_rows = None if mask is None else layout.split(mask)
    act, act_slope = (None, None) if gate is None else _activation(layout.split(gate), spec)
    gated = rows * act if spec.gate == "before" else rows
    normalized, stat = _normalized_rows(gated, spec, dtype, p.alpha, exact=True, mask=mask_rows)
    dgate = None
    if spec.gate == "after":  # y = u a(z), u the affine result
        dgate = dy_rows * (normalized * g + p.b.reshape(1, -1)) * act_slope
        dy_rows = dy_rows * act
    autograd = (
        spec.backward == "autograd" and dtypes.is_half(dtype) and spec.cast == "before_scale"
    )
    if autograd:
        a = _affine_dtype(dtype, spec, p)
        z = _round_half(normalized, dtype)
        d = _round_half(_round_product(dy_rows * g, a), dtype)
        dscale = _round_half(np.sum(_round_product(dy_rows * z, a), axis=0), a)
        dbias = _round_half(np.sum(dy_rows, axis=0), a)
    else:
        d = dy_rows * g
        dscale = np.sum(dy_rows * normalized, axis=0)
        dbias = np.sum(dy_rows, axis=0)
    if stat is None:  # dyt: y_hat = tanh(alpha x), whose slope is sech(alpha x)^2
        slope, unit = _dyt.tanh_slope(float(p.alpha.reshape(())) * rows, np, wide=True)
        slope = slope * unit
        dx = float(p.alpha.reshape(())) * slope * d
        dalpha = np.asarray(np.sum(d * rows * slope)).reshape(p.alpha.shape)
    else:
        dx = _input_grad(stat, _grouped(d, spec), spec).reshape(rows.shape)
        dalpha = np.zeros(())
    if spec.gate == "before":  # the norm's input is x a(z)
        dgate = dx * rows * act_slope
        dx = dx * act
    param_shape = spec.param_shape(values.shape)
    return _RawGrads(
        layout.join(dx),
        dscale.reshape(param_shape) if spec.scale else None,
        dbias.reshape(param_shape) if spec.bias else None,
        dalpha,
        None if dgate is None else layout.join(dgate),
    )


def _input_grad(stat: _Statistic, d: np.ndarray, spec: NormSpec) -> np.ndarray:
    r"""``dx`` for ``d = dy g`` (`normalize_vjp`), the statistic reading the K elements R::

        dx_i = r d_i + [i in R] ((2 c_i / K) r'(s) sum_j d_j c_j - [layer] (r / K) sum_j d_j)

    (sums over the whole row: every output depends on the statistic). Where R holds one value
    (RMS kinds, K = 1) or two (LayerNorm, c = +-delta), the part of the sums over R cancels
    even in float64, to ``own (d_i - [layer] mean_R(d))`` with ``own = r + 2 s r'(s)``, taken
    in its closed form ``eps r**3`` (inside) or ``eps r**2`` (outside); the part over the other
    elements is added as it is.
    """
    assert spec.eps is not None
    c, reads, k, r, slope = stat.centered, stat.reads, stat.count, stat.r, stat.slope
    layer = spec.kind == "layer"

    def total(values: np.ndarray, where: np.ndarray | bool = True) -> np.ndarray:
        return np.sum(values, axis=1, keepdims=True, where=where)

    with np.errstate(divide="ignore", invalid="ignore"):
        general = 2.0 / k * slope * total(d * c) - (r / k * total(d) if layer else 0.0)
        own = spec.eps * r * r * (r if spec.eps_placement == "inside" else 1.0)
        others = 2.0 / k * slope * total(d * c, ~reads)
        if layer:
            others -= r / k * total(d, ~reads)
        closed = own * (d - (total(d, reads) / k if layer else 0.0)) + others
        degenerate = k == (2 if layer else 1)
        return np.where(reads, np.where(degenerate, closed, r * d + general), r * d)


def _param_grads(
    raw: _RawGrads, spec: NormSpec, p: _Params
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """The parameters' gradients: float64 (``backward="exact"``) or rounded to the parameters'
    dtypes (``"autograd"``; float32 for an absent parameter)."""
    if spec.backward == "exact":
        return raw.dscale, raw.dbias, raw.dalpha

    def rounded(v: np.ndarray | None, dtype: np.dtype | None) -> np.ndarray | None:
        return None if v is None else dtypes.round_to(v, dtype or dtypes.float32)

    dalpha = rounded(raw.dalpha, p.alpha_dtype)
    assert dalpha is not None
    return rounded(raw.dscale, p.scale_dtype), rounded(raw.dbias, p.bias_dtype), dalpha


def _check_grad(value: npt.ArrayLike, name: str, shape: tuple[int, ...]) -> np.ndarray:
    arr = _check_input(value, name)
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected the shape of x, {shape}")
    return arr.astype(np.float64)


def normalize_vjp(
    x: npt.ArrayLike,
    dy: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
    *,
    mask: npt.ArrayLike | None = None,
) -> NormGrads | DytGrads:
    r"""The gradients of ``sum(dy * normalize(x, spec, scale, bias, alpha))``, analytic.

    With ``c`` the centered row, ``y_hat = c r(s)``, ``g = scale_offset + w`` and
    ``d = dy * g``::

        dw = sum over rows of dy * y_hat            db = sum over rows of dy
        rms, partial_rms:  dx_i = r d_i + [i < k] (2 x_i / k) r'(s) sum_j d_j x_j
        layer:             dx_i = r (d_i - mean(d)) + (2 c_i / n) r'(s) sum_j d_j c_j
        dyt:               dx_i = alpha (1 - y_hat_i^2) d_i
                           dalpha = sum over all elements of x_i (1 - y_hat_i^2) d_i

    with ``1 - y_hat^2 = sech(alpha x)^2`` taken as ``4 e^-2|u| / (1 + e^-2|u|)^2``
    (`normkit._dyt`: the difference loses its digits where |alpha x| is large).

    with ``r'(s) = -r^3 / 2`` (inside) or ``-r^2 / (2 sqrt(s))`` (outside, 0 at s = 0).
    With a ``mask`` (`normalize`'s) the statistic reads the K masked-in elements R: ``k`` is K
    and ``[i < k]`` is ``[i in R]`` in the RMS line, and LayerNorm's is
    ``dx_i = r d_i + [i in R] ((2 c_i / K) r'(s) sum_j d_j c_j - (r / K) sum_j d_j)``, the sums
    over the whole row; a row with K = 0 has NaN gradients. With ``group_size`` each group is
    a row of its own in these formulas (``n`` the group size, the sums over the group).

    ``backward="exact"`` (default): the roundings of the half-precision policy are not
    differentiated (``variance="fast"`` has the gradient of ``"two_pass"``); the gradients are
    those of the exact function, in float64. ``backward="autograd"``: with a half input and
    ``cast="before_scale"``, ``d`` is rounded as autograd rounds it (see `NormSpec`), and the
    scale's gradient is summed from products rounded to the affine step's dtype; every gradient
    is returned rounded to its array's dtype (``x``'s, the parameters'; float32 for an absent
    parameter).

    Returns `NormGrads` ``(dx, dscale, dbias)`` for the normalization kinds, as before DyT, and
    `DytGrads` ``(dx, dscale, dbias, dalpha)`` for ``kind="dyt"`` (``dalpha`` of ``alpha``'s
    shape, ``()`` when it is None); None for parameters the spec lacks.
    """
    arr = _check_input(x, "x")
    grad = _check_grad(dy, "dy", arr.shape)
    spec.check_eps(arr.dtype.name)
    _refuse_residual(spec, "normalize_vjp")
    _refuse_gate(spec, "normalize_vjp")
    p = _params(arr.shape, spec, scale, bias, alpha)
    m = None if mask is None else _check_mask(mask, arr.shape, spec)
    raw = _grads(arr.astype(np.float64), arr.dtype, grad, spec, p, m)
    dx = raw.dx if spec.backward == "exact" else dtypes.round_to(raw.dx, arr.dtype)
    dscale, dbias, dalpha = _param_grads(raw, spec, p)
    if spec.kind == "dyt":
        return DytGrads(dx, dscale, dbias, dalpha)
    return NormGrads(dx, dscale, dbias)


@dataclass(frozen=True)
class _Sum:
    """``x + residual`` as a spec with a residual rounds it: the values the norm reads, ``h``."""

    normalized: np.ndarray
    h: np.ndarray


def _add(x: np.ndarray, residual: np.ndarray, spec: NormSpec) -> _Sum:
    if spec.residual is None:
        raise ValueError(
            "add_normalize needs a spec with a residual rounding (residual='rounded', "
            "'float32' or 'float32_normalized'), got residual=None"
        )
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {residual.shape}, expected the shape of x, {x.shape}")
    c = _compute_dtype(x.dtype)
    allowed = {x.dtype, c} if spec.residual == "float32" else {x.dtype}
    if residual.dtype not in allowed:
        names = " or ".join(sorted(d.name for d in allowed))
        raise TypeError(
            f"residual has dtype {residual.dtype.name}; residual={spec.residual!r} with x of "
            f"dtype {x.dtype.name} needs {names}"
        )
    exact = x.astype(np.float64) + residual.astype(np.float64)
    if spec.residual == "rounded":
        h = dtypes.round_to(exact, x.dtype)
        return _Sum(h.astype(np.float64), h)
    kept = dtypes.round_to(exact, c)
    h = kept if spec.residual == "float32" else dtypes.round_to(kept, x.dtype)
    return _Sum(kept.astype(np.float64), h)


def add_normalize(
    x: npt.ArrayLike,
    residual: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``h = x + residual`` rounded as ``spec.residual`` says, and ``(normalize(h), h)``.

    With ``t`` the input dtype (``x``'s) and ``c`` the compute dtype (float32; float64 for
    float64 inputs), ``round_d`` rounding once to nearest even:

        "rounded":             h = round_t(x + residual); y = norm(h)             h in t
        "float32":             h = round_c(x + residual); y = norm(h)             h in c
        "float32_normalized":  s = round_c(x + residual); y = norm(s); h = round_t(s)  h in t

    ``norm`` has the dtype policy of inputs of dtype ``t`` whatever dtype ``h`` has (its
    statistic in float32, its cast points and output dtype those of ``t``). For float32 and
    float64 inputs the three coincide. ``residual`` has ``x``'s shape and dtype, or with
    ``"float32"`` may be a ``c`` array (a residual stream kept in float32).
    """
    arr = _check_input(x, "x")
    res = _check_input(residual, "residual")
    spec.check_eps(arr.dtype.name)
    added = _add(arr, res, spec)
    p = _params(arr.shape, spec, scale, bias, alpha)
    out = output_dtype(arr.dtype, spec, scale, bias, alpha)
    return _forward(added.normalized, arr.dtype, out, spec, p), added.h


def add_normalize_vjp(
    x: npt.ArrayLike,
    residual: npt.ArrayLike,
    dy: npt.ArrayLike,
    dh: npt.ArrayLike | None,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
) -> AddNormGrads | AddDytGrads:
    """The gradients of ``sum(dy * y) + sum(dh * h)`` for ``(y, h) = add_normalize(...)``.

    The rounding of the sum is not differentiated, and the norm's VJP is evaluated at the value
    the forward normalizes (``h``, or the float32 sum): ``dx = dresidual = dh + dnorm`` with
    ``dnorm`` the input gradient of `normalize_vjp` there; the parameters' gradients are those
    of `normalize_vjp`. ``dh`` None means zero. ``backward="autograd"`` reproduces the eager
    program's roundings: with ``"rounded"`` the norm's input gradient is rounded to the input
    dtype and added to ``dh`` in it; with the float32 modes both are float32 (not rounded);
    ``dx`` and ``dresidual`` are then rounded to their arrays' dtypes.

    Returns `AddNormGrads` ``(dx, dresidual, dscale, dbias)``, or `AddDytGrads` with ``dalpha``
    for ``kind="dyt"``.
    """
    arr = _check_input(x, "x")
    res = _check_input(residual, "residual")
    spec.check_eps(arr.dtype.name)
    added = _add(arr, res, spec)
    grad = _check_grad(dy, "dy", arr.shape)
    dh64 = np.zeros(arr.shape) if dh is None else _check_grad(dh, "dh", arr.shape)
    p = _params(arr.shape, spec, scale, bias, alpha)
    raw = _grads(added.normalized, arr.dtype, grad, spec, p)
    if spec.backward == "exact":
        dx = dres = dh64 + raw.dx
    else:
        if spec.residual == "rounded":
            total = _round_half(dh64 + _round_half(raw.dx, arr.dtype), arr.dtype)
        else:
            total = dh64 + raw.dx
        dx, dres = dtypes.round_to(total, arr.dtype), dtypes.round_to(total, res.dtype)
    dscale, dbias, dalpha = _param_grads(raw, spec, p)
    if spec.kind == "dyt":
        return AddDytGrads(dx, dres, dscale, dbias, dalpha)
    return AddNormGrads(dx, dres, dscale, dbias)


def gated_normalize(
    x: npt.ArrayLike,
    gate: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
) -> np.ndarray:
    """A gated ``spec`` applied to ``x`` and its gate ``z``, computed in float64, returned in
    the output dtype (`output_dtype`: the gate's dtype takes no part). With ``u(v) = y_hat(v)
    (scale_offset + w) + b`` the ungated norm of `normalize` and ``a`` the activation::

        gate="before":  y = u(x * a(z))
        gate="after":   y = u(x) * a(z)

    For half inputs the product ``x * a(z)`` is not rounded (float32 in an implementation);
    with ``gate="after"`` and ``cast="before_scale"`` ``y_hat`` is rounded to the input dtype,
    ``u`` to the affine step's dtype (the input dtype promoted with the parameters'), and ``u
    a(z)`` to the output dtype; with ``"after_scale"`` only ``u a(z)`` is rounded.
    ``group_size`` applies as in `normalize`.

    Args:
      x: float16, bfloat16 (ml_dtypes), float32 or float64 array.
      gate: ``z``, a float array of ``x``'s shape (any float dtype: ``a(z)`` is computed from
        its exact values).
      spec: a spec with ``gate`` set.
      scale, bias: as in `normalize`.

    Examples:
      >>> import numpy as np
      >>> from normkit import NormSpec
      >>> after = NormSpec(gate="after", gate_activation="sigmoid")
      >>> gated_normalize(np.array([[3.0, 4.0]]), np.zeros((1, 2)), after).round(4)
      array([[0.4243, 0.5657]])
    """
    arr = _check_input(x, "x")
    spec.check_eps(arr.dtype.name)
    z = _check_gate(gate, arr.shape, spec, "gated_normalize")
    p = _params(arr.shape, spec, scale, bias, None)
    out = output_dtype(arr.dtype, spec, scale, bias)
    return _forward(arr.astype(np.float64), arr.dtype, out, spec, p, gate=z)


def gated_normalize_vjp(
    x: npt.ArrayLike,
    gate: npt.ArrayLike,
    dy: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
) -> GatedNormGrads:
    r"""The gradients of ``sum(dy * gated_normalize(x, gate, spec, scale, bias))``, analytic,
    in float64 (the roundings of the half-precision policy are not differentiated).

    With ``J`` the VJP of the ungated norm (`normalize_vjp`'s ``dx``, ``dw``, ``db``)::

        gate="before":  e = J_x(x a(z))^T dy      dx = e a(z)      dgate = e x a'(z)
                        dw, db those of the norm at x a(z)
        gate="after":   dx = J_x(x)^T (dy a(z))   dgate = dy u(x) a'(z)
                        dw, db those of the norm at x for the cotangent dy a(z)

    ``a'`` is ``sigmoid(z) (1 + z sigmoid(-z))`` for SiLU, ``sigmoid(z) sigmoid(-z)`` for
    sigmoid. Returns `GatedNormGrads` ``(dx, dgate, dscale, dbias)``, None for parameters the
    spec lacks.
    """
    arr = _check_input(x, "x")
    spec.check_eps(arr.dtype.name)
    z = _check_gate(gate, arr.shape, spec, "gated_normalize_vjp")
    grad = _check_grad(dy, "dy", arr.shape)
    p = _params(arr.shape, spec, scale, bias, None)
    raw = _grads(arr.astype(np.float64), arr.dtype, grad, spec, p, gate=z)
    assert raw.dgate is not None
    return GatedNormGrads(raw.dx, raw.dgate, raw.dscale, raw.dbias)


def scaled_magnitude(
    x: npt.ArrayLike,
    spec: NormSpec,
    scale: npt.ArrayLike | None = None,
    alpha: npt.ArrayLike | None = None,
    *,
    gate: npt.ArrayLike | None = None,
) -> np.ndarray:
    """``|y_hat * (scale_offset + w)|`` in float64: the size of the term that
    ``cast="before_scale"`` rounds at (see `normkit.tolerances`). For a gated spec, ``y_hat``
    of the gated input (``gate="before"``), or the term times ``|a(z)|`` (``"after"``), the
    factor a rounding of it is carried to the output by."""
    arr = _check_input(x, "x")
    exact = spec.replace(bias=False, residual=None, output_dtype="input")
    if (gate is None) != (spec.gate is None):
        raise ValueError(
            f"scaled_magnitude: the spec has gate={spec.gate!r}, and a gate was "
            f"{'not ' if gate is None else ''}given"
        )
    if gate is not None:
        return np.abs(gated_normalize(arr.astype(np.float64), gate, exact, scale))
    return np.abs(normalize(arr.astype(np.float64), exact, scale, None, alpha))
