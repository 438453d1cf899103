"""Central differences of the reference, the independent check of its analytic gradients, and
the random parameters its tests evaluate it with."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from normkit import reference
from normkit.spec import NormSpec


def random_params(spec: NormSpec, shape: tuple[int, ...], rng: np.random.Generator
                  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Standard normal ``(scale, bias)`` of ``spec``'s parameter shape for an input of ``shape``,
    None for a parameter the spec does not have."""
    p_shape = spec.param_shape(shape)
    scale = rng.normal(size=p_shape) if spec.scale else None
    bias = rng.normal(size=p_shape) if spec.bias else None
    return scale, bias


def central_differences(array: np.ndarray, at: Callable[[np.ndarray], float],
                        h: float = 1e-6) -> np.ndarray:
    """The gradient of the scalar function ``at`` at ``array``, by central differences."""
    g = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        plus, minus = array.copy(), array.copy()
        plus[index] += h
        minus[index] -= h
        g[index] = (at(plus) - at(minus)) / (2 * h)
    return g


def numerical_vjp(
    x: np.ndarray, dy: np.ndarray, spec: NormSpec, scale: np.ndarray | None,
    bias: np.ndarray | None, h: float = 1e-6, **call: Any,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Central differences (step ``h``) of ``sum(dy * reference.normalize(x, spec, scale, bias,
    **call))``, summed exactly (``math.fsum``), with respect to x, scale and bias."""

    def loss(x_: np.ndarray, s_: np.ndarray | None, b_: np.ndarray | None) -> float:
        return math.fsum((dy * reference.normalize(x_, spec, s_, b_, **call)).ravel())

    dx = central_differences(x, lambda v: loss(v, scale, bias), h)
    ds = central_differences(scale, lambda v: loss(x, v, bias), h) if scale is not None else None
    db = central_differences(bias, lambda v: loss(x, scale, v), h) if bias is not None else None
    return dx, ds, db
