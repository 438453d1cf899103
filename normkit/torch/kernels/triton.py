"""Triton kernels for every `NormSpec` kind and option, forward and backward, on rows.

`norm_rows` computes ``normkit.reference.normalize`` on rows ``x`` of shape (rows, n);
`add_norm_rows` first adds a residual (``h = x + residual``, rounded as ``residual_rounding``
says) and returns ``(y, h)``. Both are differentiable torch custom ops (`torch.library.triton_op`),
so ``torch.compile(fullgraph=True)`` traces through them and CUDA graphs can capture them. With
``TRITON_INTERPRET=1`` set before triton is imported, the same kernels run on CPU tensors.

Per row, in float32 (``sigma`` is 1 except on rows whose statistic overflows float32, where it is
the power of two that brings ``max|x|`` into [2, 4); ``xs = sigma x``)::

    rms, partial_rms:  c = xs                       s = sum(c[:k] ** 2) / k
    layer:             c = (xs - m) - m2            s = (sum(c0 ** 2) - sum(c0) m2) / n
                       (m = sum(xs) / n, c0 = xs - m, m2 = sum(c0) / n: two passes and a
                       correction, so a large mean costs no precision)
    rs = 1 / sqrt(s + eps sigma^2)   or   1 / (sqrt(s) + eps sigma)     r(s) = sigma rs
    y_hat = c rs,  y = y_hat (scale_offset + w) + b   (y_hat rounded first with "before_scale")

Backward, with ``d = dy (scale_offset + w)`` and ``u = y_hat`` (inside) or ``c / sqrt(s)``
(outside, 0 where s = 0; scale-free, so a row whose s is below ``2**-103``, where its squares
may have underflowed, takes it from ``x`` scaled by the power of two that brings ``max|x|``
into [2, 4), or by ``2**127`` where ``max|x|`` is subnormal)::

    rms, partial_rms:  dx = sigma rs (d - [i < k] u sum(d y_hat) / k)
    layer:             dx = sigma rs (d - mean(d) - u sum(d y_hat) / n)
    k = 1, element 0:  dx_0 = sigma rs^3 (eps sigma^2 d_0 - xs_0 T)    (inside)
                       dx_0 = sigma rs^2 (eps sigma d_0 - sign(xs_0) T)  (outside)
                       with T = sum_{j >= 1} xs_j d_j, free of cancellation
    dw = sum over rows of dy y_hat,  db = sum over rows of dy

Rows up to `MAX_FUSED_BLOCK` elements are held whole by one program; longer rows loop over
blocks of `LOOP_BLOCK` (each lane of a block accumulates its own sum, then a tree reduction).
Weight and bias gradients are summed per program into a (programs, n) float32 buffer, then
reduced across programs by a second small kernel.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError as error:
    raise ImportError(
        f"normkit's Triton kernels need triton and torch>=2.6 ({error}): "
        "pip install normkit[triton]"
    ) from error

from normkit.torch._autograd import NormFunction

__all__ = ["LOOP_BLOCK", "MAX_FUSED_BLOCK", "RESIDUAL_ROUNDINGS", "add_norm_rows", "norm_rows"]

MAX_FUSED_BLOCK = 16384
"""Rows of at most this many elements are held whole in one program; longer rows loop."""
LOOP_BLOCK = 4096
"""The block the looped variant steps through a row with."""
RESIDUAL_ROUNDINGS: tuple[str, ...] = ("rounded", "float32", "float32_normalized")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KINDS = ("rms", "partial_rms", "layer")
_CASTS = ("after_scale", "before_scale")
# Below this, a saved r(s) can only come from a rescaled (or inf/NaN) row: a finite float32
# statistic is below 2**128, so r(s) >= 2**-64 without rescaling.
_RESCALED_R: tl.constexpr = tl.constexpr(2.0**-64)
_INF: tl.constexpr = tl.constexpr(float("inf"))
# Below this a row's float32 s may have lost its value to underflow (`_row_factors`).
_TINY_S: tl.constexpr = tl.constexpr(2.0**-103)
_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-126)
_SOFT_RNE: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_PARTIAL_BLOCK = 32


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to nearest-even in DTYPE.

    Under Triton's interpreter, whose float32 -> bfloat16 conversion truncates (a GPU's rounds to
    nearest-even), bfloat16 is rounded with integer arithmetic first.
    """
    if _SOFT_RNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def _load_row(X, RES, offs, mask, RESIDUAL: tl.constexpr):
    """The row values the statistic reads, in float32: x, or h = x + residual as rounded."""
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL != 0:
        h += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL == 1:
            h = _round(h, X.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _inv_pow2(amax):
    """The power of two that brings ``amax`` (finite and normal) into [2, 4)."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((255 - biased) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rs(s, eps, OUTSIDE: tl.constexpr):
    """r(s), correctly rounded (once per row, so the approximate GPU forms save nothing)."""
    if OUTSIDE:
        return tl.div_rn(1.0, tl.sqrt_rn(s) + eps)
    else:
        return tl.div_rn(1.0, tl.sqrt_rn(s + eps))


@triton.jit
def _eps_scaled(eps, sigma, OUTSIDE: tl.constexpr):
    if OUTSIDE:
        return eps * sigma
    else:
        return (eps * sigma) * sigma


@triton.jit
def _moments_block(x, cols, n, k, LAYER: tl.constexpr):
    """(m, m2, s) of one whole row held in registers (zeros beyond n)."""
    if LAYER:
        m = tl.sum(x, axis=0) / n
        c0 = tl.where(cols < n, x - m, 0.0)
        total = tl.sum(c0, axis=0)
        m2 = total / n
        s = (tl.sum(c0 * c0, axis=0) - total * m2) / n
        s = tl.where(s < 0.0, 0.0, s)  # not tl.maximum, which drops a NaN
    else:
        m = tl.full([], 0.0, tl.float32)
        m2 = tl.full([], 0.0, tl.float32)
        s = tl.sum(tl.where(cols < k, x * x, 0.0), axis=0) / k
    return m, m2, s


@triton.jit
def _moments_looped(X, RES, row_off, sigma, n, k, LAYER: tl.constexpr, RESIDUAL: tl.constexpr,
                    BLOCK: tl.constexpr):
    """(m, m2, s) of the row at ``row_off`` scaled by ``sigma``, stepping by BLOCK."""
    cols = tl.arange(0, BLOCK)
    if LAYER:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            acc += _load_row(X, RES, row_off + start + cols, mask, RESIDUAL) * sigma
        m = tl.sum(acc, axis=0) / n
        acc_c = tl.zeros([BLOCK], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            xs = _load_row(X, RES, row_off + start + cols, mask, RESIDUAL) * sigma
            c0 = tl.where(mask, xs - m, 0.0)
            acc_c += c0
            acc_sq += c0 * c0
        total = tl.sum(acc_c, axis=0)
        m2 = total / n
        s = (tl.sum(acc_sq, axis=0) - total * m2) / n
        s = tl.where(s < 0.0, 0.0, s)  # not tl.maximum, which drops a NaN
    else:
        m = tl.full([], 0.0, tl.float32)
        m2 = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            mask = start + cols < k
            xs = _load_row(X, RES, row_off + start + cols, mask, RESIDUAL) * sigma
            acc += xs * xs
        s = tl.sum(acc, axis=0) / k
    return m, m2, s


@triton.jit
def _absmax_looped(X, RES, row_off, k, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """max |x| over the first k elements of the row, those the statistic reads."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        acc = tl.maximum(acc, tl.abs(_load_row(X, RES, row_off + start + cols, mask, RESIDUAL)))
    return tl.max(acc, axis=0)


@triton.jit
def _statistic(X, RES, row_off, x, cols, n, k, LAYER: tl.constexpr, RESIDUAL: tl.constexpr,
               SINGLE: tl.constexpr, BLOCK: tl.constexpr):
    """(sigma, m, m2, s) of a row: the moments, rescaled by sigma where they overflow.

    sigma comes from the elements the statistic reads (the first k; k = n for layer), so an
    infinity after them leaves the statistic as it is. SINGLE: ``x`` is the whole row in
    registers; else the row is read from X (and RES).
    """
    sigma = tl.full([], 1.0, tl.float32)
    if SINGLE:
        m, m2, s = _moments_block(x, cols, n, k, LAYER)
    else:
        m, m2, s = _moments_looped(X, RES, row_off, sigma, n, k, LAYER, RESIDUAL, BLOCK)
    if (s >= _INF) | (s != s):
        if SINGLE:
            amax = tl.max(tl.where(cols < k, tl.abs(x), 0.0), axis=0)
        else:
            amax = _absmax_looped(X, RES, row_off, k, RESIDUAL, BLOCK)
        if amax < _INF:
            sigma = _inv_pow2(amax)
            if SINGLE:
                m, m2, s = _moments_block(x * sigma, cols, n, k, LAYER)
            else:
                m, m2, s = _moments_looped(X, RES, row_off, sigma, n, k, LAYER, RESIDUAL, BLOCK)
    return sigma, m, m2, s


@triton.jit
def _normalized(xs, m, m2, rs, LAYER: tl.constexpr):
    if LAYER:
        return ((xs - m) - m2) * rs
    else:
        return xs * rs


@triton.jit
def _affine(y_hat, W, B, offs, mask, scale_offset, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
            BEFORE_SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    y = y_hat
    if BEFORE_SCALE:
        y = _round(y, OUT_DTYPE).to(tl.float32)
    if HAS_W:
        y = y * (tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) + scale_offset)
    if HAS_B:
        y = y + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    return _round(y, OUT_DTYPE)


@triton.jit
def _forward_kernel(
    X, RES, W, B, Y, H, R, n, k, eps, scale_offset,
    LAYER: tl.constexpr, OUTSIDE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BEFORE_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program: y (and h when RESIDUAL != 0), and r(s) into R."""
    row = tl.program_id(0)
    row_off = tl.cast(row, tl.int64) * n
    cols = tl.arange(0, BLOCK)
    out_dtype = Y.dtype.element_ty
    if SINGLE:
        mask = cols < n
        x = _load_row(X, RES, row_off + cols, mask, RESIDUAL)
        sigma, m, m2, s = _statistic(X, RES, row_off, x, cols, n, k, LAYER, RESIDUAL, SINGLE,
                                     BLOCK)
        rs = _rs(s, _eps_scaled(eps, sigma, OUTSIDE), OUTSIDE)
        y_hat = _normalized(x * sigma, m, m2, rs, LAYER)
        y = _affine(y_hat, W, B, cols, mask, scale_offset, HAS_W, HAS_B, BEFORE_SCALE, out_dtype)
        tl.store(Y + row_off + cols, y, mask=mask)
        if RESIDUAL != 0:
            tl.store(H + row_off + cols, _round(x, H.dtype.element_ty), mask=mask)
    else:
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        sigma, m, m2, s = _statistic(X, RES, row_off, zero, cols, n, k, LAYER, RESIDUAL, SINGLE,
                                     BLOCK)
        rs = _rs(s, _eps_scaled(eps, sigma, OUTSIDE), OUTSIDE)
        for start in range(0, n, BLOCK):
            offs = start + cols
            mask = offs < n
            x = _load_row(X, RES, row_off + offs, mask, RESIDUAL)
            y_hat = _normalized(x * sigma, m, m2, rs, LAYER)
            y = _affine(y_hat, W, B, offs, mask, scale_offset, HAS_W, HAS_B, BEFORE_SCALE,
                        out_dtype)
            tl.store(Y + row_off + offs, y, mask=mask)
            if RESIDUAL != 0:
                tl.store(H + row_off + offs, _round(x, H.dtype.element_ty), mask=mask)
    tl.store(R + row, sigma * rs)


@triton.jit
def _row_factors(X, RES, R, row, row_off, x, cols, n, k, eps, LAYER: tl.constexpr,
                 OUTSIDE: tl.constexpr, RESIDUAL: tl.constexpr, SINGLE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """(sigma, m, m2, rs, eps_s, u_sigma, u_m, u_m2, u_scale) of a row for the backward.

    eps outside's direction is ``u = ((x u_sigma - u_m) - u_m2) u_scale`` (``(x u_sigma)
    u_scale`` for RMS), ``c / sqrt(s)`` in the units of `_statistic`, or of ``x`` scaled by
    ``u_sigma`` where s is below `_TINY_S`. The saved r(s) is reused for RMS with eps inside,
    unless the row was rescaled.
    """
    if LAYER or OUTSIDE:
        sigma, m, m2, s = _statistic(X, RES, row_off, x, cols, n, k, LAYER, RESIDUAL, SINGLE,
                                     BLOCK)
        eps_s = _eps_scaled(eps, sigma, OUTSIDE)
        rs = _rs(s, eps_s, OUTSIDE)
    else:
        sigma = tl.full([], 1.0, tl.float32)
        m = tl.full([], 0.0, tl.float32)
        m2 = tl.full([], 0.0, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        eps_s = eps
        rs = tl.load(R + row)
        if (rs < _RESCALED_R) | (rs != rs):
            sigma, m, m2, s = _statistic(X, RES, row_off, x, cols, n, k, LAYER, RESIDUAL, SINGLE,
                                         BLOCK)
            eps_s = _eps_scaled(eps, sigma, OUTSIDE)
            rs = _rs(s, eps_s, OUTSIDE)
    u_sigma, u_m, u_m2, u_s = sigma, m, m2, s
    if OUTSIDE:
        if s < _TINY_S:
            if SINGLE:
                amax = tl.max(tl.where(cols < k, tl.abs(x), 0.0), axis=0)
            else:
                amax = _absmax_looped(X, RES, row_off, k, RESIDUAL, BLOCK)
            u_sigma = _inv_pow2(tl.maximum(amax, _MIN_NORMAL))
            if SINGLE:
                u_m, u_m2, u_s = _moments_block(x * u_sigma, cols, n, k, LAYER)
            else:
                u_m, u_m2, u_s = _moments_looped(X, RES, row_off, u_sigma, n, k, LAYER,
                                                 RESIDUAL, BLOCK)
    u_scale = tl.where(u_s > 0, tl.div_rn(1.0, tl.sqrt_rn(tl.where(u_s > 0, u_s, 1.0))), 0.0)
    return sigma, m, m2, rs, eps_s, u_sigma, u_m, u_m2, u_scale


@triton.jit
def _direction(x, y_hat, u_sigma, u_m, u_m2, u_scale, LAYER: tl.constexpr,
               OUTSIDE: tl.constexpr):
    """u of the backward: y_hat (inside) or c / sqrt(s) (outside, `_row_factors`)."""
    if OUTSIDE:
        return _normalized(x * u_sigma, u_m, u_m2, u_scale, LAYER)
    else:
        return y_hat


@triton.jit
def _dx_values(d, u, cols, sigma, rs, dot, mean_d, n, k, LAYER: tl.constexpr):
    if LAYER:
        return sigma * rs * (d - mean_d - u * (dot / n))
    else:
        return sigma * rs * (d - tl.where(cols < k, u * (dot / k), 0.0))


@triton.jit
def _dx_first(d0, xs0, rest, sigma, rs, eps_s, OUTSIDE: tl.constexpr):
    """dx_0 of partial RMS with k = 1, in the closed form free of cancellation."""
    if OUTSIDE:
        sign = tl.where(xs0 > 0, 1.0, tl.where(xs0 < 0, -1.0, 0.0))
        return sigma * rs * rs * (eps_s * d0 - sign * rest)
    else:
        return sigma * rs * rs * rs * (eps_s * d0 - xs0 * rest)


@triton.jit
def _backward_kernel(
    X, RES, R, DY, DH, W, DX, DW_PART, DB_PART, rows, n, k, eps, scale_offset,
    LAYER: tl.constexpr, OUTSIDE: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, HAS_DH: tl.constexpr, RESIDUAL: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Rows pid, pid + P, ...: dx into DX; this program's dw/db sums into row pid of the parts."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    part_off = pid.to(tl.int64) * n
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n
        g = tl.full([BLOCK], 1.0, tl.float32)
        if HAS_W:
            g = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + scale_offset
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, rows, programs):
            row_off = tl.cast(row, tl.int64) * n
            x = _load_row(X, RES, row_off + cols, mask, RESIDUAL)
            dy = tl.load(DY + row_off + cols, mask=mask, other=0.0).to(tl.float32)
            sigma, m, m2, rs, eps_s, u_sigma, u_m, u_m2, u_scale = _row_factors(
                X, RES, R, row, row_off, x, cols, n, k, eps, LAYER, OUTSIDE, RESIDUAL, SINGLE,
                BLOCK)
            xs = x * sigma
            c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
            y_hat = c * rs
            u = _direction(x, y_hat, u_sigma, u_m, u_m2, u_scale, LAYER, OUTSIDE)
            d = dy * g
            dot = tl.sum(d * c, axis=0) * rs
            mean_d = tl.sum(d, axis=0) / n if LAYER else 0.0
            dx = _dx_values(d, u, cols, sigma, rs, dot, mean_d, n, k, LAYER)
            if not LAYER:
                if k == 1:
                    d0 = tl.sum(tl.where(cols == 0, d, 0.0), axis=0)
                    xs0 = tl.sum(tl.where(cols == 0, xs, 0.0), axis=0)
                    rest = tl.sum(tl.where(cols >= 1, d * xs, 0.0), axis=0)
                    first = _dx_first(d0, xs0, rest, sigma, rs, eps_s, OUTSIDE)
                    dx = tl.where(cols == 0, first, dx)
            if HAS_DH:
                dx += tl.load(DH + row_off + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row_off + cols, _round(dx, DX.dtype.element_ty), mask=mask)
            dw_acc += dy * y_hat
            db_acc += dy
        if NEED_DW:
            tl.store(DW_PART + part_off + cols, dw_acc, mask=mask)
        if NEED_DB:
            tl.store(DB_PART + part_off + cols, db_acc, mask=mask)
    else:
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, rows, programs):
            row_off = tl.cast(row, tl.int64) * n
            sigma, m, m2, rs, eps_s, u_sigma, u_m, u_m2, u_scale = _row_factors(
                X, RES, R, row, row_off, zero, cols, n, k, eps, LAYER, OUTSIDE, RESIDUAL,
                SINGLE, BLOCK)
            acc_dot = tl.zeros([BLOCK], dtype=tl.float32)
            acc_d = tl.zeros([BLOCK], dtype=tl.float32)
            acc_rest = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + cols
                mask = offs < n
                xs = _load_row(X, RES, row_off + offs, mask, RESIDUAL) * sigma
                c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
                d = tl.load(DY + row_off + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    d *= tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) + scale_offset
                acc_dot += d * c
                if LAYER:
                    acc_d += d
                else:
                    acc_rest += tl.where(offs >= 1, d * c, 0.0)
            dot = tl.sum(acc_dot, axis=0) * rs
            mean_d = tl.sum(acc_d, axis=0) / n
            rest = tl.sum(acc_rest, axis=0)
            for start in range(0, n, BLOCK):
                offs = start + cols
                mask = offs < n
                x = _load_row(X, RES, row_off + offs, mask, RESIDUAL)
                xs = x * sigma
                c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
                y_hat = c * rs
                u = _direction(x, y_hat, u_sigma, u_m, u_m2, u_scale, LAYER, OUTSIDE)
                dy = tl.load(DY + row_off + offs, mask=mask, other=0.0).to(tl.float32)
                d = dy
                if HAS_W:
                    d = dy * (tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
                              + scale_offset)
                dx = _dx_values(d, u, offs, sigma, rs, dot, mean_d, n, k, LAYER)
                if not LAYER:
                    if k == 1:
                        d0 = tl.sum(tl.where(offs == 0, d, 0.0), axis=0)
                        xs0 = tl.sum(tl.where(offs == 0, xs, 0.0), axis=0)
                        first = _dx_first(d0, xs0, rest, sigma, rs, eps_s, OUTSIDE)
                        dx = tl.where(offs == 0, first, dx)
                if HAS_DH:
                    dx += tl.load(DH + row_off + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row_off + offs, _round(dx, DX.dtype.element_ty), mask=mask)
                if NEED_DW:
                    part = DW_PART + part_off + offs
                    tl.store(part, tl.load(part, mask=mask, other=0.0) + dy * y_hat, mask=mask)
                if NEED_DB:
                    part = DB_PART + part_off + offs
                    tl.store(part, tl.load(part, mask=mask, other=0.0) + dy, mask=mask)


@triton.jit
def _sum_parts_kernel(PART, OUT, parts, n, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[j] = sum over p of PART[p, j], in float32, rounded once to OUT's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, parts, BLOCK_P):
        p = start + lanes
        mask = (p[:, None] < parts) & (cols[None, :] < n)
        acc += tl.load(PART + p[:, None].to(tl.int64) * n + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, _round(tl.sum(acc, axis=0), OUT.dtype.element_ty), mask=cols < n)


def _launch_config(n: int) -> tuple[bool, int, int]:
    """(single, block, num_warps) for rows of n."""
    single = n <= MAX_FUSED_BLOCK
    block = triton.next_power_of_2(n) if single else LOOP_BLOCK
    num_warps = min(32, max(4, block // 512))
    return single, block, num_warps


def _programs(x: torch.Tensor, rows: int) -> int:
    """How many programs the backward runs: a few per multiprocessor on a GPU.

    Each takes at least two rows, so the (programs, n) float32 buffer of weight and bias
    partial sums is at most half the size of the rows in float32.
    """
    if x.device.type == "cuda":
        per_device = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        per_device = 4
    return max(1, min(rows // 2, per_device))


def _forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
    rounding: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, r): h is an empty tensor without a residual.

    ``rounding``: 0 without a residual, else 1 + the index of the rounding in
    `RESIDUAL_ROUNDINGS` (1 rounded, 2 float32, 3 float32_normalized).
    """
    rows, n = x.shape
    y = torch.empty_like(x)
    h_dtype = torch.float32 if rounding == 2 else x.dtype
    h = torch.empty((rows, n) if rounding else (0,), dtype=h_dtype, device=x.device)
    r = torch.empty((rows,), dtype=torch.float32, device=x.device)
    single, block, num_warps = _launch_config(n)
    if rows:
        wrap_triton(_forward_kernel)[(rows,)](
            x, x if residual is None else residual, x if weight is None else weight,
            x if bias is None else bias, y, y if not rounding else h, r, n, k, eps,
            scale_offset, LAYER=kind == "layer", OUTSIDE=outside, HAS_W=weight is not None,
            HAS_B=bias is not None,
            BEFORE_SCALE=cast == "before_scale" and x.dtype != torch.float32,
            RESIDUAL=rounding, SINGLE=single, BLOCK=block, num_warps=num_warps,
        )
    return y, h, r


def _sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    count, n = parts.shape
    out = torch.empty((n,), dtype=dtype, device=parts.device)
    block_n = min(triton.next_power_of_2(n), 256)
    wrap_triton(_sum_parts_kernel)[(triton.cdiv(n, block_n),)](
        parts, out, count, n, BLOCK_P=_PARTIAL_BLOCK, BLOCK_N=block_n,
    )
    return out


@triton_op("normkit::triton_norm_rows_backward", mutates_args={})
def _backward_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    r: torch.Tensor,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias_dtype: torch.dtype | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    rounding: int,
    dx_dtype: torch.dtype,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw and db are empty where not needed."""
    rows, n = x.shape
    dx = torch.empty((rows, n), dtype=dx_dtype, device=x.device)
    programs = _programs(x, rows)
    need_dw = need_dw and weight is not None
    need_db = need_db and bias_dtype is not None
    dw_part = torch.zeros((programs, n) if need_dw else (0,), dtype=torch.float32,
                          device=x.device)
    db_part = torch.zeros((programs, n) if need_db else (0,), dtype=torch.float32,
                          device=x.device)
    single, block, num_warps = _launch_config(n)
    if rows:
        wrap_triton(_backward_kernel)[(programs,)](
            x, x if residual is None else residual, r, dy, dy if dh is None else dh,
            x if weight is None else weight, dx, dw_part if need_dw else dx,
            db_part if need_db else dx, rows, n, k, eps, scale_offset,
            LAYER=kind == "layer", OUTSIDE=outside, HAS_W=weight is not None,
            NEED_DW=need_dw, NEED_DB=need_db, HAS_DH=dh is not None, RESIDUAL=rounding,
            SINGLE=single, BLOCK=block, num_warps=num_warps,
        )
    if need_dw and weight is not None:
        dw = _sum_parts(dw_part, weight.dtype)
    else:
        dw = torch.empty((0,), dtype=torch.float32, device=x.device)
    if need_db and bias_dtype is not None:
        db = _sum_parts(db_part, bias_dtype)
    else:
        db = torch.empty((0,), dtype=torch.float32, device=x.device)
    return dx, dw, db


@triton_op("normkit::triton_norm_rows", mutates_args={})
def _norm_rows_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): the rows normalized, and r(s) per row in float32."""
    y, _, r = _forward(x, None, weight, bias, kind, k, eps, outside, scale_offset, cast, 0)
    return y, r


@triton_op("normkit::triton_add_norm_rows", mutates_args={})
def _add_norm_rows_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
    rounding: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, r) for h = x + residual, rounded as ``rounding`` (1, 2, 3) says."""
    return _forward(x, residual, weight, bias, kind, k, eps, outside, scale_offset, cast,
                    rounding)


def _param_grads(
    ctx: Any, dw: torch.Tensor, db: torch.Tensor, first: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    need_w, need_b = ctx.needs_input_grad[first : first + 2]
    return (dw if need_w and ctx.has_w else None), (db if need_b and ctx.has_b else None)


def _setup_norm(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, bias, kind, k, eps, outside, scale_offset, _ = inputs
    ctx.save_for_backward(x, output[1], weight)
    ctx.mark_non_differentiable(output[1])
    ctx.options = (kind, k, eps, outside, scale_offset)
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward_norm(
    ctx: Any, dy: torch.Tensor, _dr: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    x, r, weight = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[1:3]
    dx, dw, db = _backward_op(
        x, None, r, dy.contiguous(), None, weight, ctx.bias_dtype, *ctx.options, 0, x.dtype,
        need_w, need_b,
    )
    grad_w, grad_b = _param_grads(ctx, dw, db, 1)
    return dx, grad_w, grad_b, None, None, None, None, None, None


def _setup_add_norm(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, residual, weight, bias, kind, k, eps, outside, scale_offset, _, rounding = inputs
    _, h, r = output
    # The float32_normalized rounding normalizes a sum it does not return: keep its terms.
    if rounding == 3:
        ctx.save_for_backward(x, residual, r, weight)
    else:
        ctx.save_for_backward(h, None, r, weight)
    ctx.mark_non_differentiable(r)
    ctx.options = (kind, k, eps, outside, scale_offset)
    ctx.rounding, ctx.dx_dtype = rounding, x.dtype
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward_add_norm(
    ctx: Any, dy: torch.Tensor, dh: torch.Tensor | None, _dr: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    x, residual, r, weight = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[2:4]
    rounding = 3 if ctx.rounding == 3 else 0
    dx, dw, db = _backward_op(
        x, residual, r, dy.contiguous(), None if dh is None else dh.contiguous(), weight,
        ctx.bias_dtype, *ctx.options, rounding, ctx.dx_dtype, need_w, need_b,
    )
    grad_w, grad_b = _param_grads(ctx, dw, db, 2)
    return dx, dx, grad_w, grad_b, None, None, None, None, None, None, None


_norm_rows_op.register_autograd(_backward_norm, setup_context=_setup_norm)
_add_norm_rows_op.register_autograd(_backward_add_norm, setup_context=_setup_add_norm)


def _check(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    k: int,
    cast: str,
    residual_rounding: str | None,
) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor (rows, n), got shape "
                         f"{tuple(x.shape)}{'' if x.is_contiguous() else ', not contiguous'}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; the Triton kernels take float16, bfloat16 or "
                        "float32 (float64 takes the composite path)")
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} is invalid: expected one of {_KINDS}")
    if cast not in _CASTS:
        raise ValueError(f"cast={cast!r} is invalid: expected one of {_CASTS}")
    n = x.shape[1]
    if not (1 <= k <= n) or (kind != "partial_rms" and k != n):
        raise ValueError(f"k={k} is invalid for kind={kind!r} on rows of n={n}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (n,) or p.dtype not in (torch.float32, x.dtype) or p.device != x.device:
            raise ValueError(
                f"{name} must have shape ({n},), dtype float32 or {x.dtype} and x's device; "
                f"got shape {tuple(p.shape)}, {p.dtype} on {p.device}"
            )
    if residual is None:
        return
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(
            f"residual must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got shape {tuple(residual.shape)}, {residual.dtype}"
        )
    if residual_rounding not in RESIDUAL_ROUNDINGS:
        raise ValueError(
            f"residual_rounding={residual_rounding!r} is invalid: expected one of "
            f"{RESIDUAL_ROUNDINGS}"
        )
    if _degenerate(kind, n):
        raise ValueError(
            f"kind='layer' on rows of n={n} (n <= 2) has no fused residual kernel: "
            "add the residual and normalize with the composite path"
        )


def _degenerate(kind: str, n: int) -> bool:
    """LayerNorm rows of n <= 2, whose gradient the composite path computes in float64."""
    return kind == "layer" and n <= 2


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
    residual_rounding: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, h)`` of `norm_rows` (h None) or `add_norm_rows`: the checks, then the op."""
    _check(x, residual, weight, bias, kind, k, cast, residual_rounding)
    if residual is not None:
        assert residual_rounding is not None
        rounding = RESIDUAL_ROUNDINGS.index(residual_rounding) + 1
        y, h, _ = _add_norm_rows_op(
            x, residual, weight, bias, kind, k, eps, outside, scale_offset, cast, rounding
        )
        return y, h
    if _degenerate(kind, x.shape[1]):
        g = None if weight is None else weight.float() + scale_offset
        b = None if bias is None else bias.float()
        y, _ = NormFunction.apply(x, g, b, kind, k, eps, outside, cast)
        return y, None
    y, _ = _norm_rows_op(x, weight, bias, kind, k, eps, outside, scale_offset, cast)
    return y, None


def norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
) -> torch.Tensor:
    """``normkit.reference.normalize`` on rows ``x`` (rows, n), differentiable; y in x's dtype.

    ``weight``/``bias``: (n,) in float32 or x's dtype, or None; the effective scale is
    ``scale_offset + float32(weight)``. LayerNorm rows of n <= 2 take the composite path.
    """
    y, _ = _launch(x, None, weight, bias, kind, k, eps, outside, scale_offset, cast, None)
    return y


def add_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    cast: str,
    residual_rounding: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` with ``h = x + residual`` and ``y`` = `norm_rows` of h, as rounded:

    - ``"rounded"``: h rounded to x's dtype, and that h normalized and returned;
    - ``"float32"``: h kept in float32, normalized, and returned in float32;
    - ``"float32_normalized"``: the float32 h normalized, h returned rounded to x's dtype.

    The half-precision cast order and y's dtype follow x's dtype. ``residual`` has x's shape
    and dtype. Gradients: dx = dresidual = (the norm's gradient at h) + dh.
    """
    y, h = _launch(x, residual, weight, bias, kind, k, eps, outside, scale_offset, cast,
                   residual_rounding)
    assert h is not None
    return y, h
