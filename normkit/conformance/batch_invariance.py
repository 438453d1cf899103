"""Batch invariance: whether a norm's output bits for a row depend on the batch it is in.

Deterministic serving asks that a row's output not depend on how many rows are computed with
it, their order, or its position among them. `check` runs one forward function on the same rows
in batches of several sizes, reversed, and with one row moved through the positions of a batch,
and compares the bits; with a way to set the thread count, it also computes the rows on one
thread and on two. The largest batch holds unusual rows beside the compared ones (a NaN, values
whose squares overflow, a mean far above the spread): an implementation that takes a careful
program for a whole batch where one row needs it changes the other rows' bits there, which
ordinary rows alone never show. It needs only ``forward(x) -> y`` on numpy rows, so every
framework's target is checked the same way: `probe` runs a conformance hook's forward on the
`PROBES`, which is what the conformance report's batch-invariance column states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ml_dtypes
import numpy as np

from normkit import dtypes
from normkit.spec import NormSpec

__all__ = ["PROBES", "BatchInvariance", "Probe", "check", "probe", "probes"]

BATCH_ROWS = (1, 3, 64, 509)
"""The batch sizes the rows are computed in (odd sizes too: a kernel's blocking shows there)."""


@dataclass(frozen=True)
class BatchInvariance:
    """Whether a row's output bits are independent of the number of rows in its batch
    (``rows``), of their order (``order``), of its position (``position``) and of the thread
    count (``threads``; None where it was not checked)."""

    rows: bool
    order: bool
    position: bool
    threads: bool | None = None

    @property
    def invariant(self) -> bool:
        return self.rows and self.order and self.position and self.threads is not False

    def dependencies(self) -> list[str]:
        """What the bits depend on: "row count", "row order", "row position", "thread count"."""
        names = {
            "rows": "row count", "order": "row order", "position": "row position",
            "threads": "thread count",
        }
        return [text for name, text in names.items() if getattr(self, name) is False]

    def describe(self) -> str:
        found = self.dependencies()
        if found:
            return "depends on the batch's " + ", ".join(found)
        checked = "row count, order, position" + (", threads" if self.threads else "")
        return f"batch-invariant ({checked})"

    def to_dict(self) -> dict[str, bool | None]:
        return asdict(self)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _with_unusual_rows(x: np.ndarray, compared: set[int]) -> np.ndarray:
    """``x`` with up to three rows that no check compares made unusual: one with a NaN, one
    whose squares overflow the dtype (float64: 1e100, where the reference still computes its
    statistic), one whose mean is 1e6 beside a spread of about 1 (in float16, 4094)."""
    free = [i for i in range(x.shape[0]) if i not in compared]
    if not free:
        return x
    x = x.copy()
    info = ml_dtypes.finfo(x.dtype)  # numpy's knows no bfloat16
    chosen = [free[len(free) * k // 3] for k in range(3)]
    huge = min(float(np.sqrt(float(info.max))) * 16, 1e100)
    x[chosen[0], min(3, x.shape[1] - 1)] = np.nan
    x[chosen[1]] = (x[chosen[1]].astype(np.float64) * huge).astype(x.dtype)
    x[chosen[2]] = (x[chosen[2]].astype(np.float64) + min(1e6, float(info.max) / 16)).astype(
        x.dtype)
    return x


def check(
    forward: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    batch_rows: tuple[int, ...] = BATCH_ROWS,
    set_threads: Callable[[int], int] | None = None,
) -> BatchInvariance:
    """Check ``forward`` on the rows of ``x`` (at least ``max(batch_rows)`` rows, any shape).

    ``rows``: each row's output equals its output computed in batches of every size of
    ``batch_rows`` (the first rows of ``x``). ``order``: the outputs of the reversed batch are
    the reversed outputs. ``position``: row 0 alone gives the bits it gives at the second, the
    middle and the last position of the largest batch. ``threads`` (with ``set_threads(count)
    -> previous count``): the largest batch gives the same bits on one thread and on two. The
    largest batch's rows past the smaller batches, other than those positions, are made unusual
    (`_with_unusual_rows`).
    """
    largest = max(batch_rows)
    if x.shape[0] < largest or largest < 2:
        raise ValueError(
            f"batch invariance needs at least {max(largest, 2)} rows, got {x.shape[0]}"
        )
    smaller = max((m for m in batch_rows if m < largest), default=1)
    positions = (1, largest // 2, largest - 1)
    x = _with_unusual_rows(x[:largest], set(range(smaller)) | set(positions))
    with np.errstate(all="ignore"):  # a numpy forward on the unusual rows
        return _check(forward, x, batch_rows, positions, set_threads)


def _check(
    forward: Callable[[np.ndarray], np.ndarray], x: np.ndarray, batch_rows: tuple[int, ...],
    positions: tuple[int, ...], set_threads: Callable[[int], int] | None,
) -> BatchInvariance:
    largest = x.shape[0]
    full = np.asarray(forward(x))
    rows = all(_same_bits(np.asarray(forward(x[:m])), full[:m]) for m in batch_rows if m < largest)
    order = _same_bits(np.asarray(forward(x[::-1].copy())), full[::-1])
    alone = np.asarray(forward(x[:1]))[0]
    position = True
    for at in positions:
        moved = x.copy()
        moved[[0, at]] = moved[[at, 0]]
        if not _same_bits(np.asarray(forward(moved))[at], alone):
            position = False
            break
    threads = None
    if set_threads is not None:
        before = set_threads(1)
        try:
            one = np.asarray(forward(x))
            set_threads(2)
            threads = _same_bits(np.asarray(forward(x)), one)
        finally:
            set_threads(before)
    return BatchInvariance(rows, order, position, threads)


@dataclass(frozen=True)
class Probe:
    """One check of the report: rows of ``n`` elements in ``dtype``, normalized by ``spec``."""

    spec: NormSpec
    dtype: str
    n: int

    @property
    def label(self) -> str:
        return f"{self.spec.kind} {self.dtype} n={self.n}"

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "dtype": self.dtype, "n": self.n}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Probe:
        return cls(NormSpec.from_dict(data["spec"]), data["dtype"], data["n"])


PROBES = (
    Probe(NormSpec(), "float32", 64),
    Probe(NormSpec("layer"), "float32", 4096),
    Probe(NormSpec(), "bfloat16", 1024),
)
"""The report's probes: short and long rows, both kinds, a half dtype (where the frameworks'
reductions were seen to change with the batch: XLA's at 64 and 1024 elements, TensorFlow's
compiled one at 4096)."""


def probes(claims: NormSpec | None) -> list[Probe]:
    """`PROBES`, each with ``claims`` instead of its spec for a layer that computes one spec."""
    if claims is None:
        return list(PROBES)
    return [Probe(claims, p.dtype, p.n) for p in PROBES]


def probe(
    evaluate: Callable[..., tuple[Any, ...]],
    found: Probe,
    *,
    device: str,
    set_threads: Callable[[int], int] | None = None,
    **variant: Any,
) -> BatchInvariance:
    """`check` a conformance hook's ``evaluate`` (its ``y``) on ``found``'s rows, with a weight
    away from one (the affine step's rounding shows) and no gradient asked for (``dy = 0``)."""
    rng = np.random.default_rng(found.n)
    dtype = dtypes.as_float_dtype(found.dtype, "a probe's dtype")
    x = rng.standard_normal((max(BATCH_ROWS), found.n)).astype(dtype)
    shape = found.spec.param_shape(x.shape)
    scale = None
    if found.spec.scale:
        scale = np.linspace(0.5, 1.5, int(np.prod(shape)), dtype=np.float32).reshape(shape)

    def forward(rows: np.ndarray) -> np.ndarray:
        y = evaluate(found.spec, rows, np.zeros_like(rows), scale, device=device, **variant)[0]
        return np.asarray(y)

    return check(forward, x, set_threads=set_threads)
