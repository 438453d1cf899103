"""An implementation's outputs against the reference's, under `normkit.tolerances`.

The quantities a spec has (`quantities`): the output and the gradients of every spec, then ``h``
and ``dresidual`` with a residual, then ``dalpha`` for DyT. A hook returns them in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from normkit import dtypes, reference, tolerances
from normkit.conformance import rows as row_kinds
from normkit.spec import NormSpec

BASE_QUANTITIES = ("y", "dx", "dscale", "dbias")
GATE_QUANTITIES = ("dgate",)
RESIDUAL_QUANTITIES = ("h", "dresidual")
DYT_QUANTITIES = ("dalpha",)
QUANTITIES = (*BASE_QUANTITIES, *GATE_QUANTITIES, *RESIDUAL_QUANTITIES, *DYT_QUANTITIES)
"""Every quantity name, in the order `quantities` gives them."""

FORWARD_QUANTITIES = ("y", "h")

MIN_VOTES = 16
"""The fewest elements where two roundings predict different outputs that make a verdict."""

__all__ = [
    "MIN_VOTES", "QUANTITIES", "Inputs", "bound_factor", "compare", "expected", "expected_dtypes",
    "forward", "param_dtype", "quantities", "rounding_problems", "tolerance", "widened",
]


def quantities(spec: NormSpec) -> tuple[str, ...]:
    """The names of what a hook returns for ``spec``, in order: ``("y", "dx", "dscale",
    "dbias")``, then ``("dgate",)`` when ``spec.gate`` is set, ``("h", "dresidual")`` when
    ``spec.residual`` is, then ``("dalpha",)`` for ``kind="dyt"``."""
    found: tuple[str, ...] = BASE_QUANTITIES
    if spec.gate is not None:
        found += GATE_QUANTITIES
    if spec.residual is not None:
        found += RESIDUAL_QUANTITIES
    if spec.kind == "dyt":
        found += DYT_QUANTITIES
    return found


class Inputs(NamedTuple):
    """The arrays of one case: ``x`` and the cotangent ``dy``, the parameters (None: absent or
    at their initial value), and with a residual ``residual`` and the cotangent ``dh`` of ``h``,
    for DyT ``alpha`` (None: ``spec.alpha_init``), for a gated spec the ``gate``."""

    x: np.ndarray
    dy: np.ndarray
    scale: np.ndarray | None = None
    bias: np.ndarray | None = None
    residual: np.ndarray | None = None
    dh: np.ndarray | None = None
    alpha: np.ndarray | None = None
    gate: np.ndarray | None = None


def param_dtype(inputs: Inputs) -> np.dtype:
    """The dtype of an absent parameter: that of the first parameter given, else float32."""
    given = next((p for p in (inputs.scale, inputs.bias, inputs.alpha) if p is not None), None)
    return dtypes.float32 if given is None else np.asarray(given).dtype


def expected_dtypes(spec: NormSpec, inputs: Inputs) -> dict[str, np.dtype]:
    """The dtype of each of ``quantities(spec)``: ``y`` in `reference.output_dtype`, ``dx`` in
    x's, each parameter's gradient in its parameter's (an absent one: the parameters' dtype,
    float32 without any), ``h`` in x's (float32 for ``residual="float32"`` with a half x; float64
    for a float64 x), ``dresidual`` in the residual's."""
    x = inputs.x
    param = param_dtype(inputs)

    def own(a: np.ndarray | None) -> np.dtype:
        return param if a is None else np.asarray(a).dtype

    found = {
        "y": reference.output_dtype(x.dtype, spec, inputs.scale, inputs.bias, inputs.alpha),
        "dx": x.dtype,
        "dscale": own(inputs.scale),
        "dbias": own(inputs.bias),
    }
    if spec.gate is not None and inputs.gate is not None:
        found["dgate"] = np.asarray(inputs.gate).dtype
    if spec.residual is not None:
        kept = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
        found["h"] = kept if spec.residual == "float32" else x.dtype
        found["dresidual"] = own(inputs.residual) if inputs.residual is not None else x.dtype
    if spec.kind == "dyt":
        found["dalpha"] = own(inputs.alpha)
    return found


def forward(spec: NormSpec, inputs: Inputs) -> np.ndarray:
    """The reference's ``y`` alone (`normkit.reference.normalize`, ``add_normalize`` or
    ``gated_normalize``)."""
    x, _, scale, bias, residual, _, alpha, gate = inputs
    if spec.gate is not None:
        assert gate is not None, f"the spec has gate={spec.gate!r}: the inputs need one"
        return reference.gated_normalize(x, gate, spec, scale, bias)
    if spec.residual is not None:
        assert residual is not None, f"the spec has residual={spec.residual!r}: the inputs need one"
        return reference.add_normalize(x, residual, spec, scale, bias, alpha)[0]
    return reference.normalize(x, spec, scale, bias, alpha)


def expected(spec: NormSpec, inputs: Inputs) -> dict[str, np.ndarray | None]:
    """The reference's value of each of ``quantities(spec)`` (None for an absent parameter):
    `reference.normalize` and `reference.normalize_vjp`, or `reference.add_normalize` and
    `reference.add_normalize_vjp` for a spec with a residual; ``dalpha`` of shape ``(1,)``."""
    x, dy, scale, bias, residual, dh, alpha, gate = inputs
    found: dict[str, np.ndarray | None]
    if spec.gate is not None:
        if gate is None:
            raise ValueError(f"the spec has gate={spec.gate!r}: the inputs need one")
        y = reference.gated_normalize(x, gate, spec, scale, bias)
        found = {"y": y, **reference.gated_normalize_vjp(x, gate, dy, spec, scale, bias)._asdict()}
    elif spec.residual is not None:
        if residual is None:
            raise ValueError(f"the spec has residual={spec.residual!r}: the inputs need one")
        y, h = reference.add_normalize(x, residual, spec, scale, bias, alpha)
        add_grads = reference.add_normalize_vjp(x, residual, dy, dh, spec, scale, bias, alpha)
        found = {"y": y, "h": h, **add_grads._asdict()}
    else:
        y = reference.normalize(x, spec, scale, bias, alpha)
        found = {"y": y, **reference.normalize_vjp(x, dy, spec, scale, bias, alpha)._asdict()}
    if spec.kind == "dyt":
        found["dalpha"] = np.asarray(found["dalpha"]).reshape(1)
    return found


def bound_factor(rows: str, spec: NormSpec, inputs: Inputs) -> float:
    """How much the relative bounds grow for a case's ``rows``: on large-mean rows by
    `normkit.conformance.rows.bound_factor` of the values the norm reads; 1 otherwise."""
    if rows != "large_mean":
        return 1.0
    return row_kinds.bound_factor(_normalized(spec, inputs), spec, inputs.x.dtype.name)


def widened(m: tolerances.Measurement, factor: float) -> tolerances.Measurement:
    """``m`` with a relative bound ``factor`` times as large (ulp bounds as they are)."""
    if factor == 1.0 or m.bound.unit == "ulp":
        return m
    return dataclasses.replace(m, bound=tolerances.Bound(m.bound.value * factor, m.bound.unit))


_ROUNDINGS = {"cast": "cast order", "offset_dtype": "offset dtype", "residual": "residual sum"}


def _rounding_variants(spec: NormSpec, inputs: Inputs) -> dict[str, NormSpec]:
    """The specs that differ from ``spec`` in one rounding alone, where the inputs can show it:
    the other cast order (half x), the other offset dtype (an offset and a half scale), the other
    half rounding of a residual sum that keeps ``h``'s dtype (half x)."""
    half_x = dtypes.is_half(inputs.x.dtype)
    changes: dict[str, object] = {}
    if half_x:
        changes["cast"] = "after_scale" if spec.cast == "before_scale" else "before_scale"
    scale = inputs.scale
    if spec.scale_offset and scale is not None and dtypes.is_half(np.asarray(scale).dtype):
        changes["offset_dtype"] = "float32" if spec.offset_dtype == "param" else "param"
    if half_x and spec.residual in ("rounded", "float32_normalized"):
        changes["residual"] = (
            "float32_normalized" if spec.residual == "rounded" else "rounded"
        )
    found = {}
    for name, value in changes.items():
        try:
            found[name] = spec.replace(**{name: value})
        except ValueError:
            continue
    return found


def rounding_problems(spec: NormSpec, inputs: Inputs, y: np.ndarray) -> list[str]:
    """Which of the spec's roundings ``y`` does not follow, found by counting: for each spec
    that differs in one rounding alone (`_rounding_variants`), the elements where the two
    predict different outputs (at least `MIN_VOTES`) each count for the prediction ``y`` is
    closer to; a rounding the other spec gets more of is a problem, named with both shares.
    Those roundings move an output by about an ulp, within its bound: only the count tells them
    apart."""
    want = forward(spec, inputs)
    if np.asarray(y).dtype != want.dtype or y.shape != want.shape:
        return []
    got, mine = np.asarray(y).astype(np.float64), want.astype(np.float64)
    problems = []
    for name, other_spec in _rounding_variants(spec, inputs).items():
        with np.errstate(all="ignore"):  # rows beyond float32's range: the predictions' own
            theirs = forward(other_spec, inputs).astype(np.float64)
        differ = _differ(mine, theirs, want.dtype)
        count = int(np.count_nonzero(differ))
        if count < MIN_VOTES:
            continue
        for_mine = int(np.count_nonzero((np.abs(got - mine) < np.abs(got - theirs))[differ]))
        for_theirs = int(np.count_nonzero((np.abs(got - theirs) < np.abs(got - mine))[differ]))
        if for_theirs > for_mine:
            ours, other = getattr(spec, name), getattr(other_spec, name)
            problems.append(
                f"{_ROUNDINGS[name]}: the spec says {name}={ours!r}, but y is closer to "
                f"{name}={other!r} on {for_theirs / count:.0%} and to {ours!r} on "
                f"{for_mine / count:.0%} of the {count} elements where the two round differently"
            )
    return problems


def _differ(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Where two finite predictions in ``dtype`` differ as evidence: for a half dtype wherever
    they differ, for a wider one by more than 4 of its ulps (its own arithmetic's reach)."""
    finite = np.isfinite(a) & np.isfinite(b)
    if dtypes.is_half(dtype):
        return finite & (a != b)
    with np.errstate(invalid="ignore"):
        far = np.abs(a - b) > 4 * dtypes.ulp(np.where(finite, np.maximum(np.abs(a), np.abs(b)),
                                                      1.0), dtype)
    return finite & far


def _normalized(spec: NormSpec, inputs: Inputs) -> np.ndarray:
    """The values the norm reads, in float64: x, or x + residual (their rounding is immaterial
    where only their size is needed)."""
    x = inputs.x.astype(np.float64)
    if spec.residual is None or inputs.residual is None:
        return x
    return x + inputs.residual.astype(np.float64)


def tolerance(
    name: str, spec: NormSpec, inputs: Inputs, want_dtype: np.dtype
) -> tuple[np.dtype, np.ndarray | None]:
    """The dtype whose tolerance applies to quantity ``name`` and the size of the terms it is
    computed from (`tolerances.measure`'s ``magnitude``), by the rules of `normkit.tolerances`:

    - ``y`` with ``cast="before_scale"`` and a half x: ulps of x's dtype (where ``y_hat`` is
      rounded, even when the output is promoted) at ``|y_hat * (scale_offset + w)|``;
    - ``dx`` and ``dresidual`` with a residual: at ``|dh|`` as well (``dh + dnorm`` cancels);
    - ``dscale`` with ``backward="autograd"``, a half x and ``cast="before_scale"``: ulps of x's
      dtype at ``2 max_rows |dy y_hat|`` (autograd sums products of the rounded ``y_hat``).
    """
    x = inputs.x
    half_cast = dtypes.is_half(x.dtype) and spec.cast == "before_scale"
    if name == "y" and half_cast:
        values = _normalized(spec, inputs)
        return x.dtype, reference.scaled_magnitude(
            values, spec, inputs.scale, inputs.alpha, gate=inputs.gate
        )
    if name in ("dx", "dresidual") and spec.residual is not None and inputs.dh is not None:
        return want_dtype, np.abs(inputs.dh.astype(np.float64))
    if name == "dscale" and half_cast and spec.backward == "autograd":
        bare = spec.replace(
            scale=False, scale_offset=0.0, bias=False, residual=None, offset_dtype="float32",
            output_dtype="input",
        )
        y_hat = reference.normalize(_normalized(spec, inputs), bare, alpha=inputs.alpha)
        axes = spec.resolve_axes(x.ndim)
        rows = tuple(i for i in range(x.ndim) if i not in axes)
        products = np.abs(inputs.dy.astype(np.float64) * y_hat)
        return x.dtype, 2.0 * np.max(products, axis=rows, initial=0.0)
    return want_dtype, None


def compare(
    spec: NormSpec,
    inputs: Inputs,
    outputs: Sequence[np.ndarray | None],
    checked: Sequence[str] | None = None,
    rows: str = "standard",
) -> tuple[list[str], dict[str, tolerances.Measurement]]:
    """Compare an implementation's outputs, named by ``quantities(spec)``, with the reference's.

    Only the quantities in ``checked`` (all when None) are compared. Returns the problems found
    (empty when it conforms: the right number of outputs, every quantity within
    `normkit.tolerances` (the relative bounds widened on large-mean ``rows``, `bound_factor`)
    and in its `expected_dtypes`, and ``y``, where it is within its bound, following the
    spec's roundings, `rounding_problems`) and the measurements.
    """
    names = quantities(spec)
    if len(outputs) != len(names):
        return [
            f"returned {len(outputs)} arrays, expected {len(names)}: {', '.join(names)}"
        ], {}
    wanted = expected(spec, inputs)
    want_dtypes = expected_dtypes(spec, inputs)
    factor = bound_factor(rows, spec, inputs)
    problems = []
    measurements = {}
    for name, got in zip(names, outputs, strict=True):
        if checked is not None and name not in checked:
            continue
        want = wanted[name]
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{name} is {'missing' if got is None else 'unexpected'}")
            continue
        got = np.asarray(got)
        want_dtype = want_dtypes[name]
        if got.dtype != want_dtype:
            problems.append(f"{name} has dtype {got.dtype.name}, expected {want_dtype.name}")
        if got.shape != want.shape:
            problems.append(f"{name} has shape {got.shape}, expected {want.shape}")
            continue
        quantity: Literal["forward", "grad"] = "forward" if name in FORWARD_QUANTITIES else "grad"
        dtype, magnitude = tolerance(name, spec, inputs, want_dtype)
        cast = spec.cast if name == "y" else "after_scale"
        with np.errstate(over="ignore"):  # an output far off: its ulps overflow to infinity
            m = tolerances.measure(got.astype(np.float64), want, dtype, quantity, cast, magnitude)
        m = widened(m, factor)
        measurements[name] = m
        if not m.passed:
            problems.append(f"{name}: {m.describe()}")
        elif name == "y" and got.dtype == want_dtype:
            problems += rounding_problems(spec, inputs, got)
    return problems, measurements
