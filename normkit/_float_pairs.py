"""Error-free transformations of float32 arithmetic, written with ``+``, ``-`` and ``*`` alone
so that they serve any array type (JAX's, TensorFlow's): a product rounded once however a
compiler contracts it into fused multiply-adds, from halves of at most 12 significant bits,
whose products are exact (so that contracting them changes nothing). Each framework gives the
split of a float32 into those halves (`normkit._jax_exact`, normkit.tf's on TensorFlow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LOW_HALF", "exact_product", "two_sum"]

LOW_HALF = -(1 << 12)
"""The int32 mask that clears the 12 low bits of a float32's 23-bit fraction: applied to a
float32's bits, it leaves its high half."""


def two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def exact_product(a: Any, b: Any, split: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``(p, e)``: ``p`` the float32 rounding of ``a * b`` and ``e`` what it leaves, for finite
    products; ``split(v)`` is ``(hi, v - hi)`` with ``hi`` the high half of ``v``
    (`LOW_HALF`)."""
    ah, al = split(a)
    bh, bl = split(b)
    s, e1 = two_sum(ah * bh, ah * bl)
    s, e2 = two_sum(s, al * bh)
    rest = (e1 + e2) + al * bl
    total = s + rest
    return total, rest - (total - s)
