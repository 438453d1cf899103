"""The rows a case draws (`normkit.conformance.cases.Case.rows`), each kind made for the fields
of the spec that unit-scale rows cannot show.

- ``"standard"``: zero-mean, unit-scale ``x`` and ``dy`` (standard normal).
- ``"eps"``: rows whose statistic lies at eps and below it, for both placements: row sizes
  ``t`` of 1, ``sqrt(eps)`` (where ``s = eps``, inside the sqrt), ``eps`` (where ``sqrt(s) =
  eps``, outside it), ``sqrt(eps) / 8`` and ``eps / 8`` (below), then 8 times each, in turn
  over the rows. There eps sets the output: an eps of another value or placement moves it by
  tens of percent (unit-scale rows move by ``eps / 2``, within the float32 bound for eps up to
  about 2e-6). Each row's ``dy`` is scaled by ``1 / r(s)`` of its size, so that every row's
  ``dx`` is of unit size.
- ``"large_mean"``: LayerNorm rows ``M + u`` with a mean far beyond their spread (``M = 2^20``
  in float64, ``2^10`` otherwise) whose elements are exact in the dtype and sum exactly to
  ``n M``: the two-pass variance is accurate to the compute dtype's precision relative to the
  input (its error grows with the condition ``max|x| / std(x)``, `condition`, and the bounds
  on these rows grow with it, `bound_factor`), while ``mean(x^2) - mean(x)^2`` cancels and
  keeps only ``ulp(M^2)``. float16 rows (integers around 1024) have squares and short sums
  exact in float32, so the fast variance of rows up to 16 elements is exact up to its own
  steps' roundings, and a fast-variance spec is checked on them too.
- ``"ties"``: half-precision rows of size 0.5 to 1.5 and parameters exact in both half dtypes
  (small ones with an offset, so that ``offset + w`` rounds in a half dtype), where the
  spec's roundings (the cast order, the offset dtype, the rounding of a residual sum) predict
  outputs an ulp apart on many elements: `normkit.conformance.compare` counts which one the
  output follows (`compare.rounding_problems`).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from normkit import dtypes
from normkit.identify.forward import representable
from normkit.spec import NormSpec

ROWS = ("standard", "eps", "large_mean", "ties")
"""The kinds of rows a case may draw."""

_SIZES_PER_DTYPE = {"float64": (2.0**20, 2.0**-20, 1.0), "float32": (2.0**10, 2.0**-8, 1.0),
                    "float16": (2.0**10, 1.0, 1.5), "bfloat16": (2.0**10, 8.0, 16.0)}
"""Per input dtype, the large mean ``M``, the step ``u`` is a multiple of (exact beside ``M``)
and ``u``'s spread."""
_EXACT_FAST_N = 16  # float16 rows up to this size have exact sums of squares in float32
_TIES_OFFSET_SCALE = 0.0625  # |w| below 1/8 makes offset + w round in a half dtype


def applies(rows: str, spec: NormSpec, dtype: str, n: int) -> bool:
    """Whether ``rows`` can be drawn for ``spec`` on ``dtype`` inputs of ``n`` elements per row
    (per group with ``group_size``): eps rows need an eps (not DyT); large-mean rows a mean (kind
    "layer"), and with the fast variance float16 rows short enough for exact sums; tie rows a
    half dtype."""
    if rows not in ROWS:
        raise ValueError(f"rows={rows!r} is invalid: expected one of {ROWS}")
    if rows == "eps":
        return spec.kind != "dyt"
    if rows == "large_mean":
        if spec.kind != "layer":
            return False
        return spec.variance != "fast" or (dtype == "float16" and n <= _EXACT_FAST_N)
    if rows == "ties":
        return dtypes.is_half(dtypes.DTYPE_NAMES[dtype])
    return True


def row_sizes(spec: NormSpec, dtype: str, count: int) -> np.ndarray:
    """The sizes ``t`` of ``count`` eps rows (see the module doc), none so small that the rows
    would be mostly subnormal in ``dtype`` or their squares subnormal in the compute dtype."""
    assert spec.eps is not None
    inside, outside = math.sqrt(spec.eps), spec.eps
    cycle = [1.0, inside, outside, inside / 8, outside / 8, 8 * inside, 8 * outside]
    kind = dtypes.DTYPE_NAMES[dtype]
    compute_tiny = 2.0**-500 if kind == dtypes.float64 else 2.0**-60
    smallest = max(64 * float(ml_dtypes.finfo(kind).smallest_subnormal), compute_tiny)
    return np.array([max(cycle[i % len(cycle)], smallest) for i in range(count)])


def r_inverse(spec: NormSpec, t: np.ndarray) -> np.ndarray:
    """``1 / r(t^2)``, the size a row of size ``t`` is divided by."""
    assert spec.eps is not None
    if spec.eps_placement == "outside":
        return t + spec.eps
    return np.sqrt(t * t + spec.eps)


def large_mean(
    rng: np.random.Generator, shape: tuple[int, ...], axes: tuple[int, ...], dtype: str
) -> np.ndarray:
    """Rows ``M + u`` of ``shape`` over ``axes``, exact in ``dtype``: ``u`` a multiple of the
    dtype's step beside ``M``, in pairs ``(v, -v)`` (an odd row's last element 0), so that each
    row sums exactly to ``n M``."""
    mean, step, spread = _SIZES_PER_DTYPE[dtype]
    rows, n = _as_rows(shape, axes)
    half = rng.standard_normal((rows, n // 2)) * spread
    v = np.where(half < 0, -1.0, 1.0) * np.maximum(np.round(np.abs(half) / step), 1.0) * step
    u = np.zeros((rows, n))
    u[:, 0 : 2 * (n // 2) : 2], u[:, 1 : 2 * (n // 2) : 2] = v, -v
    return _from_rows(mean + u, shape, axes)


def condition(values: np.ndarray, spec: NormSpec) -> float:
    """``max|v| / std(v)`` over the rows (groups) of ``values``, 1 at least: how much a rounding
    of the input relative to its size moves a centered, normalized output."""
    axes = spec.resolve_axes(values.ndim)
    _, n = _as_rows(values.shape, axes)
    group = spec.group_size or n
    rows = _to_rows(values.astype(np.float64), axes).reshape(-1, group)
    spread = rows.std(axis=1)
    largest = np.max(np.abs(rows), axis=1)
    ratios = np.where(spread > 0, largest / np.where(spread > 0, spread, 1.0), 1.0)
    return max(1.0, float(ratios.max(initial=1.0)))


def bound_factor(values: np.ndarray, spec: NormSpec, dtype: str) -> float:
    """How much the relative bounds (float32 and float64 outputs) grow on large-mean rows: the
    compute dtype's roundings of the input, carried through the centering, cost
    ``condition(values) * u`` (``u`` its unit roundoff) relative to the output; the bounds hold
    ``1e-6`` and ``1e-5`` of it at the float32 ``u``."""
    unit = 2.0**-53 if dtype == "float64" else 2.0**-24
    return max(1.0, condition(values, spec) * unit / 2.0**-24)


def ties(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: str
) -> np.ndarray:
    """Signed values of size 0.5 to 1.5, rounded to ``dtype``."""
    signs = rng.choice([-1.0, 1.0], shape)
    return dtypes.round_to(signs * rng.uniform(0.5, 1.5, shape), dtypes.DTYPE_NAMES[dtype])


def ties_params(
    rng: np.random.Generator, spec: NormSpec, shape: tuple[int, ...]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``w`` and ``b`` exact in both half dtypes: ``w`` of size about 1, or 1/16 with an offset
    (so that ``offset + w`` rounds in a half dtype); ``b`` of size about 1/4."""
    size = math.prod(shape)
    w = b = None
    if spec.scale:
        magnitude = 1.0 if spec.scale_offset == 0 else _TIES_OFFSET_SCALE
        w = representable(rng, size, magnitude).reshape(shape)
    if spec.bias:
        b = representable(rng, size, 0.25).reshape(shape)
    return w, b


def per_row(
    factors: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]
) -> np.ndarray:
    """``factors`` (one per row) shaped to broadcast over an array of ``shape`` whose rows run
    over ``axes``."""
    kept = [shape[i] if i not in axes else 1 for i in range(len(shape))]
    return factors.reshape(kept)


def row_count(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
    """How many rows an array of ``shape`` normalized over ``axes`` has."""
    return _as_rows(shape, axes)[0]


def _as_rows(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int]:
    n = math.prod(shape[a] for a in axes)
    return math.prod(shape) // n, n


def _to_rows(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    trailing = tuple(range(a.ndim - len(axes), a.ndim))
    return np.moveaxis(a, axes, trailing).reshape(_as_rows(a.shape, axes))


def _from_rows(rows: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    kept = [shape[i] for i in range(len(shape)) if i not in axes]
    moved = rows.reshape(*kept, *(shape[a] for a in axes))
    trailing = tuple(range(len(shape) - len(axes), len(shape)))
    return np.moveaxis(moved, trailing, axes)
