"""The fused Triton backward of `normkit.torch.kernels.triton`: one persistent kernel and one
sum of the weight and bias gradients, for every option the kernels compute.

Experimental and opt-in: ``NORMKIT_TRITON_BACKWARD=fused`` (read once, at import) makes
``triton._backward_rows`` call `backward_rows` (same arguments and results). It has run in
Triton's interpreter only; a GPU run of ``scripts/triton_sweep.py --only backward`` compares
it with the default backward (docs/triton.md).

The math is the default backward's (the module docstring of `normkit.torch.kernels.triton`),
with the same guards; what changes is how a program walks its rows:

- **Persistent.** A few programs per multiprocessor, each taking the (sub-)rows ``first,
  first + P, ...`` of one group of one slice of columns, and loading its next row's inputs
  while it computes the current one (``PREFETCH``).
- **Rows held in registers.** A program holds ``SLICE`` columns of its row (the whole
  (sub-)row up to `SLICE_MAX` elements). A longer row is cut into ``SPLIT`` slices, each
  with its own program; each of them reads the other slices to take the row's sums (in the
  same order, so that all get the same sums) and computes dx and the weight and bias sums of
  its own slice only. No partial row goes through memory per row.
- **Fewer reductions.** The backward reuses the saved ``r(s)`` (as the default backward does for
  RMS with eps inside), so the sums of a row are taken in one pass: RMS ``sum(d y_hat)`` (and
  ``sum(x^2)`` outside, for ``x / sqrt(s)``), LayerNorm the mean, then ``sum(c0)``, ``sum(d)``,
  ``sum(d c0 r)`` (``sum(c0^2)`` outside) together, with ``sum(d y_hat) = sum(d c0 r) - m2 r
  sum(d)``. A row whose saved r(s) says it was rescaled (or holds a NaN), or whose statistic
  leaves float32's range, takes the default backward's careful path: the moments again,
  rescaled, then ``sum(d y_hat)``.
- **One deterministic sum of the weight and bias gradients.** Each program stores its sums in
  a float32 (P / (groups x SPLIT), n x [dw, db]) buffer; one launch sums its columns, many
  programs wide, in a fixed order, and rounds them once. No atomics: the same inputs on the
  same GPU give the same bits.

The helpers it shares with triton.py's kernels are in `normkit.torch.kernels._triton_rows`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as error:
    raise ImportError(
        f"normkit's Triton kernels need triton and torch>=2.6 ({error}): "
        "pip install normkit[triton]"
    ) from error

from normkit.torch.kernels._triton_rows import (
    _FLT_MAX,
    _MIN_NORMAL,
    _RESCALED_R,
    _TINY_S,
    _activation,
    _column_sums_kernel,
    _dx_first,
    _dx_values,
    _eps_scaled,
    _float32_scalars,
    _inv_pow2,
    _round,
    _rs,
)

__all__ = ["FUSED", "SLICE_MAX", "Config", "backward_rows", "config"]

_VARIABLE = "NORMKIT_TRITON_BACKWARD"


def _selected(value: str) -> bool:
    """Whether ``value`` of NORMKIT_TRITON_BACKWARD selects this backward; ValueError when it
    names none."""
    if value not in ("", "fused"):
        raise ValueError(f"{_VARIABLE}={value!r} is invalid: expected 'fused' (this module's "
                         "backward) or unset (the default backward)")
    return value == "fused"


FUSED: bool = _selected(os.environ.get(_VARIABLE, ""))
"""NORMKIT_TRITON_BACKWARD=fused at import: ``triton._backward_rows`` calls `backward_rows`."""

SLICE_MAX = 8192
"""The most columns of a row one program holds; a longer (sub-)row is cut into slices."""

# What `_terms` computes: the mean's terms, the one-pass sums, the careful path's centered
# moments, and its sum of d y_hat.
_MEAN: tl.constexpr = tl.constexpr(0)
_FAST: tl.constexpr = tl.constexpr(1)
_CENTERED: tl.constexpr = tl.constexpr(2)
_DOT: tl.constexpr = tl.constexpr(3)


@triton.jit
def _add1(a0, b0):
    return a0 + b0


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _row_inputs(X, RES, Z, DY, offs, mask, RESIDUAL: tl.constexpr, GATED: tl.constexpr):
    """(x, residual, z, dy) of a slice of a sub-row as stored; x stands for the absent ones."""
    x = tl.load(X + offs, mask=mask, other=0.0)
    res = x
    if RESIDUAL != 0:
        res = tl.load(RES + offs, mask=mask, other=0.0)
    z = x
    if GATED:
        z = tl.load(Z + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    return x, res, z, dy


@triton.jit
def _inputs(X, RES, Z, DY, DH, R, offs, cols, n, sub, live, RESIDUAL: tl.constexpr,
            GATED: tl.constexpr, HAS_DH: tl.constexpr):
    """`_row_inputs` of columns ``cols`` (those below n), dh (dy where absent) and the saved
    r(s); nothing is read where ``live`` is false (the row after a program's last)."""
    live_mask = cols < tl.where(live, n, 0)  # not mask & live: the interpreter's is int32
    x, res, z, dy = _row_inputs(X, RES, Z, DY, offs, live_mask, RESIDUAL, GATED)
    dh = dy
    if HAS_DH:
        dh = tl.load(DH + offs, mask=live_mask, other=0.0)
    r = tl.load(R + sub, mask=live, other=1.0)
    return x, res, z, dy, dh, r


@triton.jit
def _values(x, res, z, dy, g, X_DTYPE: tl.constexpr, RESIDUAL: tl.constexpr,
            GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr):
    """(h, v, a_in, a_in', a_out', dy, dy_u, d) in float32: h = x (+ residual, rounded as
    RESIDUAL says), v = h a_in(z) the values normalized, dy_u = dy a_out(z), d = dy_u g."""
    h = x.to(tl.float32)
    if RESIDUAL != 0:
        h += res.to(tl.float32)
        if RESIDUAL == 1:
            h = _round(h, X_DTYPE).to(tl.float32)
    a_in, slope_in, a_out, slope_out = 1.0, 0.0, 1.0, 0.0
    if GATE_IN != "none":
        a_in, slope_in = _activation(z.to(tl.float32), GATE_IN)
    if GATE_OUT != "none":
        a_out, slope_out = _activation(z.to(tl.float32), GATE_OUT)
    dyf = dy.to(tl.float32)
    dy_u = dyf * a_out
    return h, h * a_in, a_in, slope_in, slope_out, dyf, dy_u, dy_u * g


@triton.jit
def _slice_values(v, d, j, part, X, RES, Z, DY, W, row_off, g_off, n, scale_offset,
                  X_DTYPE: tl.constexpr, HAS_W: tl.constexpr, RESIDUAL: tl.constexpr,
                  GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr, SPLIT: tl.constexpr,
                  SLICE: tl.constexpr):
    """(v, d, columns, mask) of slice ``j`` of the sub-row: this program's own (``v``, ``d``)
    when ``j == part`` (always when SPLIT is 1), else read from memory."""
    cols = j * SLICE + tl.arange(0, SLICE)
    mask = cols < n
    if SPLIT == 1:
        vj = v
        dj = d
    elif j == part:
        vj = v
        dj = d
    else:
        gated: tl.constexpr = GATE_IN != "none" or GATE_OUT != "none"
        x, res, z, dy = _row_inputs(X, RES, Z, DY, row_off + g_off + cols, mask, RESIDUAL, gated)
        g = 1.0
        if HAS_W:
            g = tl.load(W + g_off + cols, mask=mask, other=0.0).to(tl.float32) + scale_offset
        _, vj, _, _, _, _, _, dj = _values(x, res, z, dy, g, X_DTYPE, RESIDUAL, GATE_IN,
                                           GATE_OUT)
    return vj, dj, cols, mask


@triton.jit
def _terms(v, d, cols, mask, k, sigma, m, m2, r, WHAT: tl.constexpr, LAYER: tl.constexpr,
           PARTIAL: tl.constexpr):
    """Four per-element terms of a row's sums (`_row_sums`), ``xs = v sigma``:

    _MEAN:      xs
    _FAST:      layer (c0, d, d (c0 r), c0^2) with c0 = v - m; RMS (d (v r), [i < k] v^2)
    _CENTERED:  layer (c0, c0^2) with c0 = xs - m; RMS [i < k] xs^2
    _DOT:       d y_hat with y_hat = ((xs - m) - m2) r (layer) or xs r

    RMS's d y_hat leaves out element 0 when k = 1 (PARTIAL): its sum is the closed form's."""
    zero = tl.zeros_like(v)
    t0, t1, t2, t3 = zero, zero, zero, zero
    if WHAT == _MEAN:
        t0 = v * sigma
    elif WHAT == _CENTERED:
        xs = v * sigma
        if LAYER:
            t0 = tl.where(mask, xs - m, 0.0)
            t1 = t0 * t0
        else:
            t0 = tl.where(cols < k, xs * xs, 0.0)
    elif LAYER:
        if WHAT == _FAST:
            t0 = tl.where(mask, v - m, 0.0)
            t1 = d
            t2 = d * (t0 * r)
            t3 = t0 * t0
        else:
            t0 = d * (tl.where(mask, (v * sigma - m) - m2, 0.0) * r)
    else:
        t0 = d * ((v * sigma) * r)
        if PARTIAL:
            t0 = tl.where((cols >= 1) | (k > 1), t0, 0.0)
        if WHAT == _FAST:
            t1 = tl.where(cols < k, v * v, 0.0)
    return t0, t1, t2, t3


@triton.jit
def _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k, scale_offset, sigma, m, m2, r,
              WHAT: tl.constexpr, SUMS: tl.constexpr, X_DTYPE: tl.constexpr,
              LAYER: tl.constexpr, PARTIAL: tl.constexpr, HAS_W: tl.constexpr,
              RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr,
              SPLIT: tl.constexpr, SLICE: tl.constexpr):
    """The sums over the sub-row of the first SUMS of `_terms`' four (the rest 0): one
    reduction of them all per slice, the slices' sums added in their order (the same in each
    program of the row; and no per-lane sums held while the other slices are read)."""
    s0 = tl.full([], 0.0, tl.float32)
    s1, s2, s3 = s0, s0, s0
    for j in tl.static_range(SPLIT):
        vj, dj, cols, mask = _slice_values(v, d, j, part, X, RES, Z, DY, W, row_off, g_off, n,
                                           scale_offset, X_DTYPE, HAS_W, RESIDUAL, GATE_IN,
                                           GATE_OUT, SPLIT, SLICE)
        t0, t1, t2, t3 = _terms(vj, dj, cols, mask, k, sigma, m, m2, r, WHAT, LAYER, PARTIAL)
        if SUMS == 1:
            s0 += tl.reduce(t0, 0, _add1)
        elif SUMS == 2:
            u0, u1 = tl.reduce((t0, t1), 0, _add2)
            s0, s1 = s0 + u0, s1 + u1
        elif SUMS == 3:
            u0, u1, u2 = tl.reduce((t0, t1, t2), 0, _add3)
            s0, s1, s2 = s0 + u0, s1 + u1, s2 + u2
        else:
            u0, u1, u2, u3 = tl.reduce((t0, t1, t2, t3), 0, _add4)
            s0, s1, s2, s3 = s0 + u0, s1 + u1, s2 + u2, s3 + u3
    return s0, s1, s2, s3


@triton.jit
def _row_absmax(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k, scale_offset,
                X_DTYPE: tl.constexpr, HAS_W: tl.constexpr, RESIDUAL: tl.constexpr,
                GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr, SPLIT: tl.constexpr,
                SLICE: tl.constexpr):
    """max |v| over the first k elements of the sub-row, those the statistic reads."""
    amax = tl.full([], 0.0, tl.float32)
    for j in tl.static_range(SPLIT):
        vj, _, cols, _ = _slice_values(v, d, j, part, X, RES, Z, DY, W, row_off, g_off, n,
                                       scale_offset, X_DTYPE, HAS_W, RESIDUAL, GATE_IN,
                                       GATE_OUT, SPLIT, SLICE)
        amax = tl.maximum(amax, tl.max(tl.where(cols < k, tl.abs(vj), 0.0), axis=0))
    return amax


@triton.jit
def _moments(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k, scale_offset, sigma,
             X_DTYPE: tl.constexpr, LAYER: tl.constexpr, HAS_W: tl.constexpr,
             RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr,
             SPLIT: tl.constexpr, SLICE: tl.constexpr):
    """(m, m2, s) of the sub-row scaled by sigma, in two passes for LayerNorm (triton.py's
    `_moments_block`)."""
    zero = tl.full([], 0.0, tl.float32)
    m = zero
    if LAYER:
        total, _, _, _ = _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                   scale_offset, sigma, zero, zero, zero, _MEAN, 1, X_DTYPE,
                                   LAYER, False, HAS_W, RESIDUAL, GATE_IN, GATE_OUT, SPLIT,
                                   SLICE)
        m = total / n
        centered, squares, _, _ = _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                            scale_offset, sigma, m, zero, zero, _CENTERED, 2,
                                            X_DTYPE, LAYER, False, HAS_W, RESIDUAL, GATE_IN,
                                            GATE_OUT, SPLIT, SLICE)
        m2 = centered / n
        s = (squares - centered * m2) / n
        s = tl.where(s < 0.0, 0.0, s)  # not tl.maximum, which drops a NaN
    else:
        m2 = zero
        squares, _, _, _ = _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                     scale_offset, sigma, zero, zero, zero, _CENTERED, 1,
                                     X_DTYPE, LAYER, False, HAS_W, RESIDUAL, GATE_IN, GATE_OUT,
                                     SPLIT, SLICE)
        s = squares / k
    return m, m2, s


@triton.jit
def _backward_kernel(
    X, RES, Z, R, DY, DH, W, B, DX, DZ, PART, rows, n, k, groups, eps, scale_offset,
    LAYER: tl.constexpr, OUTSIDE: tl.constexpr, PARTIAL: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, HAS_DH: tl.constexpr,
    RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr,
    SPLIT: tl.constexpr, SLICE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Program pid takes slice ``part`` of group ``group_index`` of the rows ``first, first +
    stride, ...`` (``groups x SPLIT`` programs per row position): dx (dz with a gate) of its
    slice, and its slice's weight and bias sums at row ``first`` of PART. ``n`` is the group's
    size (the row's without groups), ``k`` the statistic's; RES, Z, DH, W and B are read only
    where their flags say (B for dz of GATE_OUT)."""
    tl.static_assert(RESIDUAL == 0 or GATE_IN == "none", "h is not v = h a(z): no residual")
    eps, scale_offset = _float32_scalars(eps, scale_offset)
    gated: tl.constexpr = GATE_IN != "none" or GATE_OUT != "none"
    x_dtype: tl.constexpr = X.dtype.element_ty
    pid = tl.program_id(0)
    units = groups * SPLIT
    unit = pid % units
    part = unit % SPLIT
    group_index = unit // SPLIT
    g_off = group_index * n
    first = pid // units
    stride = tl.num_programs(0) // units
    row_len = groups * n
    cols = part * SLICE + tl.arange(0, SLICE)
    mask = cols < n
    pcols = g_off + cols
    dw_acc = tl.zeros([SLICE], dtype=tl.float32)
    db_acc = tl.zeros([SLICE], dtype=tl.float32)
    zero = tl.full([], 0.0, tl.float32)
    if PREFETCH:
        next_x, next_res, next_z, next_dy, next_dh, next_r = _inputs(
            X, RES, Z, DY, DH, R, tl.cast(first, tl.int64) * row_len + pcols, cols, n,
            first * groups + group_index, first < rows, RESIDUAL, gated, HAS_DH)
    for row in range(first, rows, stride):
        row_off = tl.cast(row, tl.int64) * row_len
        sub = row * groups + group_index
        if PREFETCH:
            x, res, z, dy, dh, r = next_x, next_res, next_z, next_dy, next_dh, next_r
            next_off = row_off + tl.cast(stride, tl.int64) * row_len
            next_x, next_res, next_z, next_dy, next_dh, next_r = _inputs(
                X, RES, Z, DY, DH, R, next_off + pcols, cols, n, sub + stride * groups,
                row + stride < rows, RESIDUAL, gated, HAS_DH)
        else:
            x, res, z, dy, dh, r = _inputs(X, RES, Z, DY, DH, R, row_off + pcols, cols, n, sub,
                                           row < rows, RESIDUAL, gated, HAS_DH)
        # The parameters are read again for each row (from the cache), not held in registers.
        g = 1.0
        if HAS_W:
            g = tl.load(W + pcols, mask=mask, other=0.0).to(tl.float32) + scale_offset
        h, v, a_in, slope_in, slope_out, dyf, dy_u, d = _values(
            x, res, z, dy, g, x_dtype, RESIDUAL, GATE_IN, GATE_OUT)

        # The row's factors from one pass of sums, with the saved r(s) as rs.
        sigma = tl.full([], 1.0, tl.float32)
        rs = r
        eps_s = eps
        m, m2, s, mean_d = zero, zero, zero, zero
        if LAYER:
            total, _, _, _ = _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                       scale_offset, sigma, zero, zero, zero, _MEAN, 1, x_dtype,
                                       LAYER, PARTIAL, HAS_W, RESIDUAL, GATE_IN, GATE_OUT,
                                       SPLIT, SLICE)
            m = total / n
            centered, sum_d, dot, squares = _row_sums(
                v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k, scale_offset, sigma, m,
                zero, r, _FAST, 4 if OUTSIDE else 3, x_dtype, LAYER, PARTIAL, HAS_W, RESIDUAL,
                GATE_IN, GATE_OUT, SPLIT, SLICE)
            m2 = centered / n
            mean_d = sum_d / n
            dot = dot - (m2 * r) * sum_d
            s = (squares - centered * m2) / n
            s = tl.where(s < 0.0, 0.0, s)
        else:
            dot, squares, _, _ = _row_sums(
                v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k, scale_offset, sigma, zero,
                zero, r, _FAST, 2 if OUTSIDE else 1, x_dtype, LAYER, PARTIAL, HAS_W, RESIDUAL,
                GATE_IN, GATE_OUT, SPLIT, SLICE)
            s = squares / k
        careful = (r < _RESCALED_R) | (r != r)
        if OUTSIDE:
            careful = careful | (s > _FLT_MAX) | (s != s)
        if careful:
            # The default backward's path: the moments again, rescaled where they overflow.
            m, m2, s = _moments(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                scale_offset, sigma, x_dtype, LAYER, HAS_W, RESIDUAL, GATE_IN,
                                GATE_OUT, SPLIT, SLICE)
            if (s > _FLT_MAX) | (s != s):
                amax = _row_absmax(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                   scale_offset, x_dtype, HAS_W, RESIDUAL, GATE_IN, GATE_OUT,
                                   SPLIT, SLICE)
                if amax <= _FLT_MAX:
                    sigma = _inv_pow2(amax)
                    m, m2, s = _moments(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                        scale_offset, sigma, x_dtype, LAYER, HAS_W, RESIDUAL,
                                        GATE_IN, GATE_OUT, SPLIT, SLICE)
            eps_s = _eps_scaled(eps, sigma, OUTSIDE)
            rs = _rs(s, eps_s, OUTSIDE)
            dot, _, _, _ = _row_sums(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                     scale_offset, sigma, m, m2, rs, _DOT, 1, x_dtype, LAYER,
                                     PARTIAL, HAS_W, RESIDUAL, GATE_IN, GATE_OUT, SPLIT, SLICE)
        # eps outside's direction q = c / sqrt(s), from the row rescaled where s may have
        # underflowed.
        q_sigma, q_m, q_m2, q_s = sigma, m, m2, s
        if OUTSIDE:
            if s < _TINY_S:
                amax = _row_absmax(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                   scale_offset, x_dtype, HAS_W, RESIDUAL, GATE_IN, GATE_OUT,
                                   SPLIT, SLICE)
                q_sigma = _inv_pow2(tl.maximum(amax, _MIN_NORMAL))
                q_m, q_m2, q_s = _moments(v, d, part, X, RES, Z, DY, W, row_off, g_off, n, k,
                                          scale_offset, q_sigma, x_dtype, LAYER, HAS_W,
                                          RESIDUAL, GATE_IN, GATE_OUT, SPLIT, SLICE)
        q_scale = tl.where(q_s > 0, tl.div_rn(1.0, tl.sqrt_rn(tl.where(q_s > 0, q_s, 1.0))), 0.0)

        # This slice's gradients.
        if LAYER:
            y_hat = tl.where(mask, (v * sigma - m) - m2, 0.0) * rs
        else:
            y_hat = (v * sigma) * rs
        q = y_hat
        if OUTSIDE:
            if LAYER:
                q = tl.where(mask, (v * q_sigma - q_m) - q_m2, 0.0) * q_scale
            else:
                q = (v * q_sigma) * q_scale
        e = _dx_values(d, q, cols, sigma, rs, dot, mean_d, n, k, LAYER, PARTIAL)
        if PARTIAL:
            if k == 1:
                d0, y0 = tl.reduce((tl.where(cols == 0, d, 0.0), tl.where(cols == 0, y_hat, 0.0)),
                                   0, _add2)
                e = tl.where(cols == 0, _dx_first(d0, y0, dot, sigma, rs, eps_s, OUTSIDE), e)
        offs = row_off + pcols
        if GATE_IN != "none":
            tl.store(DZ + offs, _round(e * h * slope_in, DZ.dtype.element_ty), mask=mask)
        if GATE_OUT != "none":
            u = y_hat * g
            if HAS_B:
                u += tl.load(B + pcols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DZ + offs, _round(dyf * u * slope_out, DZ.dtype.element_ty), mask=mask)
        dx = e * a_in
        if HAS_DH:
            dx += dh.to(tl.float32)
        tl.store(DX + offs, _round(dx, DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += dy_u * y_hat
        if NEED_DB:
            db_acc += dy_u
    if NEED_DW and NEED_DB:
        part_row = PART + tl.cast(first, tl.int64) * (2 * row_len) + pcols
        tl.store(part_row, dw_acc, mask=mask)
        tl.store(part_row + row_len, db_acc, mask=mask)
    elif NEED_DW or NEED_DB:
        part_row = PART + tl.cast(first, tl.int64) * row_len + pcols
        tl.store(part_row, dw_acc if NEED_DW else db_acc, mask=mask)


class Config(NamedTuple):
    """How the backward kernel is launched on (sub-)rows of ``n`` (`config`)."""

    slice: int
    """Columns of a row held per program (a power of two)."""
    split: int
    """Slices per (sub-)row: ``cdiv(n, slice)``."""
    num_warps: int
    per_sm: int
    """Programs per multiprocessor."""
    prefetch: bool = True
    """Whether a program loads its next row while it computes the current one."""

    @property
    def max_registers(self) -> int:
        """Registers per thread that let ``per_sm`` programs reside on a multiprocessor at once
        (65536 each, the same on every NVIDIA GPU since Kepler), so that the persistent grid
        runs in one wave."""
        return min(255, 65536 // (32 * self.num_warps * self.per_sm) // 8 * 8)


def config(n: int, x_bytes: int, slice_max: int | None = None) -> Config:
    """The launch configuration for (sub-)rows of ``n`` elements of ``x_bytes`` each, slices
    of at most ``slice_max`` columns (`SLICE_MAX` by default).

    16 elements per thread (a slice of 512 per warp, 16 warps at most), which ptxas fits in
    128 registers for half inputs; 16 warps per multiprocessor for half inputs, 8 for float32
    (whose rows take twice the registers), for all kinds. A row longer than ``slice_max`` is
    cut into slices of equal power-of-two size.
    """
    split = triton.cdiv(n, SLICE_MAX if slice_max is None else slice_max)
    slice_ = triton.next_power_of_2(triton.cdiv(n, split))
    num_warps = max(1, min(16, slice_ // 512))
    warps_per_sm = 16 if x_bytes <= 2 else 8
    return Config(slice_, split, num_warps, max(1, warps_per_sm // num_warps))


_INTERPRETED_PROGRAMS = 3
"""Programs per slice of a row in Triton's interpreter (CPU tensors): each takes a few rows."""


@functools.lru_cache(maxsize=16)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_per_slice(device: torch.device, chosen: Config, units: int, rows: int) -> int:
    """How many programs take each slice of each group: ``per_sm`` on each multiprocessor,
    shared by the ``units`` slices of a row, at most one per row."""
    if device.type != "cuda":
        return min(rows, _INTERPRETED_PROGRAMS)
    return max(1, min(rows, chosen.per_sm * _sms(device) // units))


def _direct(kernel: Any) -> Any:
    return kernel


def backward_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    r: torch.Tensor,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_dtype: torch.dtype | None,
    kind: str,
    k: int,
    eps: float,
    outside: bool,
    scale_offset: float,
    group: int,
    gate_in: str,
    gate_out: str,
    rounding: int,
    dx_dtype: torch.dtype,
    need_dw: bool,
    need_db: bool,
    *,
    launch: Callable[[Any], Any] = _direct,
    launch_config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triton._backward_rows``: (dx, dz, dw, db) of `norm_rows` / `add_norm_rows` on rows
    ``x`` (rows, n) given dy (and dh), with the same arguments; dz is empty without a gate, dw
    and db where not needed.

    ``launch``: how a kernel is launched (``triton._launcher(x)``: through ``wrap_triton``
    where traced, which is given no register limit); ``launch_config``: `config`'s by default
    (another, to measure).
    """
    rows, n = x.shape
    groups = n // group
    device = x.device
    dx = torch.empty((rows, n), dtype=dx_dtype, device=device)
    dz = torch.empty((0,) if gate is None else (rows, n),
                     dtype=dx_dtype if gate is None else gate.dtype, device=device)
    need_dw = need_dw and weight is not None
    need_db = need_db and bias_dtype is not None
    dw = _parameter_gradient(need_dw, None if weight is None else weight.dtype, n, rows, device)
    db = _parameter_gradient(need_db, bias_dtype, n, rows, device)
    if not rows:
        return dx, dz, dw, db
    chosen = launch_config or config(group, x.element_size())
    units = groups * chosen.split
    per_unit = _programs_per_slice(device, chosen, units, rows)
    registers = {} if launch is wrap_triton else {"maxnreg": chosen.max_registers}
    sums = int(need_dw) + int(need_db)
    part = torch.empty((per_unit, n * sums), dtype=torch.float32, device=device) if sums else dx
    launch(_backward_kernel)[(units * per_unit,)](
        x, x if residual is None else residual, x if gate is None else gate, r, dy,
        dy if dh is None else dh, x if weight is None else weight,
        x if bias is None else bias, dx, dx if gate is None else dz, part, rows, group, k,
        groups, eps, scale_offset, LAYER=kind == "layer", OUTSIDE=outside,
        PARTIAL=kind != "layer" and (k < group or k == 1), HAS_W=weight is not None,
        HAS_B=bias is not None, NEED_DW=need_dw, NEED_DB=need_db, HAS_DH=dh is not None,
        RESIDUAL=rounding, GATE_IN=gate_in, GATE_OUT=gate_out, SPLIT=chosen.split,
        SLICE=chosen.slice, PREFETCH=chosen.prefetch, num_warps=chosen.num_warps, **registers,
    )
    if sums:
        _sum_columns(part, dw if need_dw else db, db if need_db else dw, n, need_dw, launch)
    return dx, dz, dw, db


def _parameter_gradient(needed: bool, dtype: torch.dtype | None, n: int, rows: int,
                        device: torch.device) -> torch.Tensor:
    """dw or db, (n,) in the parameter's dtype (zeros without rows); an empty float32 tensor
    where not needed. Each call makes a tensor of its own: a custom op's outputs may not alias."""
    if not needed or dtype is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return (torch.empty if rows else torch.zeros)((n,), dtype=dtype, device=device)


def _sum_columns(part: torch.Tensor, dw: torch.Tensor, db: torch.Tensor, n: int, has_dw: bool,
                 launch: Callable[[Any], Any]) -> None:
    """dw (and db) from the (parts, width) float32 sums: many programs, each a few columns
    of every part in one load where it can."""
    parts, width = part.shape
    if part.device.type == "cuda":  # a program per multiprocessor or more, 8 to 128 columns each
        per_sm = width // _sms(part.device)
        block_n = max(8, min(128, 1 << max(0, per_sm.bit_length() - 1)))
    else:  # one program in the interpreter
        block_n = triton.next_power_of_2(width)
    block_p = max(1, min(triton.next_power_of_2(parts), 16384 // block_n))
    launch(_column_sums_kernel)[(triton.cdiv(width, block_n),)](
        part, dw, db, parts, n, width, HAS_DW=has_dw, BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=8 if block_p * block_n >= 8192 else 4,
    )
