"""An implementation's outputs against the reference's, under `normkit.tolerances`."""

from __future__ import annotations

from typing import Literal

import numpy as np

from normkit import dtypes, reference, tolerances
from normkit.spec import NormSpec

QUANTITIES = ("y", "dx", "dscale", "dbias")

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def compare(
    spec: NormSpec, inputs: Arrays, outputs: Arrays, quantities: tuple[str, ...] = QUANTITIES
) -> tuple[list[str], dict[str, tolerances.Measurement]]:
    """Compare an implementation's ``(y, dx, dscale, dbias)`` with the reference's.

    ``inputs`` is ``(x, dy, scale, bias)``; only ``quantities`` are checked. Returns the problems
    found (empty when it conforms: every quantity within `normkit.tolerances`, in the expected
    dtype: ``y`` and ``dx`` in x's, each parameter gradient in its parameter's) and the
    measurements.
    """
    x, dy, scale, bias = inputs
    expected = (
        reference.normalize(x, spec, scale, bias),
        *reference.normalize_vjp(x, dy, spec, scale, bias),
    )
    expected_dtypes = (
        x.dtype,
        x.dtype,
        *(np.asarray(p).dtype if p is not None else np.dtype(np.float32) for p in (scale, bias)),
    )
    problems = []
    measurements = {}
    for name, got, want, want_dtype in zip(
        QUANTITIES, outputs, expected, expected_dtypes, strict=True
    ):
        if name not in quantities:
            continue
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{name} is {'missing' if got is None else 'unexpected'}")
            continue
        got = np.asarray(got)
        if got.dtype != want_dtype:
            problems.append(f"{name} has dtype {got.dtype.name}, expected {want_dtype.name}")
        if got.shape != want.shape:
            problems.append(f"{name} has shape {got.shape}, expected {want.shape}")
            continue
        quantity: Literal["forward", "grad"] = "forward" if name == "y" else "grad"
        magnitude = None
        if name == "y" and spec.cast == "before_scale" and dtypes.is_half(x.dtype):
            magnitude = reference.scaled_magnitude(x, spec, scale)
        m = tolerances.measure(
            got.astype(np.float64), want, want_dtype, quantity, spec.cast, magnitude
        )
        measurements[name] = m
        if not m.passed:
            problems.append(f"{name}: {m.describe()}")
    return problems, measurements
