"""The floating-point dtypes normkit supports, and exact rounding and ulp arithmetic on them.

numpy has no bfloat16; ``ml_dtypes`` provides it. Its float64 -> bfloat16 cast rounds twice
(through float32), so `round_to` rounds correctly itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

HALF_DTYPES: tuple[np.dtype, ...] = (float16, bfloat16)
FLOAT_DTYPES: tuple[np.dtype, ...] = (float16, bfloat16, float32, float64)
DTYPE_NAMES: dict[str, np.dtype] = {d.name: d for d in FLOAT_DTYPES}


def as_float_dtype(dtype: npt.DTypeLike | str, what: str = "input") -> np.dtype:
    """``dtype`` as a numpy dtype, or TypeError if it is not one of `FLOAT_DTYPES`."""
    resolved = np.dtype(DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    if resolved not in FLOAT_DTYPES:
        allowed = ", ".join(d.name for d in FLOAT_DTYPES)
        raise TypeError(f"{what} has dtype {resolved.name}; normkit supports {allowed}")
    return resolved


def is_half(dtype: npt.DTypeLike) -> bool:
    """Whether ``dtype`` is float16 or bfloat16, the dtypes the cast policy applies to."""
    return np.dtype(dtype) in HALF_DTYPES


def _finfo(dtype: np.dtype) -> ml_dtypes.finfo:
    return ml_dtypes.finfo(dtype)


def ulp(values: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """The spacing of ``dtype`` at each of ``values`` (float64), subnormals included.

    ``ulp(v) = 2 ** (max(floor(log2 |v|), minexp) - nmant)``; ``ulp(0)`` is the smallest
    subnormal. Infinite and NaN values give NaN.
    """
    info = _finfo(as_float_dtype(dtype))
    v = np.abs(np.asarray(values, dtype=np.float64))
    finite = np.isfinite(v)
    _, exponent = np.frexp(np.where(finite & (v > 0), v, 1.0))
    exponent = np.where(v > 0, exponent - 1, info.minexp)
    spacing = np.ldexp(1.0, np.maximum(exponent, info.minexp) - info.nmant)
    return np.where(finite, spacing, np.nan)


def round_to(values: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """``values`` rounded once, to nearest-even, to ``dtype``; returned in ``dtype``."""
    target = as_float_dtype(dtype)
    v = np.asarray(values, dtype=np.float64)
    if target == float64:
        return v.copy()
    step = ulp(v, target)
    with np.errstate(invalid="ignore"):
        rounded = np.where(np.isfinite(v), np.rint(v / step) * step, v)
    overflow = np.abs(rounded) > float(_finfo(target).max)
    rounded = np.where(overflow, np.copysign(np.inf, v), rounded)
    return rounded.astype(target)
