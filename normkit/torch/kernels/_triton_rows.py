"""The ``@triton.jit`` helpers and constants that the forward and backward kernels of
`normkit.torch.kernels.triton` and the fused backward of `normkit.torch.kernels.triton_backward`
share: rounding to a half dtype, the gate's activation, the rescaling power of two, ``r(s)``, the
closed form of partial RMS's ``dx_0`` at ``k = 1``, and the kernel that sums the weight and bias
gradients' per-program parts. The kernels inline the helpers when compiled.
"""

from __future__ import annotations

import os

import triton  # imported by triton.py and triton_backward.py, which say what a missing one needs
import triton.language as tl

# Below this, a saved r(s) can only come from a rescaled (or inf/NaN) row: a finite float32
# statistic is below 2**128, so r(s) >= 2**-64 without rescaling.
_RESCALED_R: tl.constexpr = tl.constexpr(2.0**-64)
# float32's largest finite value, (2 - 2**-23) * 2**127: for a float32 s, `s > _FLT_MAX` is
# `s >= inf` and `s <= _FLT_MAX` is `s < inf` (NaN fails both). No module-level constexpr holds
# an inf or NaN: Inductor (torch.compile) re-emits them by repr, and `tl.constexpr(inf)` is a
# NameError in the source it generates.
_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
# Below this a row's float32 s may have lost its value to underflow.
_TINY_S: tl.constexpr = tl.constexpr(2.0**-103)
_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-126)
# Under Triton's interpreter bfloat16 is rounded with integer arithmetic (`_round`).
_SOFT_RNE: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


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
def _activation(z, ACTIVATION: tl.constexpr):
    """(a(z), a'(z)) in float32, sigmoid(z) and sigmoid(-z) both from ``e = exp(-|z|)`` (no
    overflow, no cancellation in 1 - sigmoid(z))::

        sigmoid(z) = 1 / (1 + e^-z)     sigmoid' = sigmoid(z) sigmoid(-z)
        silu(z) = z sigmoid(z)          silu' = sigmoid(z) (1 + z sigmoid(-z))
    """
    e = tl.exp(-tl.abs(z))
    positive = z >= 0
    sig = tl.div_rn(tl.where(positive, 1.0, e), 1.0 + e)
    sig_neg = tl.div_rn(tl.where(positive, e, 1.0), 1.0 + e)
    if ACTIVATION == "sigmoid":
        return sig, sig * sig_neg
    else:
        return z * sig, sig * (1.0 + z * sig_neg)


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
def _float32_scalars(eps, scale_offset):
    """The float arguments in float32: a launch passes Python floats as float32, but
    torch.compile's Inductor as float64, which float32 math (``sqrt_rn``) refuses."""
    return tl.cast(eps, tl.float32), tl.cast(scale_offset, tl.float32)


@triton.jit
def _dx_first(d0, y0, rest, sigma, rs, eps_s, OUTSIDE: tl.constexpr):
    """dx_0 of partial RMS with k = 1, in the closed form free of cancellation; ``y0`` is
    y_hat_0 and ``rest`` the sum of d y_hat past it (products of a cotangent with normalized
    values, which stay in float32's range where d x may not)."""
    if OUTSIDE:
        sign = tl.where(y0 > 0, 1.0, tl.where(y0 < 0, -1.0, 0.0))
        return sigma * rs * (eps_s * rs * d0 - sign * rest)
    else:
        return sigma * rs * (eps_s * rs * rs * d0 - y0 * rest)


@triton.jit
def _dx_values(d, q, cols, sigma, rs, dot, mean_d, n, k, LAYER: tl.constexpr,
               PARTIAL: tl.constexpr):
    """dx of a (sub-)row but the k = 1 closed form's element: ``sigma rs (d - mean(d) - q dot
    / n)`` (LAYER), ``sigma rs (d - [i < k] q dot / k)`` (PARTIAL; else without the mask)."""
    if LAYER:
        return sigma * rs * (d - mean_d - q * (dot / n))
    elif PARTIAL:
        return sigma * rs * (d - tl.where(cols < k, q * (dot / k), 0.0))
    else:
        return sigma * rs * (d - q * (dot / k))


@triton.jit
def _column_sums_kernel(PART, DW, DB, parts, n, width, HAS_DW: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column j < width of PART (parts, width) summed over its rows in float32, in a fixed
    order, and rounded once: into DW[j] for j < n with HAS_DW, else into DB[j - n HAS_DW]."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, parts, BLOCK_P):
        p = start + lanes
        mask = (p[:, None] < parts) & (cols[None, :] < width)
        acc += tl.load(PART + p[:, None].to(tl.int64) * width + cols[None, :], mask=mask,
                       other=0.0)
    total = tl.sum(acc, axis=0)
    if HAS_DW:
        tl.store(DW + cols, _round(total, DW.dtype.element_ty), mask=cols < n)
        tl.store(DB + (cols - n), _round(total, DB.dtype.element_ty),
                 mask=(cols >= n) & (cols < width))
    else:
        tl.store(DB + cols, _round(total, DB.dtype.element_ty), mask=cols < width)
