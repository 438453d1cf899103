"""The numba row kernels behind `normkit.torch.kernels.cpu`: forward and backward of every kind.

Rows are float32 (``xf``) or the bits of float16/bfloat16 (``xh``, uint16; the other array is
an empty placeholder), so each kernel compiles once, for fixed argument types, when this module
is imported. Half rows are widened into a float32 row buffer and rounded back to nearest even by
integer operations.

Per row the statistic is accumulated in float64 (so no float32 overflow, and n up to 2**20 keeps
its precision); LayerNorm takes two passes and corrects the mean by the mean of the centered
values. The elementwise pass runs in float32 on ``((x - m_hi) - m_lo) * r`` (the mean split in
two float32 parts); a row whose scalars leave float32's comfortable range (|x| near the float32
maximum, tiny eps outside the root, NaN/inf) takes the same pass in float64 instead.

The formulas are those of `normkit.reference.normalize` and `normalize_vjp`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32, BF16, F16 = 0, 1, 2
RMS, PARTIAL_RMS, LAYER = 0, 1, 2

_FAST_LOW = 1e-30
_FAST_HIGH = 1e30
_TWO_M24 = np.float32(2.0**-24)
_TWO_P24 = np.float32(2.0**24)
_TWO_P23 = np.float32(2.0**23)
_REDUCE = {"reassoc", "contract"}

_ROWS = "float32[:, ::1], uint16[:, ::1]"
_FORWARD_SIG = (
    f"void({_ROWS}, float32[::1], float32[::1], {_ROWS}, "
    "int64, int64, float64, boolean, boolean, int64, int64)"
)
_BACKWARD_SIG = (
    f"void({_ROWS}, {_ROWS}, float32[::1], {_ROWS}, float32[:, ::1], float32[:, ::1], "
    "int64, int64, float64, boolean, int64, int64)"
)


# ---- half <-> float32, by integer operations -------------------------------------------------


@njit(cache=True)
def _widen(h: np.ndarray, out: np.ndarray, code: int) -> None:
    """The float16/bfloat16 bits ``h`` as float32 values in ``out`` (exact)."""
    bits = out.view(np.uint32)
    if code == BF16:
        for j in range(h.size):
            bits[j] = np.uint32(h[j]) << 16
        return
    for j in range(h.size):
        e = np.uint32(h[j])
        sign = (e & 0x8000) << 16
        em = e & 0x7FFF
        if em >= 0x7C00:
            bits[j] = sign | 0x7F800000 | ((em & 0x3FF) << 13)
        elif em >= 0x400:
            bits[j] = sign | ((em << 13) + 0x38000000)
        else:
            v = np.float32(em) * _TWO_M24
            out[j] = -v if sign else v


@njit(cache=True)
def _narrow(values: np.ndarray, h: np.ndarray, code: int) -> None:
    """The float32 ``values`` rounded to nearest even into float16/bfloat16 bits ``h``."""
    bits = values.view(np.uint32)
    if code == BF16:
        for j in range(h.size):
            u = bits[j]
            if (u & 0x7FFFFFFF) > 0x7F800000:
                h[j] = (u >> 16) | 0x40
            else:
                h[j] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return
    for j in range(h.size):
        u = bits[j]
        sign = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        if a > 0x7F800000:
            h[j] = sign | 0x7E00 | ((a >> 13) & 0x3FF)
        elif a >= 0x477FF000:
            h[j] = sign | 0x7C00
        elif a >= 0x38800000:
            m = a - 0x38000000
            h[j] = sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13)
        else:
            scaled = abs(values[j]) * _TWO_P24
            h[j] = sign | np.uint32((scaled + _TWO_P23) - _TWO_P23)


# ---- per-row reductions, in float64 ----------------------------------------------------------


@njit(cache=True, fastmath=_REDUCE)
def _sum(row: np.ndarray) -> float:
    acc = 0.0
    for j in range(row.size):
        acc += np.float64(row[j])
    return acc


@njit(cache=True, fastmath=_REDUCE)
def _sum_square(row: np.ndarray, k: int) -> float:
    acc = 0.0
    for j in range(k):
        v = np.float64(row[j])
        acc += v * v
    return acc


@njit(cache=True, fastmath=_REDUCE)
def _centered_sums(row: np.ndarray, m0: float) -> tuple[float, float]:
    """``sum(x - m0)`` and ``sum((x - m0)^2)``."""
    s1 = 0.0
    s2 = 0.0
    for j in range(row.size):
        v = np.float64(row[j]) - m0
        s1 += v
        s2 += v * v
    return s1, s2


@njit(cache=True, fastmath=_REDUCE)
def _dot_scaled(row: np.ndarray, dy: np.ndarray, g: np.ndarray, lo: int, hi: int, m0: float
                ) -> tuple[float, float]:
    """``sum(d)`` and ``sum(d * (x - m0))`` over ``[lo, hi)``, ``d = dy * g``."""
    sd = 0.0
    sdc = 0.0
    for j in range(lo, hi):
        d = np.float64(dy[j] * g[j])
        sd += d
        sdc += d * (np.float64(row[j]) - m0)
    return sd, sdc


@njit(cache=True)
def _layer_moments(row: np.ndarray) -> tuple[float, float, float, float]:
    """``(mean, s, m0, sum(x - m0))``: two passes, the mean corrected by that of x - m0."""
    n = row.size
    m0 = _sum(row) / n
    s1, s2 = _centered_sums(row, m0)
    s = (s2 - s1 * s1 / n) / n
    if s < 0.0:
        s = 0.0
    return m0 + s1 / n, s, m0, s1


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
    """Whether a row scalar is safe to apply in float32: finite, and far from under/overflow."""
    return _FAST_LOW < abs(v) < _FAST_HIGH


# ---- forward ---------------------------------------------------------------------------------


@njit(cache=True)
def _normalize_row(row: np.ndarray, dst: np.ndarray, hbuf: np.ndarray, mean: float, r: float,
                   g: np.ndarray, b: np.ndarray, before_scale: bool, code: int) -> None:
    """``dst = (row - mean) * r * g + b``; with ``before_scale`` the first factor is rounded to
    the half dtype ``code`` first."""
    n = row.size
    rounded = before_scale and code != F32
    if _fast(r) and (mean == 0.0 or _fast(mean)):
        r32 = np.float32(r)
        m_hi = np.float32(mean)
        m_lo = np.float32(mean - np.float64(m_hi))
        if rounded:
            for j in range(n):
                dst[j] = ((row[j] - m_hi) - m_lo) * r32
        else:
            for j in range(n):
                dst[j] = ((row[j] - m_hi) - m_lo) * r32 * g[j] + b[j]
    else:
        for j in range(n):
            v = (np.float64(row[j]) - mean) * r
            dst[j] = v if rounded else v * g[j] + b[j]
    if rounded:
        _narrow(dst, hbuf, code)
        _widen(hbuf, dst, code)
        for j in range(n):
            dst[j] = dst[j] * g[j] + b[j]


@njit(cache=True)
def _row_statistic(row: np.ndarray, kind: int, k: int, eps: float, outside: bool
                   ) -> tuple[float, float]:
    """``(mean, r)`` of a row; the mean is 0 for the RMS kinds."""
    if kind == LAYER:
        mean, s, _, _ = _layer_moments(row)
        return mean, _rstd(s, eps, outside)
    return 0.0, _rstd(_sum_square(row, k) / k, eps, outside)


@njit(_FORWARD_SIG, parallel=True, cache=True)
def forward(xf: np.ndarray, xh: np.ndarray, g: np.ndarray, b: np.ndarray, yf: np.ndarray,
            yh: np.ndarray, kind: int, k: int, eps: float, outside: bool, before_scale: bool,
            code: int, block: int) -> None:
    """``y = normalize(x)`` for rows ``xf`` (float32) or ``xh`` (half bits, ``code``) into
    ``yf`` / ``yh``; ``g`` the effective scale, ``b`` the bias (float32), ``block`` rows at a
    time per task."""
    rows = xf.shape[0] if code == F32 else xh.shape[0]
    n = g.size
    blocks = (rows + block - 1) // block
    for blk in prange(blocks):
        buf = np.empty(n, np.float32)
        hbuf = np.empty(n, np.uint16)
        for i in range(blk * block, min(rows, (blk + 1) * block)):
            if code == F32:
                row = xf[i]
                dst = yf[i]
            else:
                _widen(xh[i], buf, code)
                row = buf
                dst = buf
            mean, r = _row_statistic(row, kind, k, eps, outside)
            _normalize_row(row, dst, hbuf, mean, r, g, b, before_scale, code)
            if code != F32:
                _narrow(dst, yh[i], code)


# ---- backward --------------------------------------------------------------------------------


@njit(cache=True)
def _gradient_row(row: np.ndarray, dy: np.ndarray, dst: np.ndarray, g: np.ndarray,
                  dg: np.ndarray, db: np.ndarray, kind: int, k: int, eps: float,
                  outside: bool) -> None:
    """``dst = dx`` of one row (may alias ``dy``); adds ``dy * y_hat`` to ``dg``, ``dy`` to
    ``db``.

    ``dx_j = r (d_j - mean(d)) + [j < k] c_j (2/k) r'(s) sum_i d_i c_i`` with ``d = dy * g``
    and ``c`` the centered row (``mean(d)`` only for layer); for k = 1 element 0 takes the
    closed form ``r^3 (eps d_0 - x_0 S_1)`` (inside) or ``r^2 (eps d_0 - sign(x_0) S_1)``
    (outside), ``S_1 = sum_{i >= 1} d_i x_i``, free of cancellation.
    """
    n = row.size
    d0 = np.float64(dy[0]) * g[0]
    x0 = np.float64(row[0])
    if kind == LAYER:
        mean, s, m0, _ = _layer_moments(row)
        sd, sdc0 = _dot_scaled(row, dy, g, 0, n, m0)
        dot = sdc0 - (mean - m0) * sd
        mean_d = sd / n
        tail = 0.0
    else:
        mean = 0.0
        s = _sum_square(row, k) / k
        _, head = _dot_scaled(row, dy, g, 0, k, 0.0)
        _, tail = _dot_scaled(row, dy, g, k, n, 0.0)
        dot = head + tail
        mean_d = 0.0
    r = _rstd(s, eps, outside)
    q = (2.0 / k) * _dr_ds(r, s, outside) * dot
    if _fast(r) and (q == 0.0 or abs(q) < _FAST_HIGH) and abs(mean_d) < _FAST_HIGH and (
        mean == 0.0 or _fast(mean)
    ):
        r32 = np.float32(r)
        q32 = np.float32(q)
        md32 = np.float32(mean_d)
        m_hi = np.float32(mean)
        m_lo = np.float32(mean - np.float64(m_hi))
        for j in range(k):
            c = (row[j] - m_hi) - m_lo
            dyj = dy[j]
            dg[j] += dyj * (c * r32)
            db[j] += dyj
            dst[j] = r32 * (dyj * g[j] - md32) + c * q32
        for j in range(k, n):
            c = (row[j] - m_hi) - m_lo
            dyj = dy[j]
            dg[j] += dyj * (c * r32)
            db[j] += dyj
            dst[j] = r32 * (dyj * g[j] - md32)
    else:
        for j in range(n):
            c = np.float64(row[j]) - mean
            dyj = np.float64(dy[j])
            dg[j] += dyj * c * r
            db[j] += dyj
            v = r * (dyj * g[j] - mean_d)
            dst[j] = v + c * q if j < k else v
    if kind != LAYER and k == 1:
        dst[0] = _first_of_one(x0, d0, tail, r, eps, outside)


@njit(cache=True)
def _first_of_one(x0: float, d0: float, tail: float, r: float, eps: float, outside: bool
                  ) -> float:
    """``dx_0`` for a statistic of one element, in the closed form of `_gradient_row`."""
    if outside:
        sign = 1.0 if x0 > 0.0 else (-1.0 if x0 < 0.0 else 0.0)
        return r * r * (eps * d0 - sign * tail)
    return r * r * r * (eps * d0 - x0 * tail)


@njit(_BACKWARD_SIG, parallel=True, cache=True)
def backward(xf: np.ndarray, xh: np.ndarray, dyf: np.ndarray, dyh: np.ndarray, g: np.ndarray,
             dxf: np.ndarray, dxh: np.ndarray, dg: np.ndarray, db: np.ndarray, kind: int,
             k: int, eps: float, outside: bool, code: int, block: int) -> None:
    """``dx`` of rows ``x`` for the cotangent ``dy`` (float32 or half bits, as in `forward`)
    into ``dxf`` / ``dxh``; row block ``i`` adds its rows' ``dy * y_hat`` to ``dg[i]`` and
    ``dy`` to ``db[i]`` (float32 partial sums, zero on entry)."""
    rows = xf.shape[0] if code == F32 else xh.shape[0]
    n = g.size
    blocks = (rows + block - 1) // block
    for blk in prange(blocks):
        xbuf = np.empty(n, np.float32)
        dybuf = np.empty(n, np.float32)
        dg_block = dg[blk]
        db_block = db[blk]
        for i in range(blk * block, min(rows, (blk + 1) * block)):
            if code == F32:
                _gradient_row(xf[i], dyf[i], dxf[i], g, dg_block, db_block, kind, k, eps,
                              outside)
            else:
                _widen(xh[i], xbuf, code)
                _widen(dyh[i], dybuf, code)
                _gradient_row(xbuf, dybuf, dybuf, g, dg_block, db_block, kind, k, eps, outside)
                _narrow(dybuf, dxh[i], code)
