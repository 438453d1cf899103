"""Infer the `NormSpec` a black-box ``forward(x, scale, bias) -> y`` follows, by probing it.

`identify_forward` treats the implementation as a black box ``forward(x, scale, bias) -> y`` on
rows of ``n`` elements. It works in numpy only; the framework bridges wrap a torch, Keras or Flax
layer as such a ``forward``.

Model. Every kind computes, per row, ``y = ŷ · G + B`` with ``ŷ = c · r(s)``, where ``c`` is the
row (centered for LayerNorm), ``s`` the mean of ``c_i²`` over the first ``k`` elements,
``r(s) = 1 / sqrt(s + eps)`` (inside) or ``1 / (sqrt(s) + eps)`` (outside), ``G = scale_offset + w``
and ``B = b``; DyT has ``ŷ = tanh(alpha x)``. The probes, in order (the structure is probed in
the most precise dtype asked for, float32 by default):

1. Parameters (``accepts_params=True`` only). With ``b = 0``, ``f(x; w=0) = offset · ŷ`` and
   ``f(x; w=1) = (offset + 1) · ŷ``: their difference is ``ŷ`` and their ratio gives the offset;
   no difference means the implementation has no scale. A known ``b`` either moves the output by
   exactly ``b`` (bias) or not at all (no bias). Every later probe passes ``w = 1 - offset`` and
   ``b = 0``, so it sees ``ŷ`` itself.
2. ``B = f(0)``: a zero row has ``ŷ = 0`` under every kind and placement; the output must
   depend on the input.
2b. Elementwise: if a large first, middle or last element changes no other output of its row,
   there is no statistic: the kind is DyT, and ``alpha`` comes from ``f(2x) / f(x)``
   (`normkit.identify.dyt`); a function no fixed ``alpha`` fits is rejected. DyT skips 3 to 6.
3. Scale invariance: a norm gives ``f(512 x) = f(256 x)`` (eps is negligible at that size); the
   identity, or any homogeneous function, does not.
4. The statistic's support: setting ``x_j`` to a large value of the opposite sign changes the
   *other* outputs of the row only if ``x_j`` enters the statistic, i.e. ``j < k`` (LayerNorm:
   every ``j``, through the mean). One batched probe per ``j`` for ``n <= 256``; above that a
   batched 32-way search for the boundary, then spot checks. ``k < n`` means partial RMSNorm; an
   elementwise function (no ``j`` affects the others) is rejected here.
5. Kind, when ``k = n``: LayerNorm is exactly shift-invariant, ``f(x + 4) = f(x)`` (the rows are
   built so that ``x + 4`` is exact in the probe dtype); RMSNorm is far from it.
6. eps: rows ``t · u`` for ``t`` from 1e-12 (or the dtype's smallest useful size) to 1e3 in
   eighth decades, in one call; ``u`` has entries of size 0.5 to 1.5 (zero-mean ± pairs for
   LayerNorm). Per element, ``(y - B) / c`` is
   ``G · r(s)``; divided by its value at the largest ``t = T`` it gives ``a = r(s_t) / r(s_T)``,
   free of ``G``, and each placement solves exactly for eps from ``a``, ``s_t`` and ``s_T``::

       inside:   eps = (s_T - a² s_t) / (a² - 1)
       outside:  eps = (sqrt(s_T) - a sqrt(s_t)) / (a - 1)

   Only rows where eps shows are used: relative output size ``ρ = a sqrt(s_t / s_T)`` in
   ``[1e-3, 0.98]``, i.e. ``t`` below about ``5 sqrt(eps)`` (inside) or ``50 eps`` (outside),
   which keeps float32 rounding far below the 10% target. The true placement gives the same eps
   at every ``t``; the other drifts by a factor of 10 or more across the transition, so the
   placement with the smaller spread wins and eps is the median of its estimates, kept to the
   significant digits the spread supports (2 to 6).
7. Check: the identified spec must reproduce the output on fresh rows with non-zero means, at
   unit and large size and around the eps transition (up to a per-element scale ``G`` fitted by
   least squares when the layer's own parameters are in use). A function that passed the probes
   above but is none of the kinds (e.g. Keras' ``rms_scaling`` LayerNormalization, which
   centers the variance but not the output) fails here.
7b. LayerNorm's variance, two-pass or fast, from rows with a large mean
   (`normkit.identify.variance`; float32 and float64 probes only).
8. Half precision, per half dtype asked for: the output dtype with float32 parameters (the input
   dtype, ``output_dtype="input"``, or float32, ``"promote"``), the error against the
   reference, the cast order and, with an offset, where ``offset + w`` is computed. With
   parameters, ``w`` and ``b`` exactly representable in both half dtypes make
   ``"before_scale"`` (``ŷ`` rounded before the affine step) and ``"after_scale"`` predict
   different outputs on many elements; the order the output is closer to on at least 90% of
   those elements is the answer. Elements within ``2^-18`` of a rounding midpoint are left out:
   there a float32 implementation (or eps lost in a float32 sum) may round either way, and
   half-precision inputs and parameters make exact ties common. With an offset, ``|w| < 1/8``
   makes ``offset + w`` round in the half dtype on most elements; the output then also tells
   ``offset_dtype="param"`` (parameters held in the input dtype, the sum rounded there) from
   ``"float32"``. The best of the (cast, offset dtype) predictions is compared with the one
   that differs in each field alone.

A forward probe has one input and one output: a ``residual`` cannot be seen (an add and norm is
identified as the norm of ``h``), nor the ``backward`` rounding model (always undetermined).

What cannot be determined is listed in `Identification.undetermined`, never guessed, and the
spec takes the field's `NormSpec` default (DyT's ``alpha_init`` is the layer's current alpha).
Without parameters the layer's own are used: no scale and a fixed scale, offset 0 with
``w = 1`` and offset 1 with ``w = 0``, no bias and a zero bias give the same function, and at
the initial values (``G = 1, B = 0``) both cast orders round ``ŷ`` once. (A trained layer's
non-zero bias shows in ``f(0)``, and its ``w != 1`` can reveal the cast order.) An eps too small
to change any probe (below about 4e-26 inside, 2e-14 outside, in float32) is reported as such.
``p`` is known only to the interval of fractions that give the same
``k`` for this ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import ml_dtypes
import numpy as np
import numpy.typing as npt

from normkit import reference, tolerances
from normkit.dtypes import as_float_dtype, is_half, round_to, ulp
from normkit.identify.dyt import fit_alpha
from normkit.identify.variance import variance_verdict
from normkit.spec import Cast, EpsPlacement, Kind, NormSpec, OffsetDtype, OutputDtype

__all__ = ["Forward", "Identification", "identify_forward"]

Forward: TypeAlias = Callable[[np.ndarray, np.ndarray | None, np.ndarray | None], np.ndarray]
"""``forward(x, scale, bias) -> y`` on a 2-D ``x`` of rows; ``scale``/``bias`` are the stored
``w`` and ``b`` (float32, length ``n``) or None for "leave the layer's own". A parameter the
implementation does not have must be ignored."""

_NOT_A_NORM = "does not behave like RMSNorm, partial RMSNorm, LayerNorm or DyT: "

_SEED = 0
_T_MIN, _T_MAX = 1e-12, 1e3  # the eps sweep's row sizes
_STEPS_PER_DECADE = 8
_RHO_MIN = 1e-3  # the smallest relative output size an eps probe may have
_MIN_EPS_PROBES = 3
_FULL_SCAN_MAX_N = 256  # up to this n, the statistic's support is probed at every j
_SEARCH_WIDTH = 32
_SPOT_CHECKS = 64
_INFLUENCE = 0.1  # relative change of the other outputs that counts as "j enters the statistic"
_SCALE_INVARIANCE = 0.1
_RMS_SHIFT = 0.1  # relative change under a shift that rules LayerNorm out
_CAST_AGREEMENT = 0.9
MIN_CAST_ELEMENTS = 16
_TIE_DISTANCE = (
    2.0**-18
)  # relative distance to a rounding midpoint within which float32 may go either way
HALF_PROBE_ELEMENTS = 4096


@dataclass(frozen=True)
class Identification:
    """What `identify_forward` found.

    ``spec`` is the best inference; a field listed in ``undetermined`` could not be determined
    from the implementation's outputs and holds its `NormSpec` default. ``notes`` are the
    findings behind each field, with their figures.
    """

    spec: NormSpec
    undetermined: tuple[str, ...]
    notes: tuple[str, ...]

    def describe(self) -> str:
        """A multi-line, human-readable report."""
        lines = [repr(self.spec)]
        lines.append(
            "undetermined: " + (", ".join(self.undetermined) if self.undetermined else "none")
        )
        lines.extend(f"- {note}" for note in self.notes)
        return "\n".join(lines)


def identify_forward(
    forward: Forward,
    n: int,
    *,
    accepts_params: bool,
    dtypes: Sequence[npt.DTypeLike | str] = ("float32", "bfloat16", "float16"),
) -> Identification:
    """Infer the `NormSpec` that ``forward`` follows on rows of ``n`` elements.

    Args:
      forward: the implementation, see `Forward`.
      n: the row length (the size of the normalized axes), at least 2.
      accepts_params: whether ``forward`` may be given ``w`` and ``b``. Without them the
        implementation's own parameters are used, and the scale, the offset, a zero bias and
        (at the initial ``w``) the cast order cannot be determined.
      dtypes: the input dtypes to probe. The structure and eps are probed in the most precise
        one (float32 or float64 recommended: in a half dtype eps comes out only to about 1-2%,
        and float16 cannot show an eps below about 1e-7 outside the sqrt); the cast order and
        the output dtype in each half-precision one.

    Raises:
      ValueError: ``n < 2``, no dtype, or ``forward`` is none of the kinds (the message
        says which probe failed and by how much).
      TypeError: a dtype that normkit does not support.
    """
    if n < 2:
        raise ValueError(f"identify needs rows of at least 2 elements, got n={n}")
    resolved = list(dict.fromkeys(as_float_dtype(d, "a probed dtype") for d in dtypes))
    if not resolved:
        raise ValueError("identify needs at least one dtype to probe")
    probe_dtype = max(resolved, key=lambda d: ml_dtypes.finfo(d).nmant)
    rng = np.random.default_rng(_SEED)
    notes: list[str] = []
    undetermined: list[str] = []

    prober = _Prober(forward, n, probe_dtype)
    measured = _probe_params(prober, rng, notes) if accepts_params else None
    if measured is not None:  # from here on the probes see ŷ itself
        prober.scale = np.full(n, 1.0 - measured.offset, np.float32) if measured.scale else None
        prober.bias = np.zeros(n, np.float32) if measured.bias else None
    zero_output = prober.h(np.zeros((1, n), probe_dtype))[0]
    _check_depends(prober, rng, zero_output)
    if _elementwise(prober, rng, zero_output):
        structure, fit = _dyt_structure(prober, rng, zero_output, notes)
    else:
        structure, fit = _structure(prober, rng, zero_output, notes, undetermined)
    gain = _verify(prober, rng, structure, fit, zero_output, fit_gain=measured is None, notes=notes)
    if structure.kind == "layer":
        variance, finding = variance_verdict(
            prober.h, n, probe_dtype, rng, structure, zero_output, gain
        )
        notes.append(finding)
        if variance is None:
            undetermined.append("variance")
        structure = structure.replace(variance=variance or "two_pass")

    affine = measured or _affine_without_params(prober, zero_output, notes, undetermined)
    halves = [d for d in resolved if is_half(d)]
    half = _half_findings(prober, rng, halves, structure, measured, gain, zero_output, notes)
    undetermined += [name for name, value in half.items() if value is None]

    spec = structure.replace(
        scale=affine.scale,
        scale_offset=affine.offset,
        bias=None if "bias" in undetermined else affine.bias,
        cast=half["cast"] or "after_scale",
        offset_dtype=half["offset_dtype"] or "float32",
        output_dtype=half["output_dtype"] or "input",
    )
    notes += _UNOBSERVABLE
    undetermined.append("backward")
    notes.append(f"{prober.calls} calls to the implementation")
    in_field_order = tuple(f for f in spec.to_dict() if f in undetermined)
    return Identification(spec, in_field_order, tuple(notes))


_UNOBSERVABLE = [
    "residual: none; the probes call forward(x) -> y, one input and one output (an add and "
    "norm's h = x + residual is identified as the norm of h)",
    "backward: undetermined (the probes see the forward only; the rounding of half-precision "
    "gradients shows in a conformance run)",
]


def _dyt_structure(
    prober: _Prober, rng: np.random.Generator, zero_output: np.ndarray, notes: list[str]
) -> tuple[NormSpec, _EpsFit]:
    """DyT's alpha, for an elementwise implementation (no element affects the others)."""
    tolerance = max(0.05, 32 * prober.res)
    fit = fit_alpha(prober.h, prober.n, prober.dtype, rng, zero_output, tolerance)
    if fit.alpha is None:
        raise ValueError(
            _NOT_A_NORM + "it acts elementwise, with no statistic over the row, and is not DyT "
            f"(w tanh(alpha x) + b): {fit.note}"
        )
    alpha = _significant(fit.alpha, fit.spread)
    notes.append(f"kind dyt: no element affects the rest of its row; {fit.note}")
    return NormSpec("dyt", alpha_init=alpha), _EpsFit(None, None, fit.spread, fit.note)


def _structure(
    prober: _Prober,
    rng: np.random.Generator,
    zero_output: np.ndarray,
    notes: list[str],
    undetermined: list[str],
) -> tuple[NormSpec, _EpsFit]:
    """Kind, partial fraction, eps and placement (steps 3 to 6 of the module doc)."""
    n = prober.n
    _check_scale_invariance(prober, rng, zero_output)
    k = _statistic_support(prober, rng, zero_output)
    kind = _kind(prober, rng, k, zero_output, notes)
    p = _fraction(k, n) if kind == "partial_rms" else None
    if p is not None:
        notes.append(_fraction_note(k, n, p))
    fit = _measure_eps(prober, rng, kind, k, zero_output)
    notes.append(fit.note)
    if fit.eps is None:
        undetermined.append("eps")
    if fit.placement is None:
        undetermined.append("eps_placement")
    structure = NormSpec(
        kind, eps=fit.eps or NormSpec.eps, eps_placement=fit.placement or "inside", p=p
    )
    return structure, fit


def _half_findings(
    prober: _Prober,
    rng: np.random.Generator,
    halves: list[np.dtype],
    structure: NormSpec,
    measured: _Affine | None,
    gain: np.ndarray,
    zero_output: np.ndarray,
    notes: list[str],
) -> dict[str, str | None]:
    """Cast order, offset dtype and output dtype from the half dtypes (step 8); None where they
    do not show or disagree (with a note why).

    The cast order must show in every half dtype; the offset dtype and output dtype in at least
    one, with none disagreeing.
    """
    found = [
        _probe_half(prober, rng, half, structure, measured, gain, zero_output, notes)
        for half in halves
    ]
    casts = [f.cast for f in found]
    cast = casts[0] if casts and all(c == casts[0] for c in casts) else None
    if not casts:
        notes.append("cast, offset_dtype, output_dtype: no half-precision dtype was probed")
    elif len({c for c in casts if c is not None}) > 1:
        notes.append("cast: the half dtypes disagree on the cast order")
    offsets: set[str] = {f.offset_dtype for f in found if f.offset_dtype}
    outputs: set[str] = {f.output_dtype for f in found if f.output_dtype}
    for name, values in (("offset_dtype", offsets), ("output_dtype", outputs)):
        if len(values) > 1:
            notes.append(f"{name}: the half dtypes disagree ({sorted(values)})")
    offset: str | None = offsets.pop() if len(offsets) == 1 else None
    if measured is not None and measured.offset == 0:
        offset = "float32"  # the only value without an offset
    return {
        "cast": cast,
        "offset_dtype": offset,
        "output_dtype": outputs.pop() if len(outputs) == 1 else None,
    }


class _Prober:
    """Calls the implementation and checks what comes back."""

    def __init__(self, forward: Forward, n: int, dtype: np.dtype) -> None:
        self.forward = forward
        self.n = n
        self.dtype = dtype
        self.res = float(ml_dtypes.finfo(dtype).eps)
        self.scale: np.ndarray | None = None  # what the structural probes pass
        self.bias: np.ndarray | None = None
        self.calls = 0

    def round(self, values: npt.ArrayLike, dtype: np.dtype | None = None) -> np.ndarray:
        """``values`` rounded to the probe dtype (or ``dtype``)."""
        return round_to(values, self.dtype if dtype is None else dtype)

    def call(self, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
        """The implementation's output for ``x`` as returned (shape and finiteness checked)."""
        self.calls += 1
        y = np.asarray(self.forward(x, scale, bias))
        if y.shape != x.shape:
            raise ValueError(
                _NOT_A_NORM + f"it returned shape {y.shape} for an input of shape {x.shape}"
            )
        as_float_dtype(y.dtype, "the implementation's output")
        bad = ~np.isfinite(y.astype(np.float64))
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise ValueError(
                _NOT_A_NORM + f"its output is not finite for a finite {x.dtype} input row "
                f"(max |x| = {_max_abs(x[row].astype(np.float64)):.3g})"
            )
        return y

    def h(self, x: np.ndarray) -> np.ndarray:
        """The output in float64, with the structural parameters (``ŷ`` itself if they are set)."""
        return self.call(x, self.scale, self.bias).astype(np.float64)


@dataclass(frozen=True)
class _Affine:
    scale: bool
    offset: float
    bias: bool


def _probe_params(prober: _Prober, rng: np.random.Generator, notes: list[str]) -> _Affine:
    """Scale, offset and bias from ``f(x; w=0, b=0)``, ``f(x; w=1, b=0)`` and ``f(x; w=1, b=β)``."""
    n = prober.n
    x = prober.round(rng.choice([-1.0, 1.0], (8, n)) * rng.uniform(0.5, 1.5, (8, n)))
    zeros, ones = np.zeros(n, np.float32), np.ones(n, np.float32)
    beta = representable(rng, n, 1.0)
    at_zero = prober.call(x, zeros, zeros).astype(np.float64)
    at_one = prober.call(x, ones, zeros).astype(np.float64)
    with_beta = prober.call(x, ones, beta).astype(np.float64)
    tol = 8 * prober.res
    size = _max_abs(at_one)
    if size == 0:
        raise ValueError(_NOT_A_NORM + "its output is zero for non-zero rows with w = 1")
    y_hat = at_one - at_zero
    if _max_abs(y_hat) > tol * size:
        offset = float(np.vdot(at_zero, y_hat) / np.vdot(y_hat, y_hat))
        residual = _max_abs(at_zero - offset * y_hat) / size
        if residual > tol:
            raise ValueError(
                _NOT_A_NORM + "the scale passed is not applied as (scale_offset + w) · ŷ: "
                f"f(x; w=0) departs from a multiple of f(x; w=1) - f(x; w=0) by {residual:.2g} "
                "of max|y|"
            )
        nearest = round(offset)
        if abs(offset - nearest) <= tol * max(1.0, abs(offset)):
            offset = float(nearest)
        notes.append(
            f"scale: present; scale_offset {offset:.6g} (with w = 0 the output is "
            f"{offset:.6g} · ŷ, where ŷ = f(x; w=1) - f(x; w=0))"
        )
        has_scale = True
    else:
        offset, has_scale = 0.0, False
        notes.append("scale: none (the w passed does not change the output)")
    moved = with_beta - at_one
    if _max_abs(moved) <= tol * size:
        has_bias = False
        notes.append("bias: none (the b passed does not change the output)")
    elif _max_abs(moved - beta) <= tol * (size + _max_abs(beta)):
        has_bias = True
        notes.append("bias: present (the b passed is added to the output)")
    else:
        raise ValueError(
            _NOT_A_NORM
            + "the bias passed is neither added to the output nor ignored: it moves the "
            f"output by up to {_max_abs(moved):.3g} for |b| <= {_max_abs(beta):.3g}"
        )
    return _Affine(has_scale, offset, has_bias)


def _affine_without_params(
    prober: _Prober, zero_output: np.ndarray, notes: list[str], undetermined: list[str]
) -> _Affine:
    """What the layer's own parameters reveal: only a bias that is not zero, through ``f(0)``."""
    undetermined += ["scale", "scale_offset"]
    notes.append(
        "scale and scale_offset: without parameters, no scale, a scale w = 1 with offset 0 and "
        "w = 0 with offset 1 are the same function"
    )
    bias = _max_abs(zero_output) > 32 * prober.res  # the outputs are of size 1
    if bias:
        notes.append(
            f"bias: present, f(0) = b is non-zero (max |b| = {_max_abs(zero_output):.3g}), so the "
            "layer's bias is not at its initial value 0"
        )
    else:
        undetermined.append("bias")
        notes.append("bias: f(0) = 0, so either no bias or one at its initial value 0")
    return _Affine(scale=True, offset=0.0, bias=bias)


def _check_depends(prober: _Prober, rng: np.random.Generator, zero_output: np.ndarray) -> None:
    """The output must change with the input: ``f(x) != f(0)`` for unit-size rows."""
    y = prober.h(prober.round(rng.normal(size=(4, prober.n)))) - zero_output
    size = _max_abs(y)
    if size <= 32 * prober.res * _max_abs(zero_output) or size == 0:
        raise ValueError(_NOT_A_NORM + "its output does not depend on the input (f(x) = f(0))")


def _elementwise(prober: _Prober, rng: np.random.Generator, zero_output: np.ndarray) -> bool:
    """Whether no element affects the others: a large ``x_j`` (first, middle or last; a
    statistic reads at least one of them) changes no other output of its row."""
    n = prober.n
    base = prober.round(rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n))
    js = np.unique([0, n // 2, n - 1])
    rows = np.repeat(base.astype(np.float64)[None], len(js) + 1, axis=0)
    rows[np.arange(len(js)), js] = -np.sign(rows[np.arange(len(js)), js]) * 16 * math.sqrt(n)
    y = prober.h(prober.round(rows)) - zero_output
    change = np.abs(y[:-1] - y[-1])
    change[np.arange(len(js)), js] = 0.0
    return _max_abs(change) <= _INFLUENCE * _max_abs(y[-1])


def _check_scale_invariance(
    prober: _Prober, rng: np.random.Generator, zero_output: np.ndarray
) -> None:
    """A norm maps ``256 x`` and ``512 x`` to the same output (eps is negligible at that size)."""
    x = prober.round(rng.normal(size=(4, prober.n))).astype(np.float64)
    y = prober.h(prober.round(np.concatenate([256 * x, 512 * x]))) - zero_output
    low, high = y[:4], y[4:]
    size = _max_abs(low)
    change = _max_abs(high - low) / size
    if change > _SCALE_INVARIANCE:
        raise ValueError(
            _NOT_A_NORM
            + f"it is not scale-invariant: f(512 x) differs from f(256 x) by {change:.0%} "
            "of max|f(256 x) - f(0)|, where a normalization (with eps below about 10) gives the "
            "same output"
        )


def _statistic_support(prober: _Prober, rng: np.random.Generator, zero_output: np.ndarray) -> int:
    """``k``: element ``j`` changes the other outputs of its row exactly when ``j < k``."""
    n = prober.n
    base = prober.round(rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n))
    base64 = base.astype(np.float64)
    base_out = prober.h(base[None])[0]
    size = _max_abs(base_out - zero_output)
    big = 16 * math.sqrt(n)

    def influences(js: np.ndarray) -> np.ndarray:
        rows = np.repeat(base64[None], len(js), axis=0)
        positions = np.arange(len(js))
        rows[positions, js] = -np.sign(base64[js]) * big
        change = np.abs(prober.h(prober.round(rows)) - base_out)
        change[positions, js] = 0.0
        return change.max(axis=1) > _INFLUENCE * size

    if n <= _FULL_SCAN_MAX_N:
        js = np.arange(n)
        inside = influences(js)
        k = int(np.argmin(inside)) if not inside.all() else n
    else:
        lo, hi = 0, n  # j = lo affects the others (checked below), j = hi does not (or hi = n)
        while hi - lo > 1:
            candidates = np.unique(
                np.linspace(lo + 1, hi - 1, min(_SEARCH_WIDTH, hi - lo - 1)).astype(int)
            )
            hits = influences(candidates)
            lo = int(candidates[hits].max()) if hits.any() else lo
            later = candidates[~hits & (candidates > lo)]
            hi = int(later.min()) if later.size else hi
        k = lo + 1
        spots = rng.integers(0, n, _SPOT_CHECKS)
        js = np.unique(np.concatenate([[0, k - 1, min(k, n - 1), n - 1], spots]))
        inside = influences(js)
    if not inside.any():
        raise ValueError(
            _NOT_A_NORM + "no element affects the other outputs of its row: it acts elementwise, "
            "with no statistic over the row"
        )
    if not np.array_equal(inside, js < k):
        affecting = js[inside][:8].tolist()
        not_affecting = js[~inside][:8].tolist()
        raise ValueError(
            _NOT_A_NORM
            + "the elements that affect the rest of the row are not a leading block, as "
            f"the statistic of partial RMSNorm reads: j = {affecting} do, "
            f"j = {not_affecting} do not"
        )
    return k


def _kind(
    prober: _Prober, rng: np.random.Generator, k: int, zero_output: np.ndarray, notes: list[str]
) -> Kind:
    """partial_rms if ``k < n``; else LayerNorm if ``f(x + 4) = f(x)``, RMSNorm if far from it."""
    n = prober.n
    if k < n:
        return "partial_rms"
    # x + 4 in [2.5, 7.5] and x = (x + 4) - 4 are both exact in the probe dtype (Sterbenz).
    shifted = prober.round(rng.uniform(2.5, 7.5, size=(4, n)))
    x = prober.round(shifted.astype(np.float64) - 4.0)
    y = prober.h(np.concatenate([x, shifted]))
    change = _max_abs(y[4:] - y[:4]) / _max_abs(y[:4] - zero_output)
    if change <= max(1e-3, 8 * prober.res):
        notes.append(
            f"kind layer: every element affects the rest of the row, and f(x + 4) = f(x) to "
            f"{change:.2g} of max|y| (shift invariance)"
        )
        return "layer"
    if change >= _RMS_SHIFT:
        notes.append(
            f"kind rms: every element affects the rest of the row (k = n = {n}; partial_rms with "
            f"p = 1 is the same), and f(x + 4) differs from f(x) by {change:.0%} of max|y|"
        )
        return "rms"
    raise ValueError(
        _NOT_A_NORM
        + f"it is only partly shift-invariant: f(x + 4) differs from f(x) by {change:.2g} of "
        "max|y| (LayerNorm: rounding only; RMSNorm: tens of percent)"
    )


@dataclass(frozen=True)
class _EpsFit:
    eps: float | None  # None: too small to change any probe
    placement: EpsPlacement | None  # None: both placements fit
    spread: float  # max / min - 1 of the eps estimates: a bound on eps's relative error
    note: str


def _measure_eps(
    prober: _Prober, rng: np.random.Generator, kind: Kind, k: int, zero_output: np.ndarray
) -> _EpsFit:
    """eps and its placement from rows ``t · u`` swept over sizes (step 6 of the module doc)."""
    n = prober.n
    magnitudes = rng.uniform(0.5, 1.5, n)
    if kind == "layer":  # ± pairs: the mean is exactly 0 after rounding too
        u = np.zeros(n)
        pairs = n // 2
        u[0 : 2 * pairs : 2] = magnitudes[:pairs]
        u[1 : 2 * pairs : 2] = -magnitudes[:pairs]
    else:
        u = rng.choice([-1.0, 1.0], n) * magnitudes
    t_min = _smallest_size(prober.dtype)
    count = round(math.log10(_T_MAX / t_min) * _STEPS_PER_DECADE) + 1
    t = np.logspace(math.log10(t_min), math.log10(_T_MAX), count)
    x = prober.round(t[:, None] * u[None, :])
    c = _centered(x.astype(np.float64), kind)
    s = np.mean(c[:, :k] ** 2, axis=1)
    y = prober.h(x) - zero_output
    columns = (c[-1] != 0) & (y[-1] != 0)
    gain_r = y[:, columns] / c[:, columns]  # G · r(s_t), per element
    a = np.median(gain_r / gain_r[-1], axis=1)  # r(s_t) / r(s_T)
    rho = a * np.sqrt(s / s[-1])
    margin = max(0.02, 8 * prober.res)
    use = (rho >= _RHO_MIN) & (rho <= 1 - margin) & (a >= 1.05)
    if np.count_nonzero(use) < _MIN_EPS_PROBES:
        s_min = float(s[0])
        if rho[0] > 1 - margin:
            why = "too small to change any probe"
        else:
            why = f"it shows on only {np.count_nonzero(use)} probe sizes, too few to measure it"
        return _EpsFit(
            None,
            None,
            0.0,
            f"eps: {why} (rows down to mean square {s_min:.1e}, the smallest {prober.dtype.name} "
            f"probes; eps shows above about {0.04 * s_min:.1e} inside the sqrt or "
            f"{0.02 * math.sqrt(s_min):.1e} outside)",
        )
    a_used, s_used, t_used = a[use], s[use], t[use]
    estimates: dict[EpsPlacement, np.ndarray] = {
        "inside": (s[-1] - a_used**2 * s_used) / (a_used**2 - 1),
        "outside": (np.sqrt(s[-1]) - a_used * np.sqrt(s_used)) / (a_used - 1),
    }
    spreads = {place: _spread(values) for place, values in estimates.items()}
    best: EpsPlacement = min(spreads, key=lambda place: spreads[place])
    other: EpsPlacement = "outside" if best == "inside" else "inside"
    tolerance = max(0.05, 32 * prober.res)
    scales = f"{len(t_used)} probes at row sizes {t_used.min():.1e} .. {t_used.max():.1e}"
    if spreads[best] > tolerance:
        raise ValueError(
            _NOT_A_NORM + "no fixed eps explains how its output shrinks for small rows: the eps "
            f"estimates from {scales} spread by {_percent(spreads['inside'])} with eps inside the "
            f"sqrt and {_percent(spreads['outside'])} outside"
        )
    if spreads[other] > max(3 * spreads[best], 2 * tolerance):
        placement: EpsPlacement | None = best
        eps = _significant(float(np.median(estimates[best])), spreads[best])
        found = f"eps {eps:.3g} ({best} the sqrt)"
    else:
        placement = None
        eps = _significant(float(np.median(estimates["inside"])), spreads["inside"])
        found = f"eps {eps:.3g} if inside the sqrt; placement undetermined"
    return _EpsFit(
        eps,
        placement,
        spreads[best],
        f"{found} from {scales}, spread {_percent(spreads[best])}; eps {other} the sqrt would "
        f"spread {_percent(spreads[other])}",
    )


def _verify(
    prober: _Prober,
    rng: np.random.Generator,
    spec: NormSpec,
    fit: _EpsFit,
    zero_output: np.ndarray,
    *,
    fit_gain: bool,
    notes: list[str],
) -> np.ndarray:
    """Check that ``spec`` reproduces the output on fresh rows; return the per-element scale ``G``.

    ``G`` is 1 when the probes set the parameters, else fitted by least squares per element (and
    taken as exactly 1 when the fit is 1 within the check's tolerance: initial parameters).
    """
    n = prober.n
    sizes = [1.0, 64.0]
    if spec.alpha_init is not None:  # DyT: around the knee of the tanh
        sizes += [0.5 / spec.alpha_init, 2 / spec.alpha_init]
    elif fit.eps is not None:
        assert spec.eps is not None  # the fit found one
        transition = math.sqrt(spec.eps) if spec.eps_placement == "inside" else spec.eps
        sizes += [max(0.5 * transition, _smallest_size(prober.dtype)), 2 * transition]
    rows_per_size = 4
    size = np.repeat(sizes, rows_per_size)[:, None]
    # eps's own uncertainty moves the rows near the transition by at most about that much
    tolerance = max(0.01, 8 * prober.res) + np.where(size[:, 0] < 1.0, 2 * fit.spread, 0.0)
    rows = size * (rng.normal(size=(len(size), n)) + rng.normal(size=(len(size), 1)))
    x = prober.round(rows)
    y = prober.h(x) - zero_output
    y_hat = reference.normalize(x.astype(np.float64), spec)
    if fit_gain:
        weight = np.sum(y_hat**2, axis=0)
        gain = np.where(
            weight > 0, np.sum(y * y_hat, axis=0) / np.where(weight > 0, weight, 1.0), 1.0
        )
    else:
        gain = np.ones(n)
    expected = y_hat * gain
    error = np.max(np.abs(y - expected), axis=1) / np.max(np.abs(expected), axis=1)
    worst = int(np.argmax(error / tolerance))
    described = _describe_structure(spec, fit.eps is not None)
    if error[worst] > tolerance[worst]:
        raise ValueError(
            _NOT_A_NORM
            + f"the closest spec it matches on the probes ({described}) differs from its "
            f"output by {error[worst]:.1%} of max|y| on a row of size {float(size[worst, 0]):.2g} "
            f"with mean {float(np.mean(x[worst].astype(np.float64))):.2g}"
        )
    notes.append(
        f"checked: {described} reproduces the output to {error[worst]:.2g} of max|y| on "
        f"{len(rows)} fresh rows with non-zero means at sizes "
        f"{', '.join(f'{v:.2g}' for v in sizes)}"
    )
    if fit_gain:
        deviation = _max_abs(gain - 1.0)
        if deviation <= tolerance.min():
            notes.append(
                f"effective scale 1 on every element (to {deviation:.2g}): initial parameters"
            )
            gain = np.ones(n)
        else:
            notes.append(
                f"effective scale ranges {gain.min():.4g} .. {gain.max():.4g}: the layer's own "
                "parameters are not at their initial values"
            )
    return gain


@dataclass(frozen=True)
class _HalfFinding:
    """What one half dtype's probe shows; None where it does not."""

    cast: Cast | None
    offset_dtype: OffsetDtype | None
    output_dtype: OutputDtype | None


_Candidate: TypeAlias = tuple[Cast, OffsetDtype]


def _probe_half(
    prober: _Prober,
    rng: np.random.Generator,
    dtype: np.dtype,
    spec: NormSpec,
    affine: _Affine | None,
    gain: np.ndarray,
    zero_output: np.ndarray,
    notes: list[str],
) -> _HalfFinding:
    """Output dtype, error, cast order and offset dtype for ``dtype`` inputs.

    ``affine`` is what `_probe_params` measured, or None when the parameters cannot be set (then
    the prediction uses the fitted ``gain`` and ``f(0)``). With an offset, ``w`` is small
    (``|w| < 1/8``, exact in both half dtypes), so that ``offset + w`` rounds in ``dtype`` on
    most elements: that rounding (``offset_dtype="param"``, the parameters held in ``dtype``)
    and the cast order predict different outputs, and the output is matched against each.
    """
    n = prober.n
    rows = max(4, -(-HALF_PROBE_ELEMENTS // n))
    x = prober.round(rng.choice([-1.0, 1.0], (rows, n)) * rng.uniform(0.5, 1.5, (rows, n)), dtype)
    offsets: tuple[OffsetDtype, ...] = ("float32",)
    if affine is not None and (affine.scale or affine.bias):
        offset = affine.offset if affine.scale else 0.0
        w = representable(rng, n, 1.0 if offset == 0 else 0.0625) if affine.scale else None
        b = representable(rng, n, 0.25) if affine.bias else None
        out = prober.call(x, w, b)
        g = offset + w.astype(np.float64) if w is not None else np.ones(n)
        shift = b.astype(np.float64) if b is not None else np.zeros(n)
        why_same = "on these inputs and parameters"
        if offset != 0:
            offsets = ("float32", "param")
    else:
        out = prober.call(x, prober.scale, prober.bias)
        g, shift = gain, zero_output
        why_same = (
            "the implementation has neither scale nor bias"
            if affine is not None
            else "without parameters w = 1 and b = 0, and both orders round ŷ once"
        )
    y_hat = reference.normalize(x.astype(np.float64), spec)
    candidates: dict[_Candidate, np.ndarray] = {}
    ties = near_tie(y_hat, dtype)
    for held in offsets:
        scale = g if held == "float32" else round_to(g, dtype).astype(np.float64)
        for order, value in _half_predictions(y_hat, scale, shift, dtype).items():
            candidates[(order, held)] = value
    if is_half(out.dtype):
        for value in candidates.values():
            ties |= near_tie(value, out.dtype)
        candidates = {c: round_to(v, out.dtype).astype(np.float64) for c, v in candidates.items()}
    y = out.astype(np.float64)
    output_dtype, head = _output_dtype(dtype, out.dtype, accepts=affine is not None)
    best = min(candidates, key=lambda c: _mismatches(y, candidates[c], out.dtype, ties))
    cast, cast_finding = _verdict(
        y, candidates, best, (_flip(best[0]), best[1]), out.dtype, ties, why_same
    )
    findings = [cast_finding]
    offset_dtype: OffsetDtype | None = None
    if len(offsets) > 1:
        other: _Candidate = (best[0], "param" if best[1] == "float32" else "float32")
        offset_dtype, offset_finding = _verdict(
            y, candidates, best, other, out.dtype, ties, "the offset sums are exact"
        )
        findings.append(offset_finding)
    error = tolerances.measure(y, candidates[best], out.dtype)
    notes.append(
        f"{head}; {'; '.join(findings)}; error {error.error:.2g} {error.bound.unit} from the "
        f"reference with {best[0]}"
    )
    return _HalfFinding(cast, offset_dtype, output_dtype)


def _output_dtype(
    dtype: np.dtype, out: np.dtype, *, accepts: bool
) -> tuple[OutputDtype | None, str]:
    """``output_dtype`` from the output's dtype for ``dtype`` inputs and float32 parameters."""
    head = f"{dtype.name} input: output dtype {out.name}"
    if out == np.dtype(np.float32):
        return "promote", head + " (promotes: output_dtype promote)"
    if out == dtype and accepts:
        return "input", head + " (the input dtype with float32 parameters: output_dtype input)"
    if out == dtype:
        return None, head + (
            " (the input dtype; output_dtype undetermined: the layer's own parameters' dtype "
            "is unknown)"
        )
    return None, head + " (neither the input dtype nor the promoted one)"


def _flip(cast: Cast) -> Cast:
    return "before_scale" if cast == "after_scale" else "after_scale"


def _half_predictions(
    y_hat: np.ndarray, g: np.ndarray, shift: np.ndarray, dtype: np.dtype
) -> dict[Cast, np.ndarray]:
    """Each cast order's output for ``dtype`` inputs, before the final rounding."""
    return {
        "after_scale": y_hat * g + shift,
        "before_scale": round_to(y_hat, dtype).astype(np.float64) * g + shift,
    }


def _differ(a: np.ndarray, b: np.ndarray, out_dtype: np.dtype, ties: np.ndarray) -> np.ndarray:
    """Where two predictions differ as evidence: not near a tie, and (for a float32 output) by
    more than 4 of its ulps."""
    if is_half(out_dtype):
        return (a != b) & ~ties
    spacing = np.spacing(np.abs(a).astype(out_dtype)).astype(np.float64)
    return (np.abs(a - b) > 4 * spacing) & ~ties


def _mismatches(y: np.ndarray, predicted: np.ndarray, out_dtype: np.dtype, ties: np.ndarray) -> int:
    return int(np.count_nonzero(_differ(y, predicted, out_dtype, ties)))


def _verdict(
    y: np.ndarray,
    candidates: dict[_Candidate, np.ndarray],
    best: _Candidate,
    other: _Candidate,
    out_dtype: np.dtype,
    ties: np.ndarray,
    why_same: str,
) -> tuple[Any, str]:
    """The field where ``best`` and ``other`` differ, if ``y`` is closer to ``best`` on at least
    90% of the elements where their predictions differ; else None. With the finding."""
    field = "cast" if best[0] != other[0] else "offset_dtype"
    mine, theirs = (best[0], other[0]) if field == "cast" else (best[1], other[1])
    differ = _differ(candidates[best], candidates[other], out_dtype, ties)
    if np.count_nonzero(differ) < MIN_CAST_ELEMENTS:
        return None, f"{field} undetermined: both give the same output ({why_same})"
    closer = np.mean(
        (np.abs(y - candidates[best]) < np.abs(y - candidates[other]))[differ]
    )
    share = (
        f"closer to {mine} than to {theirs} on {closer:.0%} of the "
        f"{np.count_nonzero(differ)} elements where they differ"
    )
    if closer >= _CAST_AGREEMENT:
        return mine, f"{field} {mine}: {share}"
    return None, f"{field} undetermined: {share}"


def _smallest_size(dtype: np.dtype) -> float:
    """The smallest row size probed: 1e-12, or 64 subnormal steps of ``dtype``.

    Subnormal inputs are fine, since every statistic is computed from the rounded rows.
    """
    return max(_T_MIN, 64 * float(ml_dtypes.finfo(dtype).smallest_subnormal))


def near_tie(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Where ``values`` lie within ``2^-18 |v|`` of a rounding midpoint of ``dtype``."""
    step = ulp(values, dtype)
    offset = values / step - np.floor(values / step)
    return np.abs(offset - 0.5) * step <= _TIE_DISTANCE * np.abs(values)


def _centered(rows: np.ndarray, kind: Kind) -> np.ndarray:
    return rows - rows.mean(axis=1, keepdims=True) if kind == "layer" else rows


def representable(rng: np.random.Generator, n: int, magnitude: float) -> np.ndarray:
    """Signed ``(1 + m/128) · 2^e · magnitude``, ``e`` in {-1, 0}: exact in bfloat16 and float16."""
    mantissa = 1 + rng.integers(0, 128, n) / 128
    values = rng.choice([-1.0, 1.0], n) * mantissa * rng.choice([0.5, 1.0], n) * magnitude
    return values.astype(np.float32)


def _fraction(k: int, n: int) -> float:
    """The smallest ``p`` with ``max(1, floor(n · p)) = k`` in float64: ``k / n``, nudged up."""
    p = k / n
    while math.floor(n * p) < k:
        p = math.nextafter(p, 2.0)
    return p


def _fraction_note(k: int, n: int, p: float) -> str:
    low = "(0" if k == 1 else f"[{k / n:.6g}"
    high = "2/n" if k == 1 else f"{(k + 1) / n:.6g}"
    return (
        f"partial statistic: only the first k = {k} of n = {n} elements affect the rest of the "
        f"row: p = {p:.6g}; every p in {low}, {high}) gives the same k at this n"
    )


def _describe_structure(spec: NormSpec, eps_known: bool) -> str:
    if spec.alpha_init is not None:
        return f"dyt with alpha={spec.alpha_init:.6g}"
    eps = f"eps={spec.eps:.3g} {spec.eps_placement}" if eps_known else "eps negligible"
    partial = f", p={spec.p:.6g}" if spec.p is not None else ""
    return f"{spec.kind} with {eps}{partial}"


def _significant(value: float, spread: float) -> float:
    """``value`` to the significant digits (2 to 6) a relative ``spread`` supports, plus one."""
    digits = min(6, max(2, math.ceil(-math.log10(max(spread, 1e-12))) + 1))
    return float(f"{value:.{digits}g}")


def _spread(values: np.ndarray) -> float:
    """``max / min - 1`` of positive values; infinite if any is not positive."""
    if values.size == 0 or not np.all(values > 0):
        return math.inf
    return float(values.max() / values.min() - 1)


def _percent(value: float) -> str:
    if math.isinf(value):
        return "without bound (a non-positive estimate)"
    return f"{value:.2%}" if value >= 1e-3 else f"{value:.1e}"


def _max_abs(values: np.ndarray) -> float:
    return float(np.max(np.abs(values), initial=0.0))
