"""The tolerance policy every normkit conformance check uses, and the measurement behind it.

An array computed by an implementation (``actual``) is compared with ``normkit.reference``'s
(``expected``), according to the dtype of ``actual``:

================  =================================  ============================================
dtype             forward output                     gradients (input, scale, bias)
================  =================================  ============================================
float32, float64  max abs error <= 1e-6 * max|ref|   max abs error <= 1e-5 * max|ref|
float16, bfloat16 <= 1 ulp (2 with before_scale)      <= 2 ulps
================  =================================  ============================================

The float32/float64 bounds hold on zero-mean, unit-scale inputs (the inputs conformance draws).
For half dtypes the forward reference is itself rounded to the dtype, so "1 ulp" allows a final
rounding that went the other way; ``before_scale`` rounds twice, hence 2. Half-precision
gradients are compared with the exact float64 gradient.

Units in the last place are those of the measured dtype at the reference value, but never
smaller than the ulp at ``ULP_FLOOR * max|ref|``: an element much smaller than the largest one
is the difference of terms of the largest size, and float32 arithmetic resolves it only to
their precision, not to its own. With ``before_scale`` the rounding of ``y_hat`` happens before
the scale and bias, so its ulps are those of ``y_hat * (scale_offset + w)``; where the bias
cancels that term, ``y`` is far smaller than it. The forward check then takes ulps at the larger
of ``|y|`` and ``|y_hat * (scale_offset + w)|`` (the ``magnitude`` argument of `measure`).

NaN and infinity must appear exactly where the reference has them; a reference value beyond
the measured dtype's range counts as the infinity it rounds to.

The same bounds serve the extended spec (`normkit.conformance.compare.tolerance` applies them):

- ``backward="autograd"`` needs no tier of its own. Its reference rounds every gradient where
  autograd does, so an implementation of that program differs from it only where its float32
  arithmetic lands a value on the other side of a rounding midpoint: one rounding of ``dx``
  (1 ulp, within ``GRAD_ULPS``), or one ``z = round(y_hat)`` in a product ``dy z`` of the
  scale's gradient. That product then moves by ``|dy| ulp(z) <= ulp(2 |dy z|)``, so the scale's
  gradient is measured in ulps of the input dtype (where ``z`` is rounded) at
  ``2 max_rows |dy y_hat|``: at most 1 ulp for the product and 1 for the final rounding,
  within ``GRAD_ULPS``. (Measured on Hugging Face's eager LlamaRMSNorm: at most 0.5 of the
  bound over 236 cases; without that magnitude 7 of them fail.)
- With ``output_dtype="promote"`` and ``cast="before_scale"`` the output is checked in ulps of
  the input dtype, where ``y_hat`` is rounded, at ``|y_hat * (scale_offset + w)|``, as above.
- With a residual, ``dx = dresidual = dh + dnorm``; ulps are taken at ``|dh|`` too, the size
  of the terms an element where the two cancel is computed from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from normkit import dtypes
from normkit.spec import Cast

Quantity: TypeAlias = Literal["forward", "grad"]
Unit: TypeAlias = Literal["max_abs / max|ref|", "ulp"]

FORWARD_REL = 1e-6
GRAD_REL = 1e-5
FORWARD_ULPS = 1.0
FORWARD_ULPS_BEFORE_SCALE = 2.0
GRAD_ULPS = 2.0
ULP_FLOOR = 2.0**-10

__all__ = ["Bound", "Measurement", "bound", "measure", "assert_close", "ULP_FLOOR"]


@dataclass(frozen=True)
class Bound:
    """The largest error allowed, in ``unit``."""

    value: float
    unit: Unit


def bound(dtype: npt.DTypeLike, quantity: Quantity = "forward", cast: Cast = "after_scale") -> Bound:
    """The tolerance for an array of ``dtype``: a forward output or a gradient."""
    if quantity not in ("forward", "grad"):
        raise ValueError(f"quantity={quantity!r} is invalid: expected 'forward' or 'grad'")
    if not dtypes.is_half(dtypes.as_float_dtype(dtype, "the measured array")):
        return Bound(FORWARD_REL if quantity == "forward" else GRAD_REL, "max_abs / max|ref|")
    if quantity == "grad":
        return Bound(GRAD_ULPS, "ulp")
    return Bound(FORWARD_ULPS_BEFORE_SCALE if cast == "before_scale" else FORWARD_ULPS, "ulp")


@dataclass(frozen=True)
class Measurement:
    """How far ``actual`` is from ``expected``, and whether that is within ``bound``.

    ``max_abs``: the largest absolute difference; ``max_rel``: the largest difference relative to
    the reference value (over non-zero reference values); ``max_ulp``: the largest difference in
    units in the last place of ``dtype`` (with the floor of the module docstring); ``ref_scale``:
    max|ref|. ``error`` is the figure compared with ``bound`` (the relative-to-max error or
    ``max_ulp``). ``nonfinite_mismatch`` counts elements where NaN/inf differ from the reference.
    """

    dtype: str
    max_abs: float
    max_rel: float
    max_ulp: float
    ref_scale: float
    error: float
    bound: Bound
    nonfinite_mismatch: int
    worst_index: tuple[int, ...] | None

    @property
    def passed(self) -> bool:
        return self.nonfinite_mismatch == 0 and self.error <= self.bound.value

    def describe(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        text = (
            f"{status} [{self.dtype}] error {self.error:.3g} {self.bound.unit} "
            f"(bound {self.bound.value:g}); max abs {self.max_abs:.3g}, max rel "
            f"{self.max_rel:.3g}, max ulp {self.max_ulp:.3g}, max|ref| {self.ref_scale:.3g}"
        )
        if self.worst_index is not None:
            text += f", worst at {self.worst_index}"
        if self.nonfinite_mismatch:
            text += f"; {self.nonfinite_mismatch} elements NaN/inf where the reference is not"
        return text

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["passed"] = self.passed
        d["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        return d


def measure(
    actual: npt.ArrayLike,
    expected: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    quantity: Quantity = "forward",
    cast: Cast = "after_scale",
    magnitude: npt.ArrayLike | None = None,
) -> Measurement:
    """Compare ``actual`` with the reference ``expected`` under the policy above.

    ``dtype`` is the dtype whose tolerance and ulps apply; by default ``actual``'s.
    ``magnitude``, if given, is the size of the terms each element was computed from (of
    ``expected``'s shape): ulps are taken at the larger of it and ``|expected|``.
    Raises ValueError if the shapes differ.
    """
    act = np.asarray(actual)
    exp = np.asarray(expected)
    if act.shape != exp.shape:
        raise ValueError(f"actual has shape {act.shape}, the reference {exp.shape}")
    measured = dtypes.as_float_dtype(act.dtype if dtype is None else dtype, "the measured array")
    limit = bound(measured, quantity, cast)
    a = act.astype(np.float64)
    e = exp.astype(np.float64)
    # A reference value beyond the dtype's range rounds to infinity, which is then the answer.
    with np.errstate(invalid="ignore"):
        overflows = np.isfinite(e) & np.isinf(dtypes.round_to(e, measured).astype(np.float64))
    e = np.where(overflows, np.copysign(np.inf, e), e)
    finite = np.isfinite(e)
    same_nonfinite = (np.isnan(a) & np.isnan(e)) | (~np.isnan(e) & ~finite & (a == e))
    mismatch = int(np.count_nonzero(~finite & ~same_nonfinite))
    mismatch += int(np.count_nonzero(finite & ~np.isfinite(a)))
    both = finite & np.isfinite(a)
    ref_scale = float(np.max(np.abs(e), where=finite, initial=0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.where(both, np.abs(a - e), 0.0)
        rel = np.where(both & (e != 0), diff / np.abs(e), 0.0)
    at = np.maximum(np.abs(e), ULP_FLOOR * ref_scale)
    if magnitude is not None:
        at = np.maximum(at, np.abs(np.broadcast_to(np.asarray(magnitude, np.float64), e.shape)))
    ulps = diff / dtypes.ulp(np.where(both, at, 1.0), measured)
    max_abs = float(diff.max(initial=0.0))
    max_ulp = float(ulps.max(initial=0.0))
    if limit.unit == "ulp":
        error = max_ulp
        worst = ulps
    else:
        error = max_abs / ref_scale if ref_scale > 0 else max_abs
        worst = diff
    worst_index = None
    if worst.size:
        worst_index = tuple(int(i) for i in np.unravel_index(int(np.argmax(worst)), worst.shape))
    return Measurement(
        dtype=measured.name,
        max_abs=max_abs,
        max_rel=float(rel.max(initial=0.0)),
        max_ulp=max_ulp,
        ref_scale=ref_scale,
        error=error,
        bound=limit,
        nonfinite_mismatch=mismatch,
        worst_index=worst_index,
    )


def assert_close(
    actual: npt.ArrayLike,
    expected: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    quantity: Quantity = "forward",
    cast: Cast = "after_scale",
    what: str = "",
    magnitude: npt.ArrayLike | None = None,
) -> Measurement:
    """`measure`, raising AssertionError with the figures when the bound is exceeded."""
    m = measure(actual, expected, dtype, quantity, cast, magnitude)
    if not m.passed:
        raise AssertionError(f"{what + ': ' if what else ''}{m.describe()}")
    return m
