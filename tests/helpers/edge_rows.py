"""Rows at the edges of a dtype's range that every adapter must keep to themselves, as
`normkit.reference` does, and the check of each row against it: the cases of issue 48's defects
2, 3 and 5, shared by the adapters' tests (`evaluate` is a conformance hook's:
`normkit.conformance.targets_keras`, `targets_jax`, `targets_torch`).

- ``neighbours``: a row that sends the batch to the guarded program (its squares overflow)
  beside a row whose ``sum(dy x)`` overflows (|x| 1e9, |dy| 1e29 in float32), a NaN row and a
  unit row: each row's gradient must be its own.
- ``nan_tail``: partial RMS with a NaN after the first k elements: it reaches ``y`` and ``dx``
  there only, and the head's ``dx`` (through the statistic's sum), not the rest of the tail.
- ``far_gate``: the gate's SiLU below z = -88.7, where ``1 / (1 + e^-z)`` is 0 but
  ``z sigmoid(z)`` is a normal number (about 1e-37 in float32).
- ``overflowing_squares``: ``variance="fast"`` on float32 rows whose squares, or only their
  sum, overflow float32: its steps overflow where the reference's float32 roundings do, and
  nowhere else.
- ``fast_large_mean``: ``variance="fast"`` on float32 rows of mean 1000 and spread 1, where
  ``m2 - m1^2`` keeps about 4 bits and each of its roundings shows.
- ``far_dyt``: DyT where ``|alpha x|`` is large: ``1 - tanh(u)^2`` is 0 in float32 from
  ``|u| = 9`` on, where the slope ``sech(u)^2`` is not.
- ``large_means``: LayerNorm rows of mean 10 times their spread at every scale, each row (each
  group) measured on its own: the mean's rounding, relative to ``|mean|``, costs ten times as
  much relative to the row's own ``y`` unless the correction pass recovers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from normkit import NormSpec, reference, tolerances

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}

NEIGHBOUR_SPECS = [
    NormSpec(scale=False),
    NormSpec(bias=True),
    NormSpec(eps_placement="outside"),
    NormSpec("partial_rms", p=0.5),
    NormSpec("layer"),
]
NAN_TAIL_SPECS = [
    NormSpec("partial_rms", p=0.25, scale=False),
    NormSpec("partial_rms", p=0.25, bias=True),
    NormSpec("partial_rms", p=0.25, eps_placement="outside"),
]
# z with silu(z) a normal number whose sigmoid(z) is not (float32, bfloat16) or whose e^-z
# overflows (float64); exact in bfloat16.
FAR_Z = {"float32": -89.0, "bfloat16": -89.0, "float64": -712.0}


def spec_id(spec: NormSpec) -> str:
    """A test id for a spec of these cases."""
    return "-".join(
        [spec.kind, spec.eps_placement]
        + ["bias"] * bool(spec.bias) + ["no-scale"] * (not spec.scale)
    )


def neighbours(dtype: str, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(x, dy)`` of four rows: one that the adapters rescale (its statistic overflows float32;
    in float64 its ``r`` is below 2**-256), one whose ``sum(dy x)`` overflows float32 (large in
    float64), one with a NaN, one of unit scale."""
    rng = np.random.default_rng(48)
    # float64: r below 2**-256 guards row 0, r of 1e-75 stays ordinary, and sum(dy x) stays
    # within float64, where the reference computes it.
    big, mid, huge = (1e80, 1e75, 1e200) if dtype == "float64" else (1e20, 1e9, 1e29)
    x = rng.standard_normal((4, n)) * np.array([big, mid, 1.0, 1.0])[:, None]
    x[2, 3] = np.nan
    dy = rng.standard_normal((4, n)) * np.array([1.0, huge, 1.0, 1.0])[:, None]
    dy[1] = np.abs(dy[1]) * np.sign(x[1])  # each d x alike in sign: their sum overflows
    return x.astype(DTYPES[dtype]), dy.astype(DTYPES[dtype])


def nan_tail(dtype: str, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(x, dy)`` of three unit rows, the middle one with a NaN at ``n // 2`` (after the first
    ``k = n // 4``)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, n))
    x[1, n // 2] = np.nan
    return x.astype(DTYPES[dtype]), rng.standard_normal((3, n)).astype(DTYPES[dtype])


def far_gate(dtype: str, n: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, z, dy)`` of two rows: row 0 with ``z`` at `FAR_Z` (+0.5 on every other element),
    row 1 ordinary. ``x`` and ``dy`` have magnitudes 1 to 1.25 with alternating signs, so that
    ``y_hat`` and each product in the gate's results stay near 1, far from the subnormals
    that TensorFlow's and XLA's CPU arithmetic flushes."""
    rng = np.random.default_rng(5)
    signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    x = signs * (1 + 0.25 * rng.random((2, n)))
    dy = -signs * (1 + 0.25 * rng.random((2, n)))
    z = np.stack([FAR_Z[dtype] + 0.5 * (np.arange(n) % 2), rng.standard_normal(n)])
    return tuple(a.astype(DTYPES[dtype]) for a in (x, z, dy))  # type: ignore[return-value]


def overflowing_squares(n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(x, dy)`` of four rows, for ``variance="fast"``: row 0's squares overflow
    (about 1e40) and its mean's square does not (the reference's ``m2`` is infinite, ``v`` too:
    ``y = b``); row 1's squares and mean's square overflow (``inf - inf``: NaN, as in float32);
    row 2's squares fit but their sum overflows (the reference's ``m2``, a mean, is finite: an
    ordinary row); row 3 of unit scale. Rows 0 and 2 hold pairs ``(a, -1.01 a)``, their mean
    far below their size."""
    rng = np.random.default_rng(20)
    a = 1 + 0.25 * rng.random((4, n // 2))
    pairs = np.stack([a, -1.01 * a], axis=-1).reshape(4, n)
    x = pairs * np.array([1e20, 1.0, 1e19, 1.0])[:, None]
    x[1] = 1e20 * (1 + 0.25 * rng.random(n))
    x[3] = rng.standard_normal(n)
    return x.astype(np.float32), rng.standard_normal((4, n)).astype(np.float32)


def fast_large_mean(n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(x, dy)``: four rows ``1000 + N(0, 1)`` (``m1^2`` about 1e6, whose ulp 0.0625
    is 6 % of the variance: an unrounded ``m1^2``, as a fused multiply-add leaves it, moves
    ``y`` by about 1 %)."""
    rng = np.random.default_rng(21)
    x = 1000 + rng.standard_normal((4, n))
    return x.astype(np.float32), rng.standard_normal((4, n)).astype(np.float32)


def far_dyt(dtype: str, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(x, dy)`` for DyT with alpha 0.5: rows ``30 + N(0, 1)`` (u about 15, slope 4e-13;
    float64: ``40 + N(0, 1)``, slope 8e-18, which ``1 - tanh(u)^2`` made 0 there),
    ``-(24 + N(0, 1))``, ``100 + N(0, 1)`` with a cotangent of 1e10 (u about 50: the slope,
    1.5e-43, is subnormal in float32, ``dx`` about 1e-33 is not; float64: ``700 + N(0, 1)``,
    slope about 1e-304), and a unit row."""
    rng = np.random.default_rng(9)
    wide = dtype == "float64"
    x = rng.standard_normal((4, n)) + np.array([40.0 if wide else 30.0, -24.0,
                                                700.0 if wide else 100.0, 0.0])[:, None]
    dy = rng.standard_normal((4, n)) * np.array([1.0, 1.0, 1.0 if wide else 1e10, 1.0])[:, None]
    return x.astype(DTYPES[dtype]), dy.astype(DTYPES[dtype])


LARGE_MEAN_SCALES = (1e-30, 1e-20, 1e-10, 1e-4, 1.0, 1e25, 1e35)
LARGE_MEAN_SPECS = [
    NormSpec("layer", bias=False),
    NormSpec("layer", bias=False, eps=1e-5, eps_placement="outside"),
    NormSpec("layer", bias=False, gate="after", group_size=16),
    NormSpec("layer", bias=True, gate="after", group_size=16, eps=1e-5, eps_placement="outside"),
]


def large_means(n: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``(x, z, dy, w)``: a row ``s (10 + N(0, 1))`` for each scale of
    `LARGE_MEAN_SCALES` (those below 1e-19 have squares that flush to 0 under XLA; those
    below 1e-3, ``sqrt(eps)``, an ``r`` of about ``1 / sqrt(eps)``; 1e25 and 1e35 are
    rescaled), a gate ``z`` in (-2, 2), ``dy`` of unit scale and a weight ``1 + 0.5 N(0, 1)``:
    the CPU kernel's edge rows (tests/torch/test_torch_cpu_kernel_edges.py)."""
    rng = np.random.default_rng(10)
    scales = np.array(LARGE_MEAN_SCALES)[:, None]
    x = scales * (10 + rng.standard_normal((len(LARGE_MEAN_SCALES), n)))
    z = rng.uniform(-2, 2, x.shape)
    dy = rng.standard_normal(x.shape)
    w = 1 + 0.5 * rng.standard_normal(n)
    return tuple(a.astype(np.float32) for a in (x, z, dy, w))  # type: ignore[return-value]


def check_rows(name: str, got: Any, want: np.ndarray, quantity: str, dtype: Any = None,
               rows: Any = None) -> None:
    """``got`` within the tolerance of ``want``, each row measured on its own (a row's error
    relative to its own largest value), NaN and infinity exactly where ``want`` has them."""
    got = np.asarray(got)
    for i in range(want.shape[0]) if rows is None else rows:
        tolerances.assert_close(
            got[i], want[i], dtype, quantity,  # type: ignore[arg-type]
            what=f"{name}, row {i}",
        )


Evaluate = Callable[..., tuple[Any, ...]]


def check_neighbours(evaluate: Evaluate, spec: NormSpec, dtype: str, **variant: Any) -> None:
    """`neighbours` through ``evaluate``: y, dx and the parameters' gradients per row."""
    x, dy = neighbours(dtype)
    scale = (1 + 0.5 * np.linspace(-1, 1, x.shape[1])).astype(np.float32) if spec.scale else None
    bias = np.linspace(-1, 1, x.shape[1]).astype(np.float32) if spec.bias else None
    y, dx, *_ = evaluate(spec, x, dy, scale, bias, **variant)
    grads = reference.normalize_vjp(x, dy, spec, scale, bias)
    check_rows(f"y of {spec}", y, reference.normalize(x, spec, scale, bias), "forward")
    check_rows(f"dx of {spec}", dx, grads.dx, "grad")


def check_nan_tail(evaluate: Evaluate, spec: NormSpec, dtype: str, **variant: Any) -> None:
    """`nan_tail` through ``evaluate``: y, dx, and the scale's and bias's gradients."""
    x, dy = nan_tail(dtype)
    n = x.shape[1]
    scale = (1 + 0.5 * np.linspace(-1, 1, n)).astype(np.float32) if spec.scale else None
    bias = np.linspace(-1, 1, n).astype(np.float32) if spec.bias else None
    y, dx, dscale, dbias = evaluate(spec, x, dy, scale, bias, **variant)[:4]
    grads = reference.normalize_vjp(x, dy, spec, scale, bias)
    check_rows(f"y of {spec}", y, reference.normalize(x, spec, scale, bias), "forward")
    check_rows(f"dx of {spec}", dx, grads.dx, "grad")
    for name, got, want in (("dscale", dscale, grads.dscale), ("dbias", dbias, grads.dbias)):
        if want is not None:
            tolerances.assert_close(got, want, quantity="grad", what=f"{name} of {spec}")


def check_far_gate(evaluate: Evaluate, gate: str, dtype: str, keeps_subnormals: bool = False,
                   **variant: Any) -> None:
    """`far_gate` through ``evaluate`` with ``NormSpec(gate=gate)`` (SiLU): y and dgate per
    row, and dx with ``gate="before"``. With ``gate="after"`` dx is the norm's backward of
    ``dy a(z)``, about 1e-37, whose intermediate sums are subnormal where arithmetic flushes
    them: checked only where the adapter ``keeps_subnormals``."""
    spec = NormSpec(gate=gate)  # type: ignore[arg-type]
    x, z, dy = far_gate(dtype)
    y, dx, _, _, dz = evaluate(spec, x, dy, gate=z, **variant)[:5]
    grads = reference.gated_normalize_vjp(x, z, dy, spec)
    check_rows(f"y of {spec}", y, reference.gated_normalize(x, z, spec), "forward")
    check_rows(f"dgate of {spec}", dz, grads.dgate, "grad")
    if gate == "before" or keeps_subnormals:
        check_rows(f"dx of {spec}", dx, grads.dx, "grad")


def check_fast_rows(evaluate: Evaluate, spec: NormSpec, rows: str = "overflowing_squares",
                    **variant: Any) -> None:
    """`overflowing_squares` (or `fast_large_mean`) through ``evaluate`` (a spec with
    ``variance="fast"``): y, dx and the parameters' gradients per row."""
    x, dy = {"overflowing_squares": overflowing_squares, "large_mean": fast_large_mean}[rows]()
    n = x.shape[1]
    scale = (1 + 0.5 * np.linspace(-1, 1, n)).astype(np.float32) if spec.scale else None
    bias = np.linspace(-1, 1, n).astype(np.float32) if spec.bias else None
    y, dx, dscale, dbias = evaluate(spec, x, dy, scale, bias, **variant)[:4]
    grads = reference.normalize_vjp(x, dy, spec, scale, bias)
    with np.errstate(invalid="ignore"):
        want = reference.normalize(x, spec, scale, bias)
    check_rows(f"y of {spec}", y, want, "forward")
    check_rows(f"dx of {spec}", dx, grads.dx, "grad")
    for name, got, expected in (("dscale", dscale, grads.dscale), ("dbias", dbias, grads.dbias)):
        if expected is not None:
            tolerances.assert_close(got, expected, quantity="grad", what=f"{name} of {spec}")


def check_far_dyt(evaluate: Evaluate, dtype: str, keeps_subnormals: bool = True,
                  **variant: Any) -> None:
    """`far_dyt` through ``evaluate`` (``NormSpec("dyt")``, alpha 0.5): y and dx per row,
    and dalpha."""
    spec = NormSpec("dyt")
    x, dy = far_dyt(dtype)
    alpha = np.array([0.5], DTYPES[dtype] if dtype == "float64" else np.float32)
    y, dx, *_, dalpha = evaluate(spec, x, dy, alpha=alpha, **variant)
    grads = reference.normalize_vjp(x, dy, spec, alpha=alpha)
    check_rows(f"y of {spec}", y, reference.normalize(x, spec, alpha=alpha), "forward")
    check_rows(f"dx of {spec}", dx, grads.dx, "grad")
    tolerances.assert_close(dalpha, grads.dalpha, quantity="grad", what=f"dalpha of {spec}")


def check_large_means(evaluate: Evaluate, spec: NormSpec, **variant: Any) -> None:
    """`large_means` through ``evaluate``: y and dx per row (per group with ``group_size``),
    and dgate with a gate."""
    x, z, dy, w = large_means()
    bias = np.linspace(-1, 1, x.shape[1]).astype(np.float32) if spec.bias else None
    gate = {"gate": z} if spec.gate else {}
    found = evaluate(spec, x, dy, w, bias, **gate, **variant)
    if spec.gate:
        want = reference.gated_normalize(x, z, spec, w, bias)
        grads = reference.gated_normalize_vjp(x, z, dy, spec, w, bias)
        expected = {"y": want, "dx": grads.dx, "dgate": grads.dgate}
        got = {"y": found[0], "dx": found[1], "dgate": found[4]}
    else:
        grads = reference.normalize_vjp(x, dy, spec, w, bias)
        expected = {"y": reference.normalize(x, spec, w, bias), "dx": grads.dx}
        got = {"y": found[0], "dx": found[1]}
    group = spec.group_size or x.shape[1]
    for name, want in expected.items():
        value = np.asarray(got[name], np.float64)
        for start in range(0, x.shape[1], group):
            part = slice(start, start + group)
            check_rows(f"{name} of {spec}, elements {start}-{start + group - 1}", value[:, part],
                       want[:, part], "forward" if name == "y" else "grad")
