"""An implementation's outputs against the reference's, under `normkit.tolerances`.

The quantities a spec has (`quantities`): the output and the gradients of every spec, then ``h``
and ``dresidual`` with a residual, then ``dalpha`` for DyT. A hook returns them in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from normkit import dtypes, reference, tolerances
from normkit.spec import NormSpec

BASE_QUANTITIES = ("y", "dx", "dscale", "dbias")
GATE_QUANTITIES = ("dgate",)
RESIDUAL_QUANTITIES = ("h", "dresidual")
DYT_QUANTITIES = ("dalpha",)
QUANTITIES = (*BASE_QUANTITIES, *GATE_QUANTITIES, *RESIDUAL_QUANTITIES, *DYT_QUANTITIES)
"""Every quantity name, in the order `quantities` gives them."""

FORWARD_QUANTITIES = ("y", "h")

__all__ = [
    "QUANTITIES", "Inputs", "compare", "expected", "expected_dtypes", "param_dtype", "quantities",
    "tolerance",
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
) -> tuple[list[str], dict[str, tolerances.Measurement]]:
    """Compare an implementation's outputs, named by ``quantities(spec)``, with the reference's.

    Only the quantities in ``checked`` (all when None) are compared. Returns the problems found
    (empty when it conforms: the right number of outputs, every quantity within
    `normkit.tolerances` and in its `expected_dtypes`) and the measurements.
    """
    names = quantities(spec)
    if len(outputs) != len(names):
        return [
            f"returned {len(outputs)} arrays, expected {len(names)}: {', '.join(names)}"
        ], {}
    wanted = expected(spec, inputs)
    want_dtypes = expected_dtypes(spec, inputs)
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
        m = tolerances.measure(got.astype(np.float64), want, dtype, quantity, cast, magnitude)
        measurements[name] = m
        if not m.passed:
            problems.append(f"{name}: {m.describe()}")
    return problems, measurements
