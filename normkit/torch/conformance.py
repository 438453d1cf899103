"""The conformance hook: run normkit.torch on numpy inputs, forward and backward.

The cross-framework conformance runner calls `devices` and `evaluate`; the torch tests use them
too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from normkit import reference
from normkit.backends import device_name
from normkit.bridges import TorchBridge
from normkit.conformance.targets import check_variant
from normkit.spec import NormSpec
from normkit.torch import kernels
from normkit.torch.functional import normalize
from normkit.torch.modules import from_spec

__all__ = ["VARIANTS", "devices", "evaluate", "to_torch", "to_numpy"]

VARIANTS: dict[str, tuple[object, ...] | None] = {
    "api": ("module", "functional"), "compiled": (True, False), "kernel": kernels.KERNELS,
}
"""The variants `evaluate` takes."""

_BRIDGE = TorchBridge()
devices = _BRIDGE.devices
to_torch = _BRIDGE.to_tensor
to_numpy = _BRIDGE.to_numpy


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dscale, dbias)`` of normkit.torch for ``spec`` on ``device``.

    Args:
      spec: the norm; any axes.
      x, dy: the input and the cotangent of the output, float16, bfloat16, float32 or float64.
      scale, bias: the parameters in their dtype, or None for the layer's initial value
        (parameters in float32 then).
      device: one of `devices`.
      variant: ``api="module"`` (`from_spec`, the default when ``spec.axis`` is the trailing
        axes of ``x``) or ``api="functional"`` (`normalize`, the default otherwise);
        ``compiled=True`` runs it under ``torch.compile(fullgraph=True)``; ``kernel=`` one of
        `normkit.torch.kernels.KERNELS` (default ``"auto"``).

    Returns numpy arrays in the dtypes torch produced; None for a parameter the spec lacks.
    """
    device = device_name(device)
    check_variant(variant, VARIANTS)
    kernel = kernels.check_kernel(variant.get("kernel", "auto"))
    if kernel == "triton" and not device.startswith("cuda"):
        # Off a GPU the Triton kernels run in Triton's interpreter, read when triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    axes = spec.resolve_axes(x.ndim)
    trailing = axes == tuple(range(x.ndim - len(axes), x.ndim))
    api = variant.get("api", "module" if trailing else "functional")
    if api == "module" and not trailing:
        raise ValueError(
            f"api='module' is invalid for axis {spec.axis} of a rank-{x.ndim} input: expected "
            "'functional', or 'module' for the trailing axes"
        )
    reference.check_params(x.shape, spec, scale, bias)
    given = next((p.dtype for p in (scale, bias) if p is not None), np.dtype(np.float32))
    param_dtype = to_torch(np.zeros(0, given)).dtype
    shape = spec.param_shape(x.shape)
    params: dict[str, torch.nn.Parameter | None] = {}
    for name, present, value in (("weight", spec.scale, scale), ("bias", spec.bias, bias)):
        if not present:
            params[name] = None
        elif value is None:
            init = spec.scale_init if name == "weight" else 0.0
            value_t = torch.full(shape, init, dtype=param_dtype, device=device)
            params[name] = torch.nn.Parameter(value_t)
        else:
            params[name] = torch.nn.Parameter(to_torch(value, device).clone())

    fn: Callable[[torch.Tensor], torch.Tensor]
    if api == "module":
        trailing_spec = spec.replace(axis=tuple(range(-len(axes), 0)))
        module = from_spec(trailing_spec, shape, device, param_dtype, kernel=kernel)
        for name, param in params.items():
            if param is not None:
                setattr(module, name, param)
        fn = module
    else:
        def fn(t: torch.Tensor) -> torch.Tensor:
            return normalize(t, spec, params["weight"], params["bias"], kernel=kernel)

    if variant.get("compiled", False):
        fn = torch.compile(fn, fullgraph=True)
    xt = to_torch(x, device).requires_grad_(True)
    y = fn(xt)
    y.backward(to_torch(dy, device))
    assert xt.grad is not None
    grads = [None if p is None else p.grad for p in params.values()]
    dscale, dbias = (None if g is None else to_numpy(g) for g in grads)
    return to_numpy(y), to_numpy(xt.grad), dscale, dbias
