"""The numba row kernels behind `normkit.torch.kernels.cpu`: forward and backward of every kind.

Rows are float32, or the bits of bfloat16 (as int16) or float16 (as uint16): the array's dtype
selects, at compile time, how an element is read as float32 and how a float32 result is
rounded back (to nearest even, by integer operations), so every loop reads the input once from
memory and writes its output once, with no row buffer.

Per row the statistic is accumulated in float64 (no float32 overflow; rows of n = 2**20 keep
their precision); LayerNorm takes two passes and corrects the mean by the mean of the centered
values. The elementwise pass runs in float32 on ``((x - m_hi) - m_lo) * r`` (the mean split
into two float32 parts); a row whose scalars leave float32's comfortable range (|x| near the
float32 maximum, a tiny eps outside the root, NaN or inf) takes the same pass in float64.

The formulas are those of `normkit.reference.normalize` and `normalize_vjp`.
"""

# numba compiles this module: its scalars are numpy float32/float64 where the annotations say
# float, and intrinsics take numba's typing context implicitly.
# mypy: disable-error-code="call-arg, var-annotated, return-value, arg-type"

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

RMS, PARTIAL_RMS, LAYER = 0, 1, 2
ROW_DTYPES = {"float32": np.float32, "bfloat16": np.int16, "float16": np.uint16}

_FAST_LOW = 1e-30
_FAST_HIGH = 1e30
_TWO_M24 = np.float32(2.0**-24)
_TWO_P24 = np.float32(2.0**24)
_TWO_P23 = np.float32(2.0**23)
_REDUCE = {"reassoc", "contract"}


def signatures(dtype: str) -> tuple[str, str]:
    """The numba signatures of `forward` and `backward` for rows of ``dtype``."""
    rows = f"{np.dtype(ROW_DTYPES[dtype]).name}[:, ::1]"
    vec = "float32[::1]"
    forward_sig = (
        f"void({rows}, {vec}, {vec}, {rows}, {vec}, int64, int64, float64, boolean, boolean, "
        "int64)"
    )
    backward_sig = (
        f"void({rows}, {vec}, {rows}, {vec}, {rows}, float32[:, ::1], float32[:, ::1], "
        "int64, int64, float64, boolean, boolean, boolean, int64)"
    )
    return forward_sig, backward_sig


# ---- bit casts and the half formats ----------------------------------------------------------


@intrinsic
def _float_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the uint32 ``bits``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx: Any, value: Any) -> Any:
    """The bits of the float32 ``value`` as a uint32."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True)
def _bf16_value(h: int) -> float:
    return _float_from_bits(np.uint32(np.uint16(h)) << 16)


@njit(cache=True)
def _bf16_bits(v: float) -> int:
    """``v`` rounded to nearest even bfloat16; NaN stays a (quiet) NaN."""
    u = _bits_of_float(v)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.int16((u >> 16) | 0x40)
    return np.int16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(cache=True)
def _f16_value(h: int) -> float:
    e = np.uint32(h)
    sign = (e & 0x8000) << 16
    em = e & 0x7FFF
    if em >= 0x7C00:
        return _float_from_bits(sign | 0x7F800000 | ((em & 0x3FF) << 13))
    if em >= 0x400:
        return _float_from_bits(sign | ((em << 13) + 0x38000000))
    v = np.float32(em) * _TWO_M24
    return -v if sign else v


@njit(cache=True)
def _f16_bits(v: float) -> int:
    """``v`` rounded to nearest even float16; beyond 65520 infinity; NaN a quiet NaN."""
    u = _bits_of_float(v)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return np.uint16(sign | 0x7E00 | ((a >> 13) & 0x3FF))
    if a >= 0x477FF000:
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:
        m = a - 0x38000000
        return np.uint16(sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13))
    scaled = abs(v) * _TWO_P24
    return np.uint16(sign | np.uint32((scaled + _TWO_P23) - _TWO_P23))


@njit(cache=True)
def _round_to_odd(v: float) -> float:
    """The float64 ``v`` as float32, rounded to odd: a later rounding to a half format is then
    the correct rounding of ``v`` itself (no double-rounding error)."""
    f = np.float32(v)
    if np.float64(f) != v and np.isfinite(f):
        u = _bits_of_float(f)
        if (u & 1) == 0:
            u = u - 1 if abs(np.float64(f)) > abs(v) else u + 1
            f = _float_from_bits(u)
    return f


def _load(row: np.ndarray, j: int) -> float:
    """Element ``j`` of a row as float32 (bfloat16 / float16 bits widened exactly)."""
    raise NotImplementedError


def _store(row: np.ndarray, j: int, v: float) -> None:
    """Store the float32 ``v`` at element ``j``, rounded to nearest even for half rows."""
    raise NotImplementedError


def _round_like(row: np.ndarray, v: float) -> float:
    """The float64 ``v`` rounded once to the row's dtype, as float32."""
    raise NotImplementedError


# The implementations repeat the typing functions' parameters, annotations included: numba
# compares the two signatures.


@overload(_load)
def _load_impl(row: Any, j: Any) -> Any:
    if row.dtype == types.int16:

        def load_bf16(row: Any, j: Any) -> Any:
            return _bf16_value(row[j])

        return load_bf16
    if row.dtype == types.uint16:

        def load_f16(row: Any, j: Any) -> Any:
            return _f16_value(row[j])

        return load_f16

    def load_f32(row: Any, j: Any) -> Any:
        return row[j]

    return load_f32


@overload(_store)
def _store_impl(row: Any, j: Any, v: Any) -> Any:
    if row.dtype == types.int16:

        def store_bf16(row: Any, j: Any, v: Any) -> Any:
            row[j] = _bf16_bits(v)

        return store_bf16
    if row.dtype == types.uint16:

        def store_f16(row: Any, j: Any, v: Any) -> Any:
            row[j] = _f16_bits(v)

        return store_f16

    def store_f32(row: Any, j: Any, v: Any) -> Any:
        row[j] = v

    return store_f32


@overload(_round_like)
def _round_like_impl(row: Any, v: Any) -> Any:
    if row.dtype == types.int16:

        def round_bf16(row: Any, v: Any) -> Any:
            return _bf16_value(_bf16_bits(_round_to_odd(v)))

        return round_bf16
    if row.dtype == types.uint16:

        def round_f16(row: Any, v: Any) -> Any:
            return _f16_value(_f16_bits(_round_to_odd(v)))

        return round_f16

    def round_f32(row: Any, v: Any) -> Any:
        return np.float32(v)

    return round_f32


# ---- per-row reductions, in float64 ----------------------------------------------------------


@njit(cache=True, fastmath=_REDUCE)
def _sum(row: np.ndarray) -> float:
    acc = 0.0
    for j in range(row.size):
        acc += np.float64(_load(row, j))
    return acc


@njit(cache=True, fastmath=_REDUCE)
def _sum_square(row: np.ndarray, k: int) -> float:
    acc = 0.0
    for j in range(k):
        v = np.float64(_load(row, j))
        acc += v * v
    return acc


@njit(cache=True, fastmath=_REDUCE)
def _centered_sums(row: np.ndarray, m0: float) -> tuple[float, float]:
    """``sum(x - m0)`` and ``sum((x - m0)^2)``."""
    s1 = 0.0
    s2 = 0.0
    for j in range(row.size):
        v = np.float64(_load(row, j)) - m0
        s1 += v
        s2 += v * v
    return s1, s2


@njit(cache=True, fastmath=_REDUCE)
def _dot_scaled(row: np.ndarray, dy: np.ndarray, g: np.ndarray, m0: float) -> tuple[float, float]:
    """``sum(d)`` and ``sum(d * (x - m0))``, ``d = dy * g``."""
    sd = 0.0
    sdc = 0.0
    for j in range(row.size):
        d = np.float64(_load(dy, j) * g[j])
        sd += d
        sdc += d * (np.float64(_load(row, j)) - m0)
    return sd, sdc


@njit(cache=True, fastmath=_REDUCE)
def _add(acc: float, v: float) -> float:
    """``acc + v``, reassociable: a loop accumulating with it vectorizes."""
    return acc + v


@njit(cache=True, fastmath=_REDUCE)
def _add_square(acc: float, v: float) -> float:
    """``acc + v^2``, reassociable: a loop accumulating with it vectorizes."""
    return acc + v * v


@njit(cache=True)
def _layer_moments(row: np.ndarray) -> tuple[float, float, float]:
    """``(mean, s, m0)``: two passes, the mean ``m0`` corrected by that of ``x - m0``."""
    return _layer_moments_from(row, _sum(row))


@njit(cache=True)
def _layer_moments_from(row: np.ndarray, total: float) -> tuple[float, float, float]:
    """`_layer_moments` given the row's sum ``total`` (its first pass)."""
    n = row.size
    m0 = total / n
    s1, s2 = _centered_sums(row, m0)
    s = (s2 - s1 * s1 / n) / n
    if s < 0.0:  # noqa: PLR1730 (a NaN must stay NaN)
        s = 0.0
    return m0 + s1 / n, s, m0


@njit(cache=True)
def _rstd(s: float, eps: float, outside: bool) -> float:
    if outside:
        return 1.0 / (np.sqrt(s) + eps)
    return 1.0 / np.sqrt(s + eps)


@njit(cache=True)
def _dr_ds(r: float, s: float, outside: bool) -> float:
    """``r'(s)``: ``-r^3/2`` inside, ``-r^2/(2 sqrt(s))`` outside (0 at s = 0)."""
    if not outside:
        return -0.5 * r * r * r
    if s > 0.0:
        return -0.5 * r * r / np.sqrt(s)
    return 0.0


@njit(cache=True)
def _fast(v: float) -> bool:
    """Whether a row scalar is safe to apply in float32: finite, far from under/overflow."""
    return _FAST_LOW < abs(v) < _FAST_HIGH


@njit(cache=True)
def _split(mean: float) -> tuple[float, float]:
    """``mean`` as a sum of two float32 values, high part first."""
    hi = np.float32(mean)
    return hi, np.float32(mean - np.float64(hi))


# ---- forward ---------------------------------------------------------------------------------


@njit(cache=True)
def _first_pass(row: np.ndarray, kind: int, k: int) -> float:
    """What the statistic needs from a row's first read: the sum of squares of its first ``k``
    elements (RMS kinds), or its sum (layer)."""
    if kind == LAYER:
        return _sum(row)
    return _sum_square(row, k)


@njit(cache=True)
def _scale_span(x: np.ndarray, y: np.ndarray, g: np.ndarray, b: np.ndarray, r: float,
                m_hi: float, m_lo: float) -> None:
    """``y = ((x - m_hi) - m_lo) r g + b`` in float32."""
    for j in range(x.size):
        _store(y, j, ((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j])


@njit(cache=True)
def _scale_and_read_next(x: np.ndarray, y: np.ndarray, g: np.ndarray, b: np.ndarray, r: float,
                         m_hi: float, m_lo: float, following: np.ndarray, square: bool) -> float:
    """`_scale_span` over the row while accumulating, in float64, the sum of ``following`` (of
    its squares with ``square``; no longer than the row): the next row streams in from memory
    while this one is written, as in a copy, instead of in a pass of reads of its own."""
    m = following.size
    acc = 0.0
    if square:
        for j in range(m):
            _store(y, j, ((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j])
            acc = _add_square(acc, np.float64(_load(following, j)))
    else:
        for j in range(m):
            _store(y, j, ((_load(x, j) - m_hi) - m_lo) * r * g[j] + b[j])
            acc = _add(acc, np.float64(_load(following, j)))
    _scale_span(x[m:], y[m:], g[m:], b[m:], r, m_hi, m_lo)
    return acc


@njit(cache=True)
def _forward_row(x: np.ndarray, y: np.ndarray, g: np.ndarray, b: np.ndarray, kind: int,
                 k: int, eps: float, outside: bool, before_scale: bool, first: float,
                 following: np.ndarray) -> tuple[float, float]:
    """``y = (x - mean) * r * g + b`` for one row whose `_first_pass` is ``first``; returns
    ``r`` and the `_first_pass` of the row ``following`` (empty after a block's last row).
    With ``before_scale`` the normalized value is rounded to the row's dtype before the
    affine step."""
    n = x.size
    if kind == LAYER:
        mean, s, _ = _layer_moments_from(x, first)
    else:
        mean = 0.0
        s = first / k
    r = _rstd(s, eps, outside)
    if _fast(r) and (mean == 0.0 or _fast(mean)) and not before_scale:
        m_hi, m_lo = _split(mean)
        ahead = following[:k] if kind != LAYER else following
        return r, _scale_and_read_next(x, y, g, b, np.float32(r), m_hi, m_lo, ahead,
                                       kind != LAYER)
    if _fast(r) and (mean == 0.0 or _fast(mean)):
        # y_hat in float64, rounded once: its rounding is that of the reference.
        for j in range(n):
            v = _round_like(x, (np.float64(_load(x, j)) - mean) * r)
            _store(y, j, v * g[j] + b[j])
    else:
        for j in range(n):
            v = (np.float64(_load(x, j)) - mean) * r
            if before_scale:
                v = np.float64(_round_like(x, v))
            _store(y, j, np.float32(v * g[j] + b[j]))
    return r, _first_pass(following, kind, k) if following.size else 0.0


@njit(parallel=True, cache=True)
def forward(x: np.ndarray, g: np.ndarray, b: np.ndarray, y: np.ndarray, r: np.ndarray,
            kind: int, k: int, eps: float, outside: bool, before_scale: bool, block: int
            ) -> None:
    """``y = normalize(x)`` for rows ``x`` into ``y`` (same dtype) and ``r(s)`` of each row
    into ``r`` (float32); ``g`` the effective scale, ``b`` the bias (float32); tasks of
    ``block`` rows."""
    rows, n = x.shape
    blocks = (rows + block - 1) // block
    for blk in prange(blocks):
        start = blk * block
        end = min(rows, start + block)
        first = _first_pass(x[start], kind, k)
        for i in range(start, end):
            # the next row of the block, read while this one is written (none after the last)
            following = x[min(i + 1, end - 1)][: n if i + 1 < end else 0]
            r[i], first = _forward_row(x[i], y[i], g, b, kind, k, eps, outside, before_scale,
                                       first, following)


# ---- backward --------------------------------------------------------------------------------


@njit(cache=True)
def _first_of_one(x0: float, d0: float, tail: float, r: float, eps: float, outside: bool
                  ) -> float:
    """``dx_0`` when the statistic reads one element: ``r^3 (eps d_0 - x_0 S_1)`` inside,
    ``r^2 (eps d_0 - sign(x_0) S_1)`` outside, ``S_1 = sum_{i >= 1} d_i x_i``."""
    if outside:
        sign = 1.0 if x0 > 0.0 else (-1.0 if x0 < 0.0 else 0.0)
        return r * r * (eps * d0 - sign * tail)
    return r * r * r * (eps * d0 - x0 * tail)


@njit(cache=True)
def _gradient_span(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, g: np.ndarray,
                   dg: np.ndarray, db: np.ndarray, r: float, q: float, mean_d: float,
                   m_hi: float, m_lo: float, need_g: bool, need_b: bool) -> None:
    """``dx = r (dy g - mean_d) + c q`` in float32, with ``c = (x - m_hi) - m_lo``; with
    ``need_g`` ``dg += dy c r``, with ``need_b`` ``db += dy`` (one loop per case, so that each
    vectorizes and touches only the rows it needs)."""
    if need_g and need_b:
        for j in range(x.size):
            c = (_load(x, j) - m_hi) - m_lo
            dyj = _load(dy, j)
            dg[j] += dyj * (c * r)
            db[j] += dyj
            _store(dx, j, r * (dyj * g[j] - mean_d) + c * q)
    elif need_g:
        for j in range(x.size):
            c = (_load(x, j) - m_hi) - m_lo
            dyj = _load(dy, j)
            dg[j] += dyj * (c * r)
            _store(dx, j, r * (dyj * g[j] - mean_d) + c * q)
    elif need_b:
        for j in range(x.size):
            c = (_load(x, j) - m_hi) - m_lo
            dyj = _load(dy, j)
            db[j] += dyj
            _store(dx, j, r * (dyj * g[j] - mean_d) + c * q)
    else:
        for j in range(x.size):
            c = (_load(x, j) - m_hi) - m_lo
            _store(dx, j, r * (_load(dy, j) * g[j] - mean_d) + c * q)


@njit(cache=True)
def _backward_row(x: np.ndarray, saved_r: float, dy: np.ndarray, dx: np.ndarray, g: np.ndarray,
                  dg: np.ndarray, db: np.ndarray, kind: int, k: int, eps: float,
                  outside: bool, need_g: bool, need_b: bool) -> None:
    """``dx`` of one row; adds ``dy * y_hat`` to ``dg`` (with ``need_g``) and ``dy`` to ``db``
    (with ``need_b``).

    The forward's float32 ``r`` serves where it determines ``r'(s)`` (the RMS kinds, eps
    inside, r in float32's comfortable range); elsewhere the statistic is recomputed.

    ``dx_j = r (d_j - mean(d)) + [j < k] c_j (2/k) r'(s) sum_i d_i c_i`` with ``d = dy * g``
    and ``c`` the centered row (``mean(d)`` only for layer); for k = 1 element 0 takes the
    cancellation-free closed form of `_first_of_one`.
    """
    n = x.size
    if kind == LAYER:
        mean, s, m0 = _layer_moments(x)
        sd, sdc0 = _dot_scaled(x, dy, g, m0)
        dot = sdc0 - (mean - m0) * sd
        mean_d = sd / n
        tail = 0.0
    else:
        mean = 0.0
        s = 0.0 if not outside and _fast(saved_r) else _sum_square(x, k) / k
        # Slices, so that every loop starts at 0: numba then drops its negative-index check,
        # which would keep LLVM from vectorizing.
        _, head = _dot_scaled(x[:k], dy[:k], g[:k], 0.0)
        _, tail = _dot_scaled(x[k:], dy[k:], g[k:], 0.0)
        dot = head + tail
        mean_d = 0.0
    r = np.float64(saved_r) if kind != LAYER and not outside and _fast(saved_r) else _rstd(
        s, eps, outside
    )
    q = (2.0 / k) * _dr_ds(r, s, outside) * dot
    if (_fast(r) and abs(q) < _FAST_HIGH and abs(mean_d) < _FAST_HIGH
            and (mean == 0.0 or _fast(mean))):
        r32 = np.float32(r)
        q32 = np.float32(q)
        md32 = np.float32(mean_d)
        m_hi, m_lo = _split(mean)
        _gradient_span(x[:k], dy[:k], dx[:k], g[:k], dg[:k], db[:k], r32, q32, md32, m_hi, m_lo,
                       need_g, need_b)
        _gradient_span(x[k:], dy[k:], dx[k:], g[k:], dg[k:], db[k:], r32, np.float32(0.0), md32,
                       m_hi, m_lo, need_g, need_b)
    else:
        for j in range(n):
            c = np.float64(_load(x, j)) - mean
            dyj = np.float64(_load(dy, j))
            if need_g:
                dg[j] += dyj * c * r
            if need_b:
                db[j] += dyj
            v = r * (dyj * g[j] - mean_d)
            _store(dx, j, np.float32(v + c * q if j < k else v))
    if kind != LAYER and k == 1:
        d0 = np.float64(_load(dy, 0)) * g[0]
        dx0 = _first_of_one(np.float64(_load(x, 0)), d0, tail, r, eps, outside)
        _store(dx, 0, np.float32(dx0))


@njit(parallel=True, cache=True)
def backward(x: np.ndarray, r: np.ndarray, dy: np.ndarray, g: np.ndarray, dx: np.ndarray,
             dg: np.ndarray, db: np.ndarray, kind: int, k: int, eps: float, outside: bool,
             need_g: bool, need_b: bool, block: int) -> None:
    """``dx`` of rows ``x`` (with the forward's ``r``) for the cotangent ``dy`` (all of one
    dtype); row block ``i`` adds its rows' ``dy * y_hat`` to ``dg[i]`` (with ``need_g``) and
    ``dy`` to ``db[i]`` (with ``need_b``): float32 partial sums, zero on entry."""
    rows = x.shape[0]
    blocks = (rows + block - 1) // block
    for blk in prange(blocks):
        for i in range(blk * block, min(rows, (blk + 1) * block)):
            _backward_row(x[i], r[i], dy[i], dx[i], g, dg[blk], db[blk], kind, k, eps, outside,
                          need_g, need_b)
