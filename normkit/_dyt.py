"""DyT's slope ``tanh'(u) = sech(u)^2``, written with ``*``, ``+`` and the functions every
array namespace names alike (``exp``, ``abs``, ``where``, ``zeros_like``, ``full_like``,
``ones_like`` of numpy, ``jax.numpy`` and ``keras.ops``), so that the reference, normkit.jax,
its Pallas kernels and normkit.tf take it alike::

    sech(u)^2 = 4 e^-2|u| / (1 + e^-2|u|)^2

``1 - tanh(u)^2`` is a difference of nearly equal numbers where ``|u|`` is large: in float32
``tanh(u)`` rounds to 1 from ``|u| = 9`` on, where the slope is 6e-8 (and 4e-13 at 15), and
in float64 it is 1.7e-4 off at 15, 4 % at 18 and 0 at 20 (8.5e-18). This form is accurate to a
few ulps at every ``u``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["tanh_slope"]

# Where the slope is formed in units of e^-shift: |u| above shift / 2 (float32, float64).
_SHIFT = {False: 64.0, True: 512.0}


def tanh_slope(u: Any, xp: Any, wide: bool = False) -> tuple[Any, Any]:
    """``(s, unit)`` with ``s * unit = sech(u)^2``, ``xp`` the array namespace, ``u`` in float32
    (float64 where ``wide``). ``unit`` is 1, or ``e^-S`` where ``2|u| > S`` (S = 64 in float32,
    512 in float64), there ``s = 4 e^(S - 2|u|)``: multiplied into a gradient before ``unit``
    (``(dy s) unit``), it keeps a result that is a normal number where arithmetic flushes
    subnormals (XLA's and TensorFlow's on a CPU; ``sech(u)^2`` is subnormal in float32 from
    ``|u| = 43.6`` on)."""
    shift = _SHIFT[wide]
    twice = 2 * xp.abs(u)
    far = twice > shift
    e = xp.exp(xp.where(far, shift - twice, -twice))  # e^-2|u|, times e^shift where far
    total = 1 + xp.where(far, xp.zeros_like(e), e)  # e^-2|u| < 1e-27 where far: 1 + it is 1
    unit = xp.where(far, xp.full_like(e, math.exp(-shift)), xp.ones_like(e))
    return 4 * e / (total * total), unit
