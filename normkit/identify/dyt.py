"""DyT's ``alpha`` from an elementwise black box ``y = G tanh(alpha x) + B``, by probing it.

For each element, ``f(2x) - B`` over ``f(x) - B`` is free of ``G``::

    r = tanh(2 alpha x) / tanh(alpha x) = 2 / (1 + t^2),    t = tanh(alpha x)

so ``t^2 = 2 / r - 1`` and ``alpha = atanh(t) / |x|``. The probes sweep ``|x|`` over twelve
decades; only elements with ``t^2`` in ``[0.05, 0.9]`` (where ``r`` is far from both 1 and 2)
are used. A true DyT gives the same ``alpha`` on every one of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from normkit.dtypes import round_to

__all__ = ["AlphaFit", "fit_alpha"]

_SIZES = (1e-6, 1e6)  # the |x| swept
_PROBES = 256  # elements in the sweep
_T2_RANGE = (0.05, 0.9)
_MIN_PROBES = 8


@dataclass(frozen=True)
class AlphaFit:
    """The fitted ``alpha`` (None: no fixed alpha explains the output), its spread (``max / min
    - 1`` of the estimates) and the finding."""

    alpha: float | None
    spread: float
    note: str


def fit_alpha(
    h: Callable[[np.ndarray], np.ndarray],
    n: int,
    dtype: np.dtype,
    rng: np.random.Generator,
    zero_output: np.ndarray,
    tolerance: float,
) -> AlphaFit:
    """``alpha`` of ``h`` (rows of ``n`` in ``dtype`` to float64 outputs), if ``h`` is
    ``G tanh(alpha x) + B`` with ``B = zero_output``, to within ``tolerance`` (relative)."""
    rows = -(-_PROBES // n)
    sizes = np.logspace(math.log10(_SIZES[0]), math.log10(_SIZES[1]), rows * n)
    signs = rng.choice([-1.0, 1.0], rows * n)
    # x and 2x are both exact: x is rounded, and doubling is exact short of overflow
    x = round_to((signs * sizes).reshape(rows, n), dtype)
    doubled = round_to(2 * x.astype(np.float64), dtype)
    y = h(np.concatenate([x, doubled])) - zero_output
    low, high = y[:rows], y[rows:]
    with np.errstate(divide="ignore", invalid="ignore"):
        t2 = 2 * low / high - 1
        use = np.isfinite(t2) & (t2 >= _T2_RANGE[0]) & (t2 <= _T2_RANGE[1]) & (low != 0)
        estimates = np.arctanh(np.sqrt(np.where(use, t2, 0.25))) / np.abs(x.astype(np.float64))
    found = estimates[use]
    if found.size < _MIN_PROBES:
        return AlphaFit(
            None,
            math.inf,
            f"it shows the saturation of a tanh on only {found.size} of {rows * n} elements "
            f"swept from |x| = {_SIZES[0]:g} to {_SIZES[1]:g}",
        )
    spread = float(found.max() / found.min() - 1)
    alpha = float(np.median(found))
    if spread > tolerance:
        return AlphaFit(
            None,
            spread,
            f"no fixed alpha fits w tanh(alpha x) + b: the estimates from {found.size} elements "
            f"range {found.min():.3g} .. {found.max():.3g}",
        )
    return AlphaFit(
        alpha,
        spread,
        f"alpha {alpha:.6g} from {found.size} elements where tanh(alpha x)^2 is in "
        f"[{_T2_RANGE[0]}, {_T2_RANGE[1]}], spread {spread:.1e} (the layer's current alpha: "
        "a fresh layer's alpha_init)",
    )
