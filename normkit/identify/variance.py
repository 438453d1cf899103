"""LayerNorm's variance algorithm, ``"two_pass"`` or ``"fast"``, from rows with a large mean.

On rows ``M + u`` (``u`` of unit spread), the two-pass variance ``mean((x - mean(x))^2)`` is
accurate to the compute dtype's precision, while the fast one, ``mean(x^2) - mean(x)^2``,
subtracts two numbers of size ``M^2`` and keeps only ``ulp(M^2)`` of absolute precision. With
``M = 2^((p - 3) / 2)`` for a compute dtype of ``p`` mantissa bits (1024 for float32) that is
about 0.1 of the variance: the fast variance moves the output by percents, the two-pass one by
the dtype's rounding. Half-precision rows cannot show it (their squares and sums are exact in
float32 for the sizes probed), so only float32 and float64 probes decide.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from normkit import reference
from normkit.dtypes import is_half, round_to, ulp
from normkit.spec import NormSpec, Variance

__all__ = ["variance_verdict"]

_ROWS = 8
_TWO_PASS = 1e-4  # the largest departure (of max|y|) a two-pass variance shows on these rows
_FAST = 1e-3  # the smallest departure that the fast variance explains


def variance_verdict(
    h: Callable[[np.ndarray], np.ndarray],
    n: int,
    dtype: np.dtype,
    rng: np.random.Generator,
    spec: NormSpec,
    zero_output: np.ndarray,
    gain: np.ndarray,
) -> tuple[Variance | None, str]:
    """The variance ``h`` (rows of ``n`` in ``dtype``, float64 out, ``G ŷ + B``) computes, or
    None, with the finding. ``spec`` is the identified LayerNorm structure, ``G`` the gain."""
    if is_half(dtype):
        return None, (
            "variance: undetermined (a half-precision row's squares and sums are exact in "
            "float32, so the fast and two-pass variances agree; probe float32 to tell them apart)"
        )
    bits = ml_dtypes.finfo(dtype).nmant
    large = 2.0 ** round((bits - 3) / 2)
    spacing = large * 2.0**-bits  # the dtype's spacing at M: M + u and M / 16 + u are exact
    u = np.round(rng.normal(size=(_ROWS, n)) / spacing) * spacing
    departures = [
        _departure(h, round_to(mean + u, dtype), spec, zero_output, gain)
        for mean in (large, large / 16)
    ]
    figures = (
        f"on {_ROWS} rows of unit spread the output departs from the two-pass variance by "
        f"{departures[0]:.2g} of max|y| with mean {large:g} and {departures[1]:.2g} with mean "
        f"{large / 16:g}"
    )
    if departures[0] <= _TWO_PASS:
        return "two_pass", f"variance two_pass: {figures}"
    if departures[0] >= _FAST and departures[1] <= departures[0] / 16:
        fast_ulp = float(ulp(np.float64(large * large), dtype))
        return "fast", (
            f"variance fast (E[x^2] - E[x]^2): {figures}; the departure grows with the square "
            f"of the mean (a fast variance keeps only ulp(M^2) = {fast_ulp:g} of a unit variance)"
        )
    return None, f"variance: undetermined: {figures}"


def _departure(
    h: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    spec: NormSpec,
    zero_output: np.ndarray,
    gain: np.ndarray,
) -> float:
    """How far ``h(x)`` is from the two-pass ``spec``, relative to max|y|."""
    y = h(x) - zero_output
    exact = gain * reference.normalize(x.astype(np.float64), spec)
    return float(np.max(np.abs(y - exact)) / np.max(np.abs(y)))
