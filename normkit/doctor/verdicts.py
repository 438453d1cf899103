"""The verdicts: a stored norm tensor against its runtime's convention.

**With the original** (`compare`), tensor by tensor and exact. The stored values are matched
to the original's plus a shift ``k`` in {0, +1, -1, +2, -2}: within one unit in the last place
of ``original + k`` (of ``|original| + 1`` for a scale, which a conversion may round at ``1 + w``
and back) in the coarser of the two dtypes, or else within one unit of float16 or bfloat16
(rounded through a narrower dtype). A correct conversion has ``k`` = the original
runtime's offset minus this runtime's (``expected``): ``+1`` when a converter bakes Gemma's 1
into the weights for llama.cpp. ``k = expected + 1`` is a doubled offset, ``expected - 1`` a
missing one; a constant factor is ``"scaled"``; anything else ``"different"``.

**Without it** (`read_statistics`), on the effective scale ``m = scale_offset + stored`` the
runtime multiplies by. Rules, and how sure each is:

- a trained norm's effective scales are positive; when at least `MISSING_SHARE` of ``m`` are
  <= 0, ``m`` are deviations ``w`` of a ``1 + w`` model with the 1 missing: ``offset_missing``,
  ``high``.
- ``m`` clustered near 2 (median in `DOUBLED_MEDIAN`, the middle half of the values within
  `DOUBLED_SPREAD` of it) in a model with a ``1 + w`` norm: the runtime adds a 1 the weights
  already hold: ``offset_doubled``, ``medium`` (a trained scale can sit near 2).
- ``m`` positive with median in (0, `DOUBLED_MEDIAN`[0]): ``fine``, ``medium`` when the median
  is within 0.5 of 1 (the initial scale), else ``low``.
- anything else: ``unsure``, ``low``.

A finding is kept only when every tensor of the same module class reads the same way: a
conversion bug moves all of them, a trained model's odd layer does not. These rules rest on
norms staying near their initial scale 1 in the sense above; they are a screen, and
``--against`` is the check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from normkit import dtypes
from normkit.doctor.report import Comparison, Confidence, Convention, Verdict

__all__ = [
    "DOUBLED_MEDIAN",
    "DOUBLED_SPREAD",
    "EPS_TOLERANCE",
    "MISSING_SHARE",
    "Reading",
    "compare",
    "eps_differs",
    "narrower",
    "read_statistics",
    "settle_groups",
]

MISSING_SHARE = 0.25
DOUBLED_MEDIAN = (1.5, 2.5)
DOUBLED_SPREAD = 0.5
#: Relative difference below which two eps are the same (GGUF stores eps in float32).
EPS_TOLERANCE = 1e-5
_SHIFTS = (0.0, 1.0, -1.0, 2.0, -2.0)
_SCALED_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Reading:
    """The offset verdict for one tensor, how sure, and why."""

    verdict: Verdict
    confidence: Confidence
    reason: str


def read_statistics(stored: np.ndarray, convention: Convention, parameter: str,
                    model_has_offset: bool) -> Reading:
    """The offset verdict from the stored values' statistics (rules in the module doc)."""
    if parameter == "bias":
        return Reading("fine", "low", "a bias carries no offset; only its eps and dtype are read")
    m = convention.scale_offset + stored.astype(np.float64).ravel()
    median = float(np.median(m))
    nonpositive = float(np.mean(m <= 0))
    low, high = np.percentile(m, [25, 75])
    scale = f"effective scale {convention.scale_offset:g} + w has median {median:.3g}"
    if nonpositive >= MISSING_SHARE:
        return Reading(
            "offset_missing", "high",
            f"{scale} and {nonpositive:.0%} of it <= 0: the weights are the deviations w of a "
            "1 + w norm and the runtime adds no 1"
            + (f" (the model's offset is {convention.model_offset:g})"
               if convention.model_offset else ""),
        )
    tight = max(median - low, high - median) <= DOUBLED_SPREAD
    if model_has_offset and DOUBLED_MEDIAN[0] <= median <= DOUBLED_MEDIAN[1] and tight:
        held = "w + 1" if convention.scale_offset else "w + 2"
        return Reading(
            "offset_doubled", "medium",
            f"{scale}, its middle half within {DOUBLED_SPREAD:g} of it: the weights hold "
            f"{held} and the runtime adds the offset again",
        )
    if nonpositive == 0 and 0 < median < DOUBLED_MEDIAN[0]:
        baked = convention.model_offset != convention.scale_offset
        verdict: Verdict = "offset_baked_in" if baked and convention.model_offset > 0 else "fine"
        sure: Confidence = "medium" if abs(median - 1) <= 0.5 else "low"
        how = "with the model's 1 baked into the weights" if verdict == "offset_baked_in" else ""
        return Reading(verdict, sure, f"{scale}, all positive {how}".rstrip())
    return Reading("unsure", "low", f"{scale} ({nonpositive:.0%} <= 0): the statistics do not "
                   "tell; compare with the original (--against)")


def settle_groups(readings: dict[str, Reading], groups: dict[str, str]) -> dict[str, Reading]:
    """Keep a statistical finding only where every tensor of its group (``groups``: tensor to
    module class) reads the same; the others become ``unsure``."""
    settled = dict(readings)
    for group in set(groups.values()):
        members = [name for name, g in groups.items() if g == group and name in readings]
        verdicts = {readings[name].verdict for name in members}
        if len(verdicts) == 1:
            continue
        for name in members:
            reading = readings[name]
            if reading.verdict in ("offset_missing", "offset_doubled"):
                others = sorted(verdicts - {reading.verdict})
                settled[name] = Reading(
                    "unsure", "low",
                    f"{reading.reason}; but other {group} tensors read as {', '.join(others)}: "
                    "compare with the original (--against)",
                )
    return settled


def compare(stored: np.ndarray, original: np.ndarray, name: str, expected_shift: float,
            scale: bool = True) -> Comparison:
    """``stored`` against ``original`` (tensor ``name`` of the original), with the relation a
    correct conversion gives (``expected_shift``). A scale (``scale``) may have been rounded at
    ``1 + w`` on its way (an offset added and taken away), so it is compared to a unit of
    ``|w| + 1``. ValueError if the shapes differ."""
    if stored.shape != original.shape:
        raise ValueError(f"shape {stored.shape} differs from the original's {original.shape}")
    s = stored.astype(np.float64)
    o = original.astype(np.float64)
    coarse = min((stored.dtype, original.dtype), key=lambda d: ml_dtypes.finfo(d).nmant)
    expected = _shift_name(expected_shift)
    for k in _SHIFTS:
        target = o + k
        error = np.abs(s - target)
        at = np.maximum(np.abs(target), np.abs(o) + 1) if scale else target
        if np.all(error <= dtypes.ulp(at, coarse)):
            return Comparison(name, _shift_name(k), expected)
        for narrow in (dtypes.float16, dtypes.bfloat16):
            if ml_dtypes.finfo(narrow).nmant < ml_dtypes.finfo(coarse).nmant and np.all(
                error <= dtypes.ulp(at, narrow)
            ):
                return Comparison(name, _shift_name(k), expected, rounded_in=narrow.name)
    nonzero = np.abs(o) > 1e-12
    if np.any(nonzero):
        factor = float(np.median(s[nonzero] / o[nonzero]))
        if np.all(np.abs(s - factor * o) <= _SCALED_TOLERANCE * np.max(np.abs(s))):
            return Comparison(name, "scaled", expected, factor=factor)
    return Comparison(name, "different", expected)


def offset_verdict(comparison: Comparison, parameter: str) -> Reading:
    """The offset verdict of an exact comparison."""
    relation, expected = comparison.relation, comparison.expected
    if relation in ("scaled", "different"):
        how = f" by {comparison.factor:.6g}" if comparison.factor is not None else ""
        return Reading("weights_differ", "exact",
                       f"{relation}{how} from the original's {comparison.original}, expected "
                       f"{expected}")
    k, e = _shift_value(relation), _shift_value(expected)
    if k == e:
        baked = parameter == "weight" and e > 0
        return Reading("offset_baked_in" if baked else "fine", "exact",
                       f"the original's {comparison.original} {relation}, as expected")
    verdict: Verdict = (
        "offset_doubled" if k == e + 1 else "offset_missing" if k == e - 1 else "weights_differ"
    )
    return Reading(verdict, "exact",
                   f"the original's {comparison.original} {relation}, where the runtime needs "
                   f"{expected}")


def eps_differs(eps: float | None, reference: float | None) -> bool:
    """Whether two known eps differ by more than `EPS_TOLERANCE`, relatively."""
    if eps is None or reference is None:
        return False
    return abs(eps - reference) > EPS_TOLERANCE * max(abs(eps), abs(reference))


def narrower(dtype: np.dtype, reference: str | np.dtype | None) -> bool:
    """Whether ``dtype`` keeps fewer mantissa bits than ``reference``."""
    if reference is None:
        return False
    return bool(ml_dtypes.finfo(dtype).nmant < ml_dtypes.finfo(np.dtype(
        dtypes.DTYPE_NAMES.get(str(reference), reference))).nmant)


def lost_precision(stored: np.ndarray, original: np.ndarray, shift: float) -> bool:
    """Whether ``stored`` differs from ``original + shift`` at all (values rounded away)."""
    return bool(np.any(stored.astype(np.float64) != original.astype(np.float64) + shift))


def _shift_name(k: float) -> str:
    return "equal" if k == 0 else f"{k:+g}"


def _shift_value(name: str) -> float:
    return 0.0 if name == "equal" else float(name)


def ordered(verdicts: Sequence[Verdict]) -> tuple[Verdict, ...]:
    """``verdicts`` without repeats, in their order."""
    return tuple(dict.fromkeys(verdicts))
