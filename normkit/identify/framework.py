"""`identify` for a framework function: `identify_forward` through the backend's bridge."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from normkit.backends import bridge, device_name
from normkit.identify.forward import Identification, identify_forward

__all__ = ["bridged_forward", "identify"]


def identify(
    fn: Callable[..., Any],
    shape: Sequence[int],
    *,
    backend: str,
    params: bool = False,
    device: str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
) -> Identification:
    """Infer the NormSpec a framework function follows, by probing it (see `identify_forward`).

    Args:
      fn: a function of ``backend``: ``fn(x) -> y``, or ``fn(x, scale, bias) -> y`` with
        ``params=True`` (then the scale, offset, bias and cast order can be determined too).
      shape: the normalized shape: ``fn`` is called on inputs of shape ``(rows, *shape)`` and
        normalizes over all of ``shape``.
      backend: ``"torch"``, ``"jax"`` or ``"tf"``.
      params: whether ``fn`` takes ``scale`` and ``bias`` (arrays of ``shape``).
      device: a device the framework sees (``cpu``, ``cuda:N``, ...).
      dtypes: the input dtypes to probe.

    Returns the spec with what could not be determined (``undetermined``) and the findings
    (``notes``). Raises ValueError if ``fn`` does not behave like any kind, or
    the device is not one the framework sees.
    """
    call = fn if params else (lambda x, scale, bias: fn(x))
    forward = bridged_forward(call, shape, backend, device)
    return identify_forward(forward, math.prod(shape), accepts_params=params, dtypes=dtypes)


def bridged_forward(
    fn: Callable[..., Any], shape: Sequence[int], backend: str, device: str
) -> Callable[[np.ndarray, np.ndarray | None, np.ndarray | None], np.ndarray]:
    """``forward(x, scale, bias)`` on numpy rows ``x`` of shape ``(..., rows, n)``: ``fn(x,
    scale, bias)`` of ``backend`` on ``device``, the rows reshaped to ``shape`` and the
    parameters to it, y as ``(rows, n)``. ValueError for a device the framework does not see."""
    framework = bridge(backend)
    device = device_name(device)
    if device not in framework.devices():
        raise ValueError(f"device {device!r} is not one {backend} sees: {framework.devices()}")
    shape = tuple(shape)
    n = math.prod(shape)

    def forward(x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
        scale, bias = (None if a is None else a.reshape(shape) for a in (scale, bias))
        with warnings.catch_warnings():  # what the probes' own inputs (half x, float32 w) raise
            warnings.simplefilter("ignore")
            y = framework.forward(fn, x.reshape((*x.shape[:-1], *shape)), scale, bias, device)
        return y.reshape(x.shape[-2], n)

    return forward
