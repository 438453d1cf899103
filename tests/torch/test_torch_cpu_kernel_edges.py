"""normkit's CPU kernel on rows at float32's edges, each row (each group) measured against the
reference on its own: rows of scale 0 and 1e-30 to 1e37 side by side, a large mean, partial
RMS heads and tails of different scales, cotangents of 1e-30 to 1e36, a cotangent whose
products with the weight overflow float32, SiLU gates of 1e10 to 1e30 (a sigmoid gate is
bounded by 1); every kind, with and without weight and bias, gate before and after, groups of
different scales side by side, eps inside and outside, float32, bfloat16 and float16 rows.

Measured over a whole batch, an error in a row of 1e25 (whose gradient is about 1e-25) hides
under the ordinary rows' gradients; here every row and group meets the tolerance on its own.
(DyT is not the kernel's: `kernel="cpu"` refuses it.)"""

from __future__ import annotations

import collections
import itertools
import zlib
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest
import torch

from normkit import NormSpec, reference, tolerances
from normkit.torch.functional import normalize
from tests.helpers import gated
from tests.torch import cpu_launches

pytest.importorskip("numba")

DTYPES = {
    "float32": (torch.float32, np.float32),
    "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16),
    "float16": (torch.float16, np.float16),
}
KERNELS = ("forward", "backward", "gated_forward", "gated_backward")
N, GROUP = 64, 16
KINDS = {
    "rms": NormSpec("rms"),
    "partial": NormSpec("partial_rms", p=0.25),
    "partial_k1": NormSpec("partial_rms", p=0.01),
    "layer": NormSpec("layer"),
}
# Row scales: float32's (and bfloat16's) range, and float16's.
WIDE_SCALES = (0.0, 1e-30, 1e-20, 1e-5, 1.0, 1e5, 1e15, 1e19, 1e21, 1e23, 1e25, 1e27, 1e30,
               1e33, 1e35, 1e37)
HALF_SCALES = (0.0, 1e-4, 1e-2, 1.0, 1e2, 1e4)


class Rows(NamedTuple):
    x: np.ndarray
    z: np.ndarray
    dy: np.ndarray


def _rows(dtype: str, group: int, gate: str | None, rng: np.random.Generator) -> Rows:
    """Rows of ``N`` elements, in groups of ``group`` (``N`` for none): every scale in a row of
    its own (and, with groups, every scale in each group position, beside groups of the
    other scales); then rows of mean 10 times their spread; rows whose first quarter (partial
    RMS's statistic) and rest differ in scale; unit rows with cotangents of every scale
    (``gate="before"`` up to 1e30: its norm's gradient at ``x a(z)`` is a float32 row, which
    a cotangent of 1e36 can take beyond float32 where ``dx = e a(z)`` is not); unit rows
    with gates of 1e10 to 1e30 (``a(z) = z``); dy unit and z in (-2, 2) elsewhere."""
    wide = dtype != "float16"
    scales = WIDE_SCALES if wide else HALF_SCALES
    groups = N // group
    plan = [np.roll(scales, -i)[:groups] if groups > 1 else [s] for i, s in enumerate(scales)]
    x = [np.repeat(s, group) * rng.standard_normal(N) for s in plan]
    largest = float(torch.finfo(DTYPES[dtype][0]).max)
    x += [s * (rng.standard_normal(N) + 10) for s in scales if 20 * s < largest]
    big, small = (1e30, 1e-30) if wide else (1e4, 1e-4)
    for head, tail in ((1.0, big), (small, 1.0), (big, 1.0), (1.0, small)):
        x.append(np.concatenate([head * rng.standard_normal(N // 4),
                                 tail * rng.standard_normal(N - N // 4)]))
    dy_scales: tuple[float, ...] = (1e-30, 1e-5, 1e5, 1e30) if wide else (1e-4, 1e2, 1e4)
    if wide and gate != "before":
        dy_scales += (1e36,)
    z_scales = (1e10, 1e20, 1e30) if wide else (1e2, 1e4)
    plain = len(x)
    x += [rng.standard_normal(N) for _ in dy_scales + z_scales]
    rows = len(x)
    dy = rng.standard_normal((rows, N))
    dy[plain:plain + len(dy_scales)] *= np.array(dy_scales)[:, None]
    z = rng.uniform(-2, 2, (rows, N))  # |a(z)| < 1.8: x a(z) stays a float32 number
    z[rows - len(z_scales):] = np.array(z_scales)[:, None] * (1 + rng.random((len(z_scales), N)))
    np_dtype = DTYPES[dtype][1]
    return Rows(*(np.asarray(a, np.float64).astype(np_dtype) for a in (np.array(x), z, dy)))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """The kernels, ungated and gated, compiled for every dtype, with their launches counted."""
    return cpu_launches.counted(monkeypatch, KERNELS, gated=(False, True))


def _tensor(a: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
    if a is None:
        return None
    return torch.from_numpy(np.asarray(a, np.float64)).to(dtype).requires_grad_(True)


def _found(spec: NormSpec, rows: Rows, w: np.ndarray | None, b: np.ndarray | None,
           dtype: torch.dtype) -> dict[str, np.ndarray]:
    """y and the gradients of x, the gate, the weight and the bias from ``kernel="cpu"``."""
    xt, zt = _tensor(rows.x, dtype), _tensor(rows.z, dtype)
    wt, bt = _tensor(w, torch.float32), _tensor(b, torch.float32)
    assert xt is not None and zt is not None
    y = normalize(xt, spec, wt, bt, gate=zt if spec.gate else None, kernel="cpu")
    y.backward(torch.from_numpy(np.asarray(rows.dy, np.float64)).to(y.dtype))
    found = {"y": y, "dx": xt.grad, "dgate": zt.grad, "dweight": None if wt is None else wt.grad,
             "dbias": None if bt is None else bt.grad}
    return {k: v.detach().double().numpy() for k, v in found.items() if v is not None}


def _failures(spec: NormSpec, rows: Rows, w: np.ndarray | None, b: np.ndarray | None,
              dtype: str, group: int) -> list[str]:
    """Each output and gradient of ``kernel="cpu"`` against the reference: the row outputs per
    row and group, the parameters' gradients whole."""
    found = _found(spec, rows, w, b, DTYPES[dtype][0])
    expected = gated.expected(spec, *rows, w, b)
    assert set(found) == set(expected), (set(found), set(expected))
    gate = rows.z if spec.gate else None
    magnitude = reference.scaled_magnitude(rows.x, spec, w, gate=gate)
    failures = []
    for name, want in expected.items():
        quantity = "forward" if name == "y" else "grad"
        if want.ndim == 1:
            parts: list[tuple[str, Any]] = [("", ...)]
        else:
            parts = [(f" row {i} group {j}", (i, slice(j, j + group)))
                     for i in range(want.shape[0]) for j in range(0, N, group)]
        for where, at in parts:
            measured = "float32" if name in ("dweight", "dbias") else dtype
            m = tolerances.measure(found[name][at], want[at], measured, quantity,
                                   magnitude=magnitude[at] if name == "y" else None)
            if not m.passed:
                failures.append(f"{spec} {dtype} {name}{where}: {m.describe()}")
    return failures


@pytest.mark.parametrize("gate", [None, "before", "after"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_row_and_group_at_float32s_edges(kind: str, dtype: str, gate: str | None,
                                              launches: collections.Counter[str]) -> None:
    """Every row (and group) of the plan of `_rows` within the tolerance of its dtype on its
    own: y, dx, the gate's gradient; the weight's and the bias's whole. Without a weight, with
    one, with one and a bias; eps inside and outside; groups of 16 side by side (not for
    partial RMS, which has none)."""
    failures = []
    groups = (N,) if kind.startswith("partial") else (N, GROUP)
    for group, params, outside in itertools.product(groups, ("none", "weight", "bias"),
                                                     (False, True)):
        spec = KINDS[kind].replace(
            gate=gate, gate_activation="silu" if gate else None,
            group_size=group if group < N else None, scale=params != "none",
            bias=params == "bias", eps_placement="outside" if outside else "inside")
        rng = np.random.default_rng(zlib.crc32(f"{spec}-{dtype}".encode()))
        rows = _rows(dtype, group, gate, rng)
        w = (1 + 0.5 * rng.standard_normal(N)).astype(np.float32) if spec.scale else None
        b = rng.standard_normal(N).astype(np.float32) if spec.bias else None
        failures += _failures(spec, rows, w, b, dtype, group)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert sum(launches.values()) == 2 * len(groups) * 3 * 2  # a forward and a backward each


@pytest.mark.parametrize("kind", ["rms", "partial_k1", "layer"])
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_cotangents_whose_products_with_the_weight_overflow(kind: str, outside: bool,
                                                            launches: collections.Counter[str]
                                                            ) -> None:
    """``dy g`` beyond float32 (dy of 1e37, a weight element of 100) on rows of 1e3, where the
    reference's ``dx`` (about 1e36) is a float32 number: the row's sums and ``dx`` are taken
    with float64 products."""
    spec = KINDS[kind].replace(eps_placement="outside" if outside else "inside", bias=False)
    rng = np.random.default_rng(7)
    x = (1e3 * rng.standard_normal((3, N))).astype(np.float32)
    dy = rng.standard_normal((3, N)).astype(np.float32)
    dy[:, :4] = 1e37
    dy[1, :4] *= -1
    w = (1 + 0.5 * rng.standard_normal(N)).astype(np.float32)
    w[:4] = 100.0
    rows = Rows(x, np.zeros_like(x), dy)
    failures = _failures(spec, rows, w, None, "float32", N)
    assert not failures, "\n".join(failures)
    assert launches == {"forward": 1, "backward": 1}
