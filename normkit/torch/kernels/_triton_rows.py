"""The ``@triton.jit`` helpers and constants that the forward and backward kernels of
`normkit.torch.kernels.triton` and the fused backward of `normkit.torch.kernels.triton_backward`
share: rounding to a half dtype, the gate's activation, the rescaling power of two, ``r(s)`` and
the closed form of partial RMS's ``dx_0`` at ``k = 1``. The kernels inline them when compiled.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(
        f"normkit's Triton kernels need triton and torch>=2.6 ({error}): "
        "pip install normkit[triton]"
    ) from error

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
