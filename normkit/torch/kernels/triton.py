"""Triton kernels for every `NormSpec` kind and option, forward and backward, on rows.

`norm_rows` computes ``normkit.reference.normalize`` (``gated_normalize`` with a gate) on rows
``x`` of shape (rows, n); `add_norm_rows` first adds a residual (``h = x + residual``, rounded as
``residual_rounding`` says) and returns ``(y, h)``. Both are differentiable through one torch
custom op (`torch.library.triton_op`), so ``torch.compile(fullgraph=True)`` traces through them
and CUDA graphs can capture them. With ``TRITON_INTERPRET=1`` set before triton is imported,
the same kernels run on CPU tensors.

The kernels work on sub-rows: the groups of ``group`` contiguous elements (the whole row
without groups), each with its own statistic and saved r(s), reading the weight and bias at
its group's offset in the row. Per sub-row, in float32 (``sigma`` is 1 except on sub-rows whose
statistic overflows float32, where it is the power of two that brings ``max|v|`` into [2, 4);
``xs = sigma v``, ``v = x a(z)`` with gate="before", else x)::

    rms, partial_rms:  c = xs                       s = sum(c[:k] ** 2) / k
    layer:             c = (xs - m) - m2            s = (sum(c0 ** 2) - sum(c0) m2) / n
                       (m = sum(xs) / n, c0 = xs - m, m2 = sum(c0) / n: two passes and a
                       correction, so a large mean costs no precision)
    rs = 1 / sqrt(s + eps sigma^2)   or   1 / (sqrt(s) + eps sigma)     r(s) = sigma rs
    y_hat = c rs,  u = y_hat (scale_offset + w) + b   (y_hat rounded first with "before_scale")
    y = u a(z)  with gate="after" (u rounded first with ``round_affine``),  else y = u

with ``a(z) = silu(z) = z sigmoid(z)`` or ``sigmoid(z)``. Backward, with ``dy_u = dy a(z)``
(gate="after", else dy), ``d = dy_u (scale_offset + w)`` and ``q = y_hat`` (inside) or
``c / sqrt(s)`` (outside, 0 where s = 0; scale-free, so a sub-row whose s is below ``2**-103``,
where its squares may have underflowed, takes it from ``v`` scaled by the power of two that
brings ``max|v|`` into [2, 4), or by ``2**127`` where ``max|v|`` is subnormal)::

    rms, partial_rms:  e = sigma rs (d - [i < k] q sum(d y_hat) / k)
    layer:             e = sigma rs (d - mean(d) - q sum(d y_hat) / n)
    k = 1, element 0:  e_0 = sigma rs^3 (eps sigma^2 d_0 - xs_0 T)    (inside)
                       e_0 = sigma rs^2 (eps sigma d_0 - sign(xs_0) T)  (outside)
                       with T = sum_{j >= 1} xs_j d_j, free of cancellation
    gate="before":     dx = e a(z),  dz = e x a'(z)
    gate="after":      dx = e,       dz = dy (y_hat (scale_offset + w) + b) a'(z)
    dw = sum over rows of dy_u y_hat,  db = sum over rows of dy_u

Sub-rows up to `MAX_FUSED_BLOCK` elements (half of it in the backward) are held whole by one
program; longer ones loop over blocks of `LOOP_BLOCK` (each lane of a block accumulates its own
sum, then a tree reduction).
Weight and bias gradients are summed per program into a float32 buffer of (programs / groups,
n), each backward program taking the sub-rows of one group, then reduced across programs by a
second small kernel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
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

from normkit.torch import _gated
from normkit.torch._autograd import NormFunction, apply, needs_graph
from normkit.torch._spec import RowSpec, decode, encode
from normkit.torch.kernels import triton_backward
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

__all__ = [
    "ACTIVATIONS", "GATE_POSITIONS", "LOOP_BLOCK", "MAX_FUSED_BLOCK", "RESIDUAL_ROUNDINGS",
    "add_norm_rows", "norm_rows",
]

MAX_FUSED_BLOCK = 16384
"""Rows of at most this many elements are held whole in one program; longer rows loop."""
LOOP_BLOCK = 4096
"""The block the looped variant steps through a row with."""
RESIDUAL_ROUNDINGS: tuple[str, ...] = ("rounded", "float32", "float32_normalized")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KINDS = ("rms", "partial_rms", "layer")
_CASTS = ("after_scale", "before_scale")
GATE_POSITIONS: tuple[str | None, ...] = (None, "before", "after")
ACTIVATIONS: tuple[str, ...] = ("silu", "sigmoid")
_PARTIAL_BLOCK = 32


@triton.jit
def _load_sum(X, RES, offs, mask, RESIDUAL: tl.constexpr):
    """The row values in float32: x, or h = x + residual as rounded."""
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL != 0:
        h += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL == 1:
            h = _round(h, X.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _gate_factors(Z, offs, mask, ACTIVATION: tl.constexpr):
    """(a(z), a'(z)) of the gate at ``offs``; (1, 0) for ACTIVATION "none", no gate."""
    if ACTIVATION == "none":
        return 1.0, 0.0
    else:
        return _activation(tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)


@triton.jit
def _load_row(X, RES, Z, offs, mask, RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr):
    """The values the statistic reads, in float32: v = h a(z) with GATE_IN (the activation of
    gate="before"), else h (`_load_sum`)."""
    a, _ = _gate_factors(Z, offs, mask, GATE_IN)
    return _load_sum(X, RES, offs, mask, RESIDUAL) * a


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
def _moments_looped(X, RES, Z, row_off, sigma, n, k, LAYER: tl.constexpr,
                    RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr, BLOCK: tl.constexpr):
    """(m, m2, s) of the row at ``row_off`` scaled by ``sigma``, stepping by BLOCK."""
    cols = tl.arange(0, BLOCK)
    if LAYER:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            acc += _load_row(X, RES, Z, row_off + start + cols, mask, RESIDUAL, GATE_IN) * sigma
        m = tl.sum(acc, axis=0) / n
        acc_c = tl.zeros([BLOCK], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            xs = _load_row(X, RES, Z, row_off + start + cols, mask, RESIDUAL, GATE_IN) * sigma
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
            xs = _load_row(X, RES, Z, row_off + start + cols, mask, RESIDUAL, GATE_IN) * sigma
            acc += xs * xs
        s = tl.sum(acc, axis=0) / k
    return m, m2, s


@triton.jit
def _absmax_looped(X, RES, Z, row_off, k, RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """max |x| over the first k elements of the row, those the statistic reads."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        values = _load_row(X, RES, Z, row_off + start + cols, mask, RESIDUAL, GATE_IN)
        acc = tl.maximum(acc, tl.abs(values))
    return tl.max(acc, axis=0)


@triton.jit
def _statistic(X, RES, Z, row_off, x, cols, n, k, LAYER: tl.constexpr, RESIDUAL: tl.constexpr,
               GATE_IN: tl.constexpr, SINGLE: tl.constexpr, BLOCK: tl.constexpr):
    """(sigma, m, m2, s) of a row: the moments, rescaled by sigma where they overflow.

    sigma comes from the elements the statistic reads (the first k; k = n for layer), so an
    infinity after them leaves the statistic as it is. SINGLE: ``x`` is the whole row in
    registers; else the row is read from X (and RES, Z).
    """
    sigma = tl.full([], 1.0, tl.float32)
    if SINGLE:
        m, m2, s = _moments_block(x, cols, n, k, LAYER)
    else:
        m, m2, s = _moments_looped(X, RES, Z, row_off, sigma, n, k, LAYER, RESIDUAL, GATE_IN,
                                   BLOCK)
    if (s > _FLT_MAX) | (s != s):
        if SINGLE:
            amax = tl.max(tl.where(cols < k, tl.abs(x), 0.0), axis=0)
        else:
            amax = _absmax_looped(X, RES, Z, row_off, k, RESIDUAL, GATE_IN, BLOCK)
        if amax <= _FLT_MAX:
            sigma = _inv_pow2(amax)
            if SINGLE:
                m, m2, s = _moments_block(x * sigma, cols, n, k, LAYER)
            else:
                m, m2, s = _moments_looped(X, RES, Z, row_off, sigma, n, k, LAYER, RESIDUAL,
                                           GATE_IN, BLOCK)
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
    """u = y_hat g + b in float32 (y_hat rounded to OUT_DTYPE first with BEFORE_SCALE)."""
    u = y_hat
    if BEFORE_SCALE:
        u = _round(u, OUT_DTYPE).to(tl.float32)
    if HAS_W:
        u = u * (tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) + scale_offset)
    if HAS_B:
        u = u + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    return u


@triton.jit
def _output(y_hat, W, B, Z, param_offs, offs, mask, scale_offset, HAS_W: tl.constexpr,
            HAS_B: tl.constexpr, BEFORE_SCALE: tl.constexpr, GATE_OUT: tl.constexpr,
            ROUND_AFFINE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """y in OUT_DTYPE: u a(z) with GATE_OUT (the activation of gate="after"; u rounded to
    OUT_DTYPE first with ROUND_AFFINE), else u (`_affine`)."""
    y = _affine(y_hat, W, B, param_offs, mask, scale_offset, HAS_W, HAS_B, BEFORE_SCALE,
                OUT_DTYPE)
    if GATE_OUT != "none":
        if ROUND_AFFINE:
            y = _round(y, OUT_DTYPE).to(tl.float32)
        a, _ = _gate_factors(Z, offs, mask, GATE_OUT)
        y = y * a
    return _round(y, OUT_DTYPE)


@triton.jit
def _forward_kernel(
    X, RES, Z, W, B, Y, H, R, n, k, groups, eps, scale_offset,
    LAYER: tl.constexpr, OUTSIDE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BEFORE_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, GROUPED: tl.constexpr,
    GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr, ROUND_AFFINE: tl.constexpr,
    SINGLE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One sub-row of n per program: y (and h when RESIDUAL != 0), and r(s) into R. GROUPED:
    the sub-rows are the ``groups`` groups of each row, reading W and B at their offset."""
    tl.static_assert(RESIDUAL == 0 or GATE_IN == "none", "h is not v = h a(z): no residual")
    eps, scale_offset = _float32_scalars(eps, scale_offset)
    row = tl.program_id(0)
    row_off = tl.cast(row, tl.int64) * n
    if GROUPED:
        W += (row % groups) * n
        B += (row % groups) * n
    cols = tl.arange(0, BLOCK)
    out_dtype = Y.dtype.element_ty
    if SINGLE:
        mask = cols < n
        x = _load_row(X, RES, Z, row_off + cols, mask, RESIDUAL, GATE_IN)
        sigma, m, m2, s = _statistic(X, RES, Z, row_off, x, cols, n, k, LAYER, RESIDUAL, GATE_IN,
                                     SINGLE, BLOCK)
        rs = _rs(s, _eps_scaled(eps, sigma, OUTSIDE), OUTSIDE)
        y_hat = _normalized(x * sigma, m, m2, rs, LAYER)
        y = _output(y_hat, W, B, Z, cols, row_off + cols, mask, scale_offset, HAS_W, HAS_B,
                    BEFORE_SCALE, GATE_OUT, ROUND_AFFINE, out_dtype)
        tl.store(Y + row_off + cols, y, mask=mask)
        if RESIDUAL != 0:
            tl.store(H + row_off + cols, _round(x, H.dtype.element_ty), mask=mask)
    else:
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        sigma, m, m2, s = _statistic(X, RES, Z, row_off, zero, cols, n, k, LAYER, RESIDUAL,
                                     GATE_IN, SINGLE, BLOCK)
        rs = _rs(s, _eps_scaled(eps, sigma, OUTSIDE), OUTSIDE)
        for start in range(0, n, BLOCK):
            offs = start + cols
            mask = offs < n
            x = _load_row(X, RES, Z, row_off + offs, mask, RESIDUAL, GATE_IN)
            y_hat = _normalized(x * sigma, m, m2, rs, LAYER)
            y = _output(y_hat, W, B, Z, offs, row_off + offs, mask, scale_offset, HAS_W, HAS_B,
                        BEFORE_SCALE, GATE_OUT, ROUND_AFFINE, out_dtype)
            tl.store(Y + row_off + offs, y, mask=mask)
            if RESIDUAL != 0:
                tl.store(H + row_off + offs, _round(x, H.dtype.element_ty), mask=mask)
    tl.store(R + row, sigma * rs)


@triton.jit
def _row_factors(X, RES, Z, R, row, row_off, x, cols, n, k, eps, LAYER: tl.constexpr,
                 OUTSIDE: tl.constexpr, RESIDUAL: tl.constexpr, GATE_IN: tl.constexpr,
                 SINGLE: tl.constexpr, BLOCK: tl.constexpr):
    """(sigma, m, m2, rs, eps_s, q_sigma, q_m, q_m2, q_scale) of a (sub-)row for the backward,
    ``x`` its values v the statistic reads.

    eps outside's direction is ``q = ((x q_sigma - q_m) - q_m2) q_scale`` (``(x q_sigma)
    q_scale`` for RMS), ``c / sqrt(s)`` in the units of `_statistic`, or of ``x`` scaled by
    ``q_sigma`` where s is below `_TINY_S`. The saved r(s) is reused for RMS with eps inside,
    unless the row was rescaled.
    """
    if LAYER or OUTSIDE:
        sigma, m, m2, s = _statistic(X, RES, Z, row_off, x, cols, n, k, LAYER, RESIDUAL,
                                     GATE_IN, SINGLE, BLOCK)
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
            sigma, m, m2, s = _statistic(X, RES, Z, row_off, x, cols, n, k, LAYER, RESIDUAL,
                                         GATE_IN, SINGLE, BLOCK)
            eps_s = _eps_scaled(eps, sigma, OUTSIDE)
            rs = _rs(s, eps_s, OUTSIDE)
    q_sigma, q_m, q_m2, q_s = sigma, m, m2, s
    if OUTSIDE:
        if s < _TINY_S:
            if SINGLE:
                amax = tl.max(tl.where(cols < k, tl.abs(x), 0.0), axis=0)
            else:
                amax = _absmax_looped(X, RES, Z, row_off, k, RESIDUAL, GATE_IN, BLOCK)
            q_sigma = _inv_pow2(tl.maximum(amax, _MIN_NORMAL))
            if SINGLE:
                q_m, q_m2, q_s = _moments_block(x * q_sigma, cols, n, k, LAYER)
            else:
                q_m, q_m2, q_s = _moments_looped(X, RES, Z, row_off, q_sigma, n, k, LAYER,
                                                 RESIDUAL, GATE_IN, BLOCK)
    q_scale = tl.where(q_s > 0, tl.div_rn(1.0, tl.sqrt_rn(tl.where(q_s > 0, q_s, 1.0))), 0.0)
    return sigma, m, m2, rs, eps_s, q_sigma, q_m, q_m2, q_scale


@triton.jit
def _direction(x, y_hat, q_sigma, q_m, q_m2, q_scale, LAYER: tl.constexpr,
               OUTSIDE: tl.constexpr):
    """q of the backward: y_hat (inside) or c / sqrt(s) (outside, `_row_factors`)."""
    if OUTSIDE:
        return _normalized(x * q_sigma, q_m, q_m2, q_scale, LAYER)
    else:
        return y_hat


@triton.jit
def _store_dz(e, h, slope_in, dy, u, slope_out, DZ, offs, mask, GATE_IN: tl.constexpr,
              GATE_OUT: tl.constexpr):
    """dz = e h a'(z) with GATE_IN (``e`` the norm's input gradient); dy u a'(z) with GATE_OUT
    (``u = y_hat g + b``, unrounded)."""
    if GATE_IN != "none":
        tl.store(DZ + offs, _round(e * h * slope_in, DZ.dtype.element_ty), mask=mask)
    if GATE_OUT != "none":
        tl.store(DZ + offs, _round(dy * u * slope_out, DZ.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    X, RES, Z, R, DY, DH, W, B, DX, DZ, DW_PART, DB_PART, rows, n, k, groups, eps, scale_offset,
    LAYER: tl.constexpr, OUTSIDE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, HAS_DH: tl.constexpr, RESIDUAL: tl.constexpr,
    GROUPED: tl.constexpr, GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Sub-rows pid, pid + P, ...: dx into DX (dz into DZ with a gate); this program's dw/db
    sums at ``pid n`` in the parts. GROUPED: P is a multiple of ``groups``, so that all of a
    program's sub-rows are group ``pid % groups`` of their rows, reading W (and B, which only
    dz of GATE_OUT reads) at its offset."""
    tl.static_assert(RESIDUAL == 0 or GATE_IN == "none", "h is not v = h a(z): no residual")
    eps, scale_offset = _float32_scalars(eps, scale_offset)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    part_off = pid.to(tl.int64) * n
    if GROUPED:
        W += (pid % groups) * n
        B += (pid % groups) * n
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n
        g = tl.full([BLOCK], 1.0, tl.float32)
        if HAS_W:
            g = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + scale_offset
        bias = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_B:
            bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, rows, programs):
            row_off = tl.cast(row, tl.int64) * n
            h = _load_sum(X, RES, row_off + cols, mask, RESIDUAL)
            a_in, slope_in = _gate_factors(Z, row_off + cols, mask, GATE_IN)
            a_out, slope_out = _gate_factors(Z, row_off + cols, mask, GATE_OUT)
            x = h * a_in
            dy = tl.load(DY + row_off + cols, mask=mask, other=0.0).to(tl.float32)
            dy_u = dy * a_out
            sigma, m, m2, rs, eps_s, q_sigma, q_m, q_m2, q_scale = _row_factors(
                X, RES, Z, R, row, row_off, x, cols, n, k, eps, LAYER, OUTSIDE, RESIDUAL, GATE_IN,
                SINGLE, BLOCK)
            xs = x * sigma
            c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
            y_hat = c * rs
            q = _direction(x, y_hat, q_sigma, q_m, q_m2, q_scale, LAYER, OUTSIDE)
            d = dy_u * g
            dot = tl.sum(d * y_hat, axis=0)
            mean_d = tl.sum(d, axis=0) / n if LAYER else 0.0
            dx = _dx_values(d, q, cols, sigma, rs, dot, mean_d, n, k, LAYER, True)
            if not LAYER:
                if k == 1:
                    d0 = tl.sum(tl.where(cols == 0, d, 0.0), axis=0)
                    y0 = tl.sum(tl.where(cols == 0, y_hat, 0.0), axis=0)
                    rest = tl.sum(tl.where(cols >= 1, d * y_hat, 0.0), axis=0)
                    first = _dx_first(d0, y0, rest, sigma, rs, eps_s, OUTSIDE)
                    dx = tl.where(cols == 0, first, dx)
            _store_dz(dx, h, slope_in, dy, y_hat * g + bias, slope_out, DZ, row_off + cols, mask,
                      GATE_IN, GATE_OUT)
            dx *= a_in
            if HAS_DH:
                dx += tl.load(DH + row_off + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row_off + cols, _round(dx, DX.dtype.element_ty), mask=mask)
            dw_acc += dy_u * y_hat
            db_acc += dy_u
        if NEED_DW:
            tl.store(DW_PART + part_off + cols, dw_acc, mask=mask)
        if NEED_DB:
            tl.store(DB_PART + part_off + cols, db_acc, mask=mask)
    else:
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, rows, programs):
            row_off = tl.cast(row, tl.int64) * n
            sigma, m, m2, rs, eps_s, q_sigma, q_m, q_m2, q_scale = _row_factors(
                X, RES, Z, R, row, row_off, zero, cols, n, k, eps, LAYER, OUTSIDE, RESIDUAL,
                GATE_IN, SINGLE, BLOCK)
            acc_dot = tl.zeros([BLOCK], dtype=tl.float32)
            acc_d = tl.zeros([BLOCK], dtype=tl.float32)
            acc_rest = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + cols
                mask = offs < n
                xs = _load_row(X, RES, Z, row_off + offs, mask, RESIDUAL, GATE_IN) * sigma
                c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
                a_out, _ = _gate_factors(Z, row_off + offs, mask, GATE_OUT)
                d = tl.load(DY + row_off + offs, mask=mask, other=0.0).to(tl.float32) * a_out
                if HAS_W:
                    d *= tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) + scale_offset
                d_y_hat = d * (c * rs)
                acc_dot += d_y_hat
                if LAYER:
                    acc_d += d
                else:
                    acc_rest += tl.where(offs >= 1, d_y_hat, 0.0)
            dot = tl.sum(acc_dot, axis=0)
            mean_d = tl.sum(acc_d, axis=0) / n
            rest = tl.sum(acc_rest, axis=0)
            for start in range(0, n, BLOCK):
                offs = start + cols
                mask = offs < n
                h = _load_sum(X, RES, row_off + offs, mask, RESIDUAL)
                a_in, slope_in = _gate_factors(Z, row_off + offs, mask, GATE_IN)
                a_out, slope_out = _gate_factors(Z, row_off + offs, mask, GATE_OUT)
                x = h * a_in
                xs = x * sigma
                c = tl.where(mask, _normalized(xs, m, m2, 1.0, LAYER), 0.0)
                y_hat = c * rs
                q = _direction(x, y_hat, q_sigma, q_m, q_m2, q_scale, LAYER, OUTSIDE)
                dy = tl.load(DY + row_off + offs, mask=mask, other=0.0).to(tl.float32)
                dy_u = dy * a_out
                g = tl.full([BLOCK], 1.0, tl.float32)
                if HAS_W:
                    g = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) + scale_offset
                d = dy_u * g
                dx = _dx_values(d, q, offs, sigma, rs, dot, mean_d, n, k, LAYER, True)
                if not LAYER:
                    if k == 1:
                        d0 = tl.sum(tl.where(offs == 0, d, 0.0), axis=0)
                        y0 = tl.sum(tl.where(offs == 0, y_hat, 0.0), axis=0)
                        first = _dx_first(d0, y0, rest, sigma, rs, eps_s, OUTSIDE)
                        dx = tl.where(offs == 0, first, dx)
                affine = y_hat * g
                if HAS_B:
                    affine += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
                _store_dz(dx, h, slope_in, dy, affine, slope_out, DZ, row_off + offs, mask,
                          GATE_IN, GATE_OUT)
                dx *= a_in
                if HAS_DH:
                    dx += tl.load(DH + row_off + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row_off + offs, _round(dx, DX.dtype.element_ty), mask=mask)
                if NEED_DW:
                    part = DW_PART + part_off + offs
                    tl.store(part, tl.load(part, mask=mask, other=0.0) + dy_u * y_hat, mask=mask)
                if NEED_DB:
                    part = DB_PART + part_off + offs
                    tl.store(part, tl.load(part, mask=mask, other=0.0) + dy_u, mask=mask)


def _launch_config(n: int, layer: bool, backward: bool) -> tuple[bool, int, int]:
    """(single, block, num_warps) for (sub-)rows of n, from a sweep on an H200 (bfloat16, 32M
    elements; docs/benchmarks-gpu.md).

    The backward holds more values per element, and spills registers past half of
    `MAX_FUSED_BLOCK`: its rows loop from there. Blocks of 1024 elements per warp, 2 to 8
    warps (16 for the forward of RMS); 4 to 8 for the backward, 16 when it loops.
    """
    single = n <= (MAX_FUSED_BLOCK // 2 if backward else MAX_FUSED_BLOCK)
    block = 1 << (n - 1).bit_length() if single else LOOP_BLOCK
    if backward:
        return single, block, max(4, min(8, block // 1024)) if single else 16
    return single, block, max(2, min(8 if layer else 16, block // 1024))


def _programs(x: torch.Tensor, rows: int, groups: int) -> int:
    """How many programs the backward runs: a few per multiprocessor on a GPU, a multiple of
    ``groups`` so that each program takes one group of its rows.

    Each takes at least two rows, so the (programs / groups, n) float32 buffer of weight and
    bias partial sums is at most half the size of the rows in float32.
    """
    per_device = 4 * _multiprocessors(x.device) if x.device.type == "cuda" else 4
    return groups * max(1, min(rows // 2, per_device // groups))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count, asked for once (``get_device_properties`` costs host
    time on every call)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is being traced (torch.compile, make_fx, torch.func, a dispatch mode, fake
    or functional tensors), so that the kernels must be reached through the custom ops and
    launched through ``wrap_triton``; in plain eager mode both only add host time."""
    return (
        torch.compiler.is_compiling() or type(x) is not torch.Tensor
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._are_functorch_transforms_active()
    )


def _launcher(x: torch.Tensor) -> Callable[[Any], Any]:
    """How a kernel is launched on ``x``: through ``wrap_triton`` where traced; on a GPU
    directly through the compiled kernel's launcher (`_Direct`), with x's GPU made current
    where it is not (Triton launches on the current device's current stream: a model spread
    over GPUs, one layer on cuda:1, runs with cuda:0 current); elsewhere (Triton's
    interpreter) as ``kernel[grid](...)``."""
    if _traced(x):
        return wrap_triton
    if x.device.type != "cuda":
        return _plain_launch
    index = x.device.index
    if index != torch.cuda.current_device():
        return functools.partial(_OnDevice, x.device)
    return functools.partial(_Direct, index) if DIRECT_LAUNCH else _plain_launch


def _plain_launch(kernel: Any) -> Any:
    return kernel


class _OnDevice:
    """``kernel[grid](...)`` launched with ``device`` current, then the current device put
    back."""

    def __init__(self, device: torch.device, kernel: Any) -> None:
        self.device, self.kernel = device, kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = _Direct(self.device.index, self.kernel) if DIRECT_LAUNCH else self.kernel

        def on_device(*args: Any, **kwargs: Any) -> Any:
            with torch.cuda.device(self.device):
                return launch[grid](*args, **kwargs)

        return on_device


def _direct_launch_supported() -> bool:
    """Whether `_Direct` may launch compiled kernels itself: not in Triton's interpreter (no
    compiled kernels), and only on the Triton versions whose launch convention it was written
    against (3.6 and 3.9: ``CompiledKernel.run(grid_0, grid_1, grid_2, stream, function,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *every_argument)``, as
    ``JITFunction.run`` calls it)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    return version in DIRECT_LAUNCH_VERSIONS


DIRECT_LAUNCH_VERSIONS = ((3, 6), (3, 9))
"""The Triton versions (major, minor) whose compiled kernels `_Direct` launches itself."""
DIRECT_LAUNCH = (
    _direct_launch_supported() and os.environ.get("NORMKIT_TRITON_DIRECT_LAUNCH") == "1"
)
"""Whether eager launches on a GPU skip ``JITFunction.run`` (`_Direct`): opt-in
(``NORMKIT_TRITON_DIRECT_LAUNCH=1``) until it has run on a GPU."""


class _Direct:
    """``kernel[grid](*args, **constexprs)`` on CUDA device ``index``, as Inductor's generated
    launchers do it: the first launch of each specialization goes through ``JITFunction.run``,
    which compiles (or loads) the kernel and returns it; later ones call that compiled kernel's
    launcher directly, skipping the binder, the cache key and the checks ``JITFunction.run``
    redoes on every call (22-29 us of host time on an H200).

    A specialization is what Triton compiles for: each tensor's dtype and whether its address
    is a multiple of 16, each int's value where it is 1, its divisibility by 16 and its width,
    the constexprs and ``num_warps``. Where a launch hook is registered (a profiler), the launch
    goes through ``JITFunction.run``, which builds the launch metadata the hooks read.
    """

    __slots__ = ("grid", "index", "kernel")
    grid: tuple[int, ...]

    def __init__(self, index: int, kernel: Any) -> None:
        self.index, self.kernel = index, kernel

    def __getitem__(self, grid: tuple[int, ...]) -> _Direct:
        launch = _Direct(self.index, self.kernel)
        launch.grid = grid
        return launch

    def __call__(self, *args: Any, **constexprs: Any) -> None:
        kernel, grid = self.kernel, self.grid
        runtime = triton.knobs.runtime
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            kernel[grid](*args, **constexprs)
            return
        key = (kernel, self.index, *constexprs.items(), *map(_specialization, args))
        found = _COMPILED.get(key)
        if found is None:
            _COMPILED[key] = _first_launch(kernel, grid, args, constexprs)
            return
        compiled, tail = found
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            torch._C._cuda_getCurrentRawStream(self.index), compiled.function,
            compiled.packed_metadata, None, None, None, *args, *tail,
        )


def _hooked(hooks: Any) -> bool:
    """Whether a launch hook (Triton's ``HookChain``, or a function) has anything to call."""
    return hooks is not None and bool(getattr(hooks, "calls", True))


_COMPILED: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}


def _specialization(arg: Any) -> tuple[Any, ...]:
    """What Triton specializes a kernel for in ``arg`` (`_Direct`)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg),)
    return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)


def _first_launch(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], constexprs: dict[str, Any]
) -> tuple[Any, tuple[Any, ...]]:
    """Launch through ``JITFunction.run``; return its compiled kernel and the values of the
    parameters after ``args`` (the constexprs, in the kernel's order), which its launcher
    takes too."""
    compiled = kernel[grid](*args, **constexprs)
    if hasattr(compiled, "result"):  # compiled asynchronously
        compiled = compiled.result()
    tail = tuple(constexprs[name] for name in kernel.arg_names[len(args):])
    return compiled, tail


def _sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    count, n = parts.shape
    out = torch.empty((n,), dtype=dtype, device=parts.device)
    block_n = min(triton.next_power_of_2(n), 256)
    _launcher(parts)(_column_sums_kernel)[(triton.cdiv(n, block_n),)](
        parts, out, out, count, n, n, HAS_DW=False, BLOCK_P=_PARTIAL_BLOCK, BLOCK_N=block_n,
    )
    return out


def _norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    spec: str,
    round_affine: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, r) for the `RowSpec` ``spec`` (`normkit.torch._spec.encode`'s string): h is an
    empty tensor without a residual; r(s) per group in float32. ``round_affine`` rounds ``y_hat
    g + b`` to x's dtype before a gate after the norm."""
    return _forward_rows(x, residual, gate, weight, bias, decode(spec), round_affine)


def _forward_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
    round_affine: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_norm_rows` for a `RowSpec`."""
    count, n = x.shape
    group = rows.group
    groups = n // group
    rounding = _ROUNDING[rows.residual]
    y = torch.empty_like(x)
    h_dtype = torch.float32 if rounding == 2 else x.dtype
    h = torch.empty((count, n) if rounding else (0,), dtype=h_dtype, device=x.device)
    r = torch.empty((count * groups,), dtype=torch.float32, device=x.device)
    single, block, num_warps = _launch_config(group, rows.kind == "layer", backward=False)
    if count:
        _launcher(x)(_forward_kernel)[(count * groups,)](
            x, x if residual is None else residual, x if gate is None else gate,
            x if weight is None else weight, x if bias is None else bias, y,
            y if not rounding else h, r, group, rows.k, groups, rows.eps, rows.scale_offset,
            LAYER=rows.kind == "layer", OUTSIDE=rows.outside, HAS_W=weight is not None,
            HAS_B=bias is not None,
            BEFORE_SCALE=rows.before_scale and x.dtype != torch.float32,
            RESIDUAL=rounding, GROUPED=groups > 1, GATE_IN=_activation_at(rows, "before"),
            GATE_OUT=_activation_at(rows, "after"), ROUND_AFFINE=round_affine, SINGLE=single,
            BLOCK=block, num_warps=num_warps,
        )
    return y, h, r


_ROUNDING = {"": 0, **{name: i + 1 for i, name in enumerate(RESIDUAL_ROUNDINGS)}}
"""The kernels' RESIDUAL: 0 without a residual, else 1 + the index of the rounding in
`RESIDUAL_ROUNDINGS` (1 rounded, 2 float32, 3 float32_normalized)."""


def _activation_at(rows: RowSpec, position: str) -> str:
    """The gate's activation where it applies at ``position`` (``"before"`` or ``"after"`` the
    norm), else ``"none"``."""
    return rows.activation if rows.gate == position else "none"


def _backward_rows(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dz, dw, db); dz is empty without a gate, dw and db where not needed. ``bias`` is
    given with ``gate_out`` only (dz reads u = y_hat g + b); ``bias_dtype`` is db's."""
    if triton_backward.FUSED:  # NORMKIT_TRITON_BACKWARD=fused, experimental (docs/triton.md)
        return triton_backward.backward_rows(
            x, residual, gate, r, dy, dh, weight, bias, bias_dtype, kind, k, eps, outside,
            scale_offset, group, gate_in, gate_out, rounding, dx_dtype, need_dw, need_db,
            launch=_launcher(x))
    rows, n = x.shape
    groups = n // group
    dx = torch.empty((rows, n), dtype=dx_dtype, device=x.device)
    dz = torch.empty((0,) if gate is None else (rows, n), dtype=dx_dtype if gate is None
                     else gate.dtype, device=x.device)
    programs = _programs(x, rows, groups)
    need_dw = need_dw and weight is not None
    need_db = need_db and bias_dtype is not None
    single, block, num_warps = _launch_config(group, kind == "layer", backward=True)
    # A single-block program stores its sums whole; a looped one adds each row's into its part.
    parts = torch.empty if single and rows else torch.zeros
    part_shape = (programs // groups, n)
    dw_part = parts(part_shape, dtype=torch.float32, device=x.device) if need_dw else dx
    db_part = parts(part_shape, dtype=torch.float32, device=x.device) if need_db else dx
    if rows:
        _launcher(x)(_backward_kernel)[(programs,)](
            x, x if residual is None else residual, x if gate is None else gate, r, dy,
            dy if dh is None else dh, x if weight is None else weight,
            x if bias is None else bias, dx, dx if gate is None else dz,
            dw_part, db_part, rows * groups, group, k,
            groups, eps, scale_offset, LAYER=kind == "layer", OUTSIDE=outside,
            HAS_W=weight is not None, HAS_B=bias is not None, NEED_DW=need_dw, NEED_DB=need_db,
            HAS_DH=dh is not None, RESIDUAL=rounding, GROUPED=groups > 1, GATE_IN=gate_in,
            GATE_OUT=gate_out, SINGLE=single, BLOCK=block, num_warps=num_warps,
        )
    if need_dw and weight is not None:
        dw = _sum_parts(dw_part, weight.dtype)
    else:
        dw = torch.empty((0,), dtype=torch.float32, device=x.device)
    if need_db and bias_dtype is not None:
        db = _sum_parts(db_part, bias_dtype)
    else:
        db = torch.empty((0,), dtype=torch.float32, device=x.device)
    return dx, dz, dw, db


_norm_rows_op = triton_op("normkit::triton_norm_rows", _norm_rows, mutates_args={})
_backward_op = triton_op("normkit::triton_norm_rows_backward", _backward_rows, mutates_args={})


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, residual, gate, weight, bias, spec, round_affine = inputs
    _save(ctx, x, residual, gate, weight, bias, decode(spec), round_affine, output)


def _save(
    ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
    weight: torch.Tensor | None, bias: torch.Tensor | None, rows: RowSpec, round_affine: bool,
    output: tuple[torch.Tensor, ...],
) -> None:
    """What the backward reads: the rows the norm read (h, or for the float32_normalized
    rounding the terms of the float32 sum it does not return), the gate, r, the weight, the
    bias where dz reads it, and `_backward_rows`' arguments after the tensors."""
    _, h, r = output
    rounding = _ROUNDING[rows.residual]
    values, terms = (x, residual) if rounding in (0, 3) else (h, None)
    gate_out = _activation_at(rows, "after")
    ctx.save_for_backward(values, terms, gate, r, weight, None if gate_out == "none" else bias)
    ctx.mark_non_differentiable(r)
    if not rounding:
        ctx.mark_non_differentiable(h)
    ctx.options = (
        rows.kind, rows.k, rows.eps, rows.outside, rows.scale_offset, rows.group,
        _activation_at(rows, "before"), gate_out, 3 if rounding == 3 else 0,
    )
    ctx.rows, ctx.round_affine = rows, round_affine
    ctx.has_residual, ctx.dx_dtype = residual is not None, x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(
    ctx: Any, dy: torch.Tensor, dh: torch.Tensor | None, _dr: torch.Tensor | None,
    backward_rows: Callable[..., tuple[torch.Tensor, ...]] = _backward_op,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, residual, gate, weight and bias: one call of the backward kernels
    (`_backward_rows`, or its op where traced)."""
    values, terms, gate, r, weight, bias = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[3:5]
    dh = dh.contiguous() if ctx.has_residual and dh is not None else None
    dx, dz, dw, db = backward_rows(
        values, terms, gate, r, dy.contiguous(), dh, weight, bias, ctx.bias_dtype,
        *ctx.options, ctx.dx_dtype, need_w, need_b,
    )
    return (
        dx, dx if ctx.has_residual else None, None if gate is None else dz,
        dw if need_w and weight is not None else None,
        db if need_b and ctx.bias_dtype is not None else None, None, None,
    )


torch.library.register_autograd("normkit::triton_norm_rows", _backward, setup_context=_setup)


class _EagerNormRows(torch.autograd.Function):
    """`_norm_rows_op` in plain eager mode, as ``apply(x, residual, gate, weight, bias, rows,
    round_affine)``: the same kernels, context and gradient without the custom op's dispatch
    and autograd wrapper, which cost more host time than the launches. Under ``create_graph``
    the gradient is the composite path's, which can be differentiated again
    (`_composite_vjp`)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, rows: RowSpec,
        round_affine: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = _forward_rows(x, residual, gate, weight, bias, rows, round_affine)
        _save(ctx, x, residual, gate, weight, bias, rows, round_affine, output)
        # No zeros made for the gradients of r and of an h without a residual, which nothing
        # reads: on a GPU each such fill cost about 150 us of host time on autograd's thread.
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor | None, dh: torch.Tensor | None, dr: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if dy is None:  # only h reached what is differentiated; y is in x's dtype
            values = ctx.saved_tensors[0]
            dy = values.new_zeros(values.shape, dtype=ctx.dx_dtype)
        if torch.is_grad_enabled():
            return (*_composite_vjp(ctx, dy, dh), None, None)
        return _backward(ctx, dy, dh, dr, _backward_rows)


def _check(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
) -> None:
    """ValueError or TypeError unless the kernels take these tensors for ``rows``."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor (rows, n), got shape "
                         f"{tuple(x.shape)}{'' if x.is_contiguous() else ', not contiguous'}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; the Triton kernels take float16, bfloat16 or "
                        "float32 (float64 takes the composite path)")
    if rows.kind not in _KINDS:
        raise ValueError(f"kind={rows.kind!r} is invalid: expected one of {_KINDS}")
    n = x.shape[1]
    if rows.n != n:
        raise ValueError(f"the RowSpec is for rows of n={rows.n}, x has rows of {n}")
    group = rows.group
    if not 1 <= group <= n or n % group or (group != n and rows.kind == "partial_rms"):
        raise ValueError(f"group={group} is invalid for kind={rows.kind!r} on rows of n={n}: "
                         "expected a divisor of n, and n itself for partial_rms")
    if not (1 <= rows.k <= group) or (rows.kind != "partial_rms" and rows.k != group):
        raise ValueError(f"k={rows.k} is invalid for kind={rows.kind!r} on rows of n={n} in "
                         f"groups of {group}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (n,) or p.dtype not in (torch.float32, x.dtype) or p.device != x.device:
            raise ValueError(
                f"{name} must have shape ({n},), dtype float32 or {x.dtype} and x's device; "
                f"got shape {tuple(p.shape)}, {p.dtype} on {p.device}"
            )
    _check_gate(x, residual, gate, rows)
    if residual is None:
        if rows.residual:
            raise ValueError(f"residual={rows.residual!r} needs a residual: add_norm_rows")
        return
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(
            f"residual must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got shape {tuple(residual.shape)}, {residual.dtype}"
        )
    if rows.residual not in RESIDUAL_ROUNDINGS:
        raise ValueError(
            f"residual={rows.residual or None!r} is invalid with a residual: expected one of "
            f"{RESIDUAL_ROUNDINGS}"
        )
    if _degenerate(rows):
        raise ValueError(
            f"kind='layer' on rows (or groups) of n={rows.group} (n <= 2) has no fused residual "
            "kernel: add the residual and normalize with the composite path"
        )


def _check_gate(
    x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None, rows: RowSpec
) -> None:
    if rows.gate not in ("", *GATE_POSITIONS[1:]):
        raise ValueError(f"gate={rows.gate!r} is invalid: expected '' (none), 'before' or "
                         "'after'")
    if rows.activation not in ACTIVATIONS:
        raise ValueError(f"activation={rows.activation!r} is invalid: expected one of "
                         f"{ACTIVATIONS}")
    if residual is not None and rows.gate:
        raise ValueError("a gate with a residual is not defined (NormSpec refuses gate with "
                         "residual)")
    if (gate is None) != (rows.gate == ""):
        raise ValueError(f"gate={rows.gate or None!r} and a gate "
                         f"{'missing' if gate is None else 'given'}: give both or neither")
    if gate is not None and (
        gate.shape != x.shape or gate.dtype != x.dtype or not gate.is_contiguous()
    ):
        raise ValueError(
            f"gate must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got shape {tuple(gate.shape)}, {gate.dtype}"
        )


def _degenerate(rows: RowSpec) -> bool:
    """LayerNorm groups of n <= 2, whose gradient the composite path computes in float64."""
    return rows.kind == "layer" and rows.group <= 2


def _composite(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
    round_affine: bool,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`norm_rows` by the composite path, differentiable at any order: for LayerNorm groups of
    n <= 2 (`_degenerate`), and for second derivatives (`_composite_vjp`). ``dtype``: the
    input dtype whose roundings apply and y's (x's by default; a float32 sum's is x's)."""
    dtype = x.dtype if dtype is None else dtype
    g = None if weight is None else weight.float() + rows.scale_offset
    b = None if bias is None else bias.float()
    if gate is None and rows.group == x.shape[1]:
        y, _ = apply(NormFunction, x, g, b, rows, dtype, dtype)
        return y
    affine = dtype if round_affine else torch.float32
    return _gated.norm_rows(x, gate, rows, g, b, dtype, affine, dtype, eager=False)


def _composite_vjp(
    ctx: Any, dy: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """`_EagerNormRows`' gradients (x, residual, gate, weight, bias) under ``create_graph``:
    the vector-Jacobian product through `_composite`, a graph that can be differentiated
    again (the kernels' own gradient cannot)."""
    values, terms, gate, _, weight, bias = ctx.saved_tensors
    if bias is None and ctx.bias_dtype is not None:  # y is b plus terms free of b
        bias = values.new_zeros(values.shape[1], dtype=ctx.bias_dtype)
    primals = [values, terms, gate, weight, bias]
    present = [i for i, p in enumerate(primals) if p is not None]

    def norm(*args: torch.Tensor) -> torch.Tensor:
        v, t, z, w, b = (dict(zip(present, args, strict=True)).get(i) for i in range(5))
        assert v is not None
        if t is not None:  # float32_normalized: the float32 sum of the terms
            v = v.float() + t.float()
        return _composite(v, z, w, b, ctx.rows, ctx.round_affine, ctx.dx_dtype)

    grads = dict(zip(present, torch.func.vjp(norm, *(primals[i] for i in present))[1](dy),
                     strict=True))
    dv, dz, dw, db = grads[0], grads.get(2), grads.get(3), grads.get(4)
    if not ctx.has_residual:
        return dv, None, dz, dw, db
    dx = (dv if dh is None else dv + dh).to(ctx.dx_dtype)  # dh: the returned h's, as h = x + r
    return dx, dx, None, dw, db


def launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
    round_affine: bool,
    graph: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` (h empty without a residual) of tensors `_check` accepted for ``rows``, their
    autograd graph recorded when ``graph``: through the custom op where traced, else the
    kernels directly."""
    if residual is None and _degenerate(rows):
        return _composite(x, gate, weight, bias, rows, round_affine), x.new_empty(0)
    if _traced(x):
        y, h, _ = _norm_rows_op(x, residual, gate, weight, bias, encode(rows), round_affine)
    elif graph:
        y, h, _ = _EagerNormRows.apply(x, residual, gate, weight, bias, rows, round_affine)
    else:
        y, h, _ = _forward_rows(x, residual, gate, weight, bias, rows, round_affine)
    return y, h


def norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
    *,
    gate: torch.Tensor | None = None,
    round_affine: bool = False,
) -> torch.Tensor:
    """``normkit.reference.normalize`` (``gated_normalize`` with a gate) on rows ``x`` (rows,
    n), as ``rows`` (`normkit.torch._spec.row_spec`) says, differentiable; y in x's dtype.

    ``weight``/``bias``: (n,) in float32 or x's dtype, or None. ``gate``: z, contiguous with
    x's shape and dtype, exactly when ``rows.gate`` is set; ``round_affine`` rounds ``y_hat g +
    b`` to x's dtype before a gate after the norm. LayerNorm groups of n <= 2 take the
    composite path.
    """
    _check(x, None, gate, weight, bias, rows)
    graph = needs_graph(x, gate, weight, bias)
    return launch(x, None, gate, weight, bias, rows, round_affine, graph)[0]


def add_norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: RowSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` with ``h = x + residual`` and ``y`` = `norm_rows` of h, rounded as
    ``rows.residual`` says:

    - ``"rounded"``: h rounded to x's dtype, and that h normalized and returned;
    - ``"float32"``: h kept in float32, normalized, and returned in float32;
    - ``"float32_normalized"``: the float32 h normalized, h returned rounded to x's dtype.

    The half-precision cast order and y's dtype follow x's dtype. ``residual`` has x's shape
    and dtype. Gradients: dx = dresidual = (the norm's gradient at h) + dh. A gated `RowSpec`
    is refused (a gated NormSpec has no residual).
    """
    _check(x, residual, None, weight, bias, rows)
    graph = needs_graph(x, residual, weight, bias)
    return launch(x, residual, None, weight, bias, rows, False, graph)
