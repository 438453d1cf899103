"""The gated and grouped specs every adapter's gated test runs, their test ids, and the check
of one output or gradient against the reference."""

import itertools

import numpy as np

from normkit import NormSpec, dtypes, reference, tolerances


def specs() -> list[NormSpec]:
    """Every gate position and activation with and without groups of 4, and groups alone, for
    each normalization kind (not partial RMS with groups) and cast order; LayerNorm with a
    bias."""
    found = []
    for kind, gate, activation, group, cast in itertools.product(
        ["rms", "layer", "partial_rms"], [None, "before", "after"], ["silu", "sigmoid"],
        [None, 4], ["after_scale", "before_scale"],
    ):
        if (gate is None and activation == "sigmoid") or (kind == "partial_rms" and group):
            continue
        if gate is None and group is None:
            continue  # the plain norms have their own tests
        found.append(NormSpec(
            kind, p=0.5 if kind == "partial_rms" else None, gate=gate,
            gate_activation=activation if gate else None, group_size=group, cast=cast,
            bias=kind == "layer",
        ))
    return found


def spec_id(spec: NormSpec) -> str:
    return f"{spec.kind}-{spec.gate}-{spec.gate_activation}-g{spec.group_size}-{spec.cast}"


def check(name, got, got_dtype, want, spec, x_dtype, magnitude=None):
    """``got`` (float64 values of an array of ``got_dtype``, a dtype name) within the tolerance
    of its dtype; ``y`` has the reference's dtype and, with ``cast="before_scale"`` and a half
    x, is read in ulps of x's dtype, where ``y_hat`` is rounded (`normkit.conformance.compare`).
    """
    dtype = dtypes.DTYPE_NAMES[got_dtype]
    if name == "y":
        assert dtype == np.dtype(want.dtype), (got_dtype, want.dtype)
        if spec.cast == "before_scale" and dtypes.is_half(np.dtype(x_dtype)):
            dtype = np.dtype(x_dtype)
    tolerances.assert_close(
        got, want, dtype, "forward" if name == "y" else "grad", spec.cast,
        what=f"{name} of {spec!r}", magnitude=magnitude,
    )


def expected(spec, x, z, dy, w, b):
    """The reference's ``y`` and gradients (``dx``, ``dgate`` with a gate, ``dweight``, ``dbias``
    where the spec has them) of ``spec`` on ``x`` with the gate ``z`` (unread without one)."""
    if spec.gate:
        y = reference.gated_normalize(x, z, spec, w, b)
        dx, dgate, dw, db = reference.gated_normalize_vjp(x, z, dy, spec, w, b)
    else:
        y = reference.normalize(x, spec, w, b)
        dx, dw, db = reference.normalize_vjp(x, dy, spec, w, b)[:3]
        dgate = None
    found = {"y": y, "dx": dx, "dgate": dgate, "dweight": dw, "dbias": db}
    return {k: v for k, v in found.items() if v is not None}
