"""Batch invariance: whether a norm's output bits for a row depend on the batch it is in.

Deterministic serving asks that a row's output not depend on how many rows are computed with
it, their order, or its position among them. `check` runs one forward function on the same rows
in batches of several sizes, reversed, and with one row moved through the positions of a batch,
and compares the bits. It needs only ``forward(x) -> y`` on numpy rows, so every framework's
target is checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["BatchInvariance", "check"]

BATCH_ROWS = (1, 3, 64, 509)
"""The batch sizes the rows are computed in (odd sizes too: a kernel's blocking shows there)."""


@dataclass(frozen=True)
class BatchInvariance:
    """Whether a row's output bits are independent of the number of rows in its batch
    (``rows``), of their order (``order``) and of its position (``position``)."""

    rows: bool
    order: bool
    position: bool

    @property
    def invariant(self) -> bool:
        return self.rows and self.order and self.position

    def describe(self) -> str:
        failed = [name for name in ("rows", "order", "position") if not getattr(self, name)]
        if not failed:
            return "batch-invariant (row count, order, position)"
        return "depends on the batch's " + ", ".join(
            {"rows": "row count", "order": "row order", "position": "row position"}[f]
            for f in failed
        )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def check(
    forward: Callable[[np.ndarray], np.ndarray],
    x: np.ndarray,
    batch_rows: tuple[int, ...] = BATCH_ROWS,
) -> BatchInvariance:
    """Check ``forward`` on the rows of ``x`` (at least ``max(batch_rows)`` rows, any shape).

    ``rows``: each row's output equals its output computed in batches of every size of
    ``batch_rows`` (the first rows of ``x``). ``order``: the outputs of the reversed batch are
    the reversed outputs. ``position``: row 0 alone gives the bits it gives at the second, the
    middle and the last position of the largest batch.
    """
    largest = max(batch_rows)
    if x.shape[0] < largest or largest < 2:
        raise ValueError(
            f"batch invariance needs at least {max(largest, 2)} rows, got {x.shape[0]}"
        )
    x = x[:largest]
    full = np.asarray(forward(x))
    rows = all(_same_bits(np.asarray(forward(x[:m])), full[:m]) for m in batch_rows if m < largest)
    order = _same_bits(np.asarray(forward(x[::-1].copy())), full[::-1])
    alone = np.asarray(forward(x[:1]))[0]
    position = True
    for at in (1, largest // 2, largest - 1):
        moved = x.copy()
        moved[[0, at]] = moved[[at, 0]]
        if not _same_bits(np.asarray(forward(moved))[at], alone):
            position = False
            break
    return BatchInvariance(rows, order, position)
