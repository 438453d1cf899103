"""The conformance hook: run normkit.torch on numpy inputs, forward and backward.

The cross-framework conformance runner calls `devices` and `evaluate`; the torch tests use them
too.
"""

from __future__ import annotations

import contextlib
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
from normkit.torch.functional import add_norm, normalize
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
    residual: np.ndarray | None = None,
    dh: np.ndarray | None = None,
    alpha: np.ndarray | None = None,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray | None, ...]:
    """normkit.torch's outputs for ``spec`` on ``device``, named by
    ``("y", "dx", "dscale", "dbias")``, then ``("h", "dresidual")`` when ``spec.residual`` is
    set, then ``("dalpha",)`` for ``kind="dyt"``.

    Args:
      spec: the norm; any axes.
      x, dy: the input and the cotangent of the output, float16, bfloat16, float32 or float64.
      scale, bias: the parameters in their dtype, or None for the layer's initial value
        (parameters in float32 then).
      residual, dh: given exactly when ``spec.residual`` is set: the residual (x's shape) and
        the cotangent of ``h``; the backward is that of ``sum(dy * y) + sum(dh * h)``.
      alpha: DyT's alpha, shape (1,), or None for the layer's ``alpha_init`` (in the parameter
        dtype).
      device: one of `devices`.
      variant: ``api="module"`` (`from_spec`, the default when ``spec.axis`` is the trailing
        axes of ``x``) or ``api="functional"`` (`normalize` / `add_norm`, the default
        otherwise); ``compiled=True`` runs it under ``torch.compile(fullgraph=True)`` (with
        Inductor's ``emulate_precision_casts`` for ``backward="autograd"``);
        ``kernel=`` one of `normkit.torch.kernels.KERNELS` (default ``"auto"``).

    Returns numpy arrays in the dtypes torch produced; None for a parameter the spec lacks.
    Raises NotImplementedError (a SKIP) for a named kernel that does not compute one of the
    spec's fields, and for the CPU kernel on another device.
    """
    device = device_name(device)
    check_variant(variant, VARIANTS)
    kernel = kernels.check_kernel(variant.get("kernel", "auto"))
    lacking = None if kernel in ("auto", "composite") else kernels.unsupported(kernel, spec)
    if lacking is not None:
        raise NotImplementedError(
            f"kernel={kernel!r} does not compute NormSpec.{lacking} (kernel='auto' computes it "
            "with the composite path)"
        )
    if kernel == "cpu" and device != "cpu":
        raise NotImplementedError(f"kernel='cpu' runs on CPU tensors, not on {device}")
    if kernel == "triton" and not device.startswith("cuda"):
        # Off a GPU the Triton kernels run in Triton's interpreter, read when triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if (residual is None) != (spec.residual is None) or (dh is None) != (residual is None):
        raise ValueError(
            f"residual and dh must be given exactly when the spec has a residual (it has "
            f"residual={spec.residual!r})"
        )
    if alpha is not None and spec.kind != "dyt":
        raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
    axes = spec.resolve_axes(x.ndim)
    trailing = axes == tuple(range(x.ndim - len(axes), x.ndim))
    api = variant.get("api", "module" if trailing else "functional")
    if api == "module" and not trailing:
        raise ValueError(
            f"api='module' is invalid for axis {spec.axis} of a rank-{x.ndim} input: expected "
            "'functional', or 'module' for the trailing axes"
        )
    reference.check_params(x.shape, spec, scale, bias)
    given = next((p.dtype for p in (scale, bias, alpha) if p is not None), np.dtype(np.float32))
    param_dtype = to_torch(np.zeros(0, given)).dtype
    params = _parameters(spec, x.shape, scale, bias, alpha, param_dtype, device)

    module: torch.nn.Module | None = None
    if api == "module":
        trailing_spec = spec.replace(axis=tuple(range(-len(axes), 0)))
        shape = spec.param_shape(x.shape)
        module = from_spec(trailing_spec, shape, device, param_dtype, kernel=kernel)
        for name, param in params.items():
            if param is not None:
                setattr(module, name, param)

    def call(
        t: torch.Tensor, r: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, h)``, h None without a residual."""
        w, b, a = params["weight"], params["bias"], params["alpha"]
        if module is not None:
            out = module(t) if r is None else module(t, r)
        elif r is None:
            out = normalize(t, spec, w, b, alpha=a, kernel=kernel)
        else:
            out = add_norm(t, r, spec, w, b, alpha=a, kernel=kernel)
        return (out[0], out[1]) if isinstance(out, tuple) else (out, None)

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = call
    compiled = bool(variant.get("compiled", False))
    if compiled:
        fn = torch.compile(call, fullgraph=True)
    # backward="autograd" is the eager program's rounding; Inductor keeps it only when asked.
    with _eager_roundings(compiled and spec.backward == "autograd"):
        y, h, xt, rt = _run(fn, x, dy, residual, dh, device)
    assert xt.grad is not None
    grads = {name: None if p is None else p.grad for name, p in params.items()}
    outputs: list[np.ndarray | None] = [to_numpy(y), to_numpy(xt.grad)]
    outputs += [None if grads[n] is None else to_numpy(grads[n]) for n in ("weight", "bias")]
    if h is not None:
        assert rt is not None and rt.grad is not None
        outputs += [to_numpy(h), to_numpy(rt.grad)]
    if spec.kind == "dyt":
        dalpha = grads["alpha"]
        assert dalpha is not None
        outputs.append(to_numpy(dalpha))
    return tuple(outputs)


def _eager_roundings(keep: bool) -> contextlib.AbstractContextManager[object]:
    """Inductor's ``emulate_precision_casts`` when ``keep``: it otherwise fuses the half-precision
    roundings of eager code away."""
    if not keep:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(emulate_precision_casts=True)


def _run(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    x: np.ndarray,
    dy: np.ndarray,
    residual: np.ndarray | None,
    dh: np.ndarray | None,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(y, h, x, residual)`` after the backward of ``sum(dy * y) + sum(dh * h)``."""
    xt = to_torch(x, device).requires_grad_(True)
    rt = None if residual is None else to_torch(residual, device).requires_grad_(True)
    y, h = fn(xt, rt)
    if h is None:
        y.backward(to_torch(dy, device).to(y.dtype))
    else:
        assert dh is not None
        cotangents = [to_torch(dy, device).to(y.dtype), to_torch(dh, device).to(h.dtype)]
        torch.autograd.backward([y, h], cotangents)
    return y, h, xt, rt


def _parameters(
    spec: NormSpec,
    input_shape: tuple[int, ...],
    scale: np.ndarray | None,
    bias: np.ndarray | None,
    alpha: np.ndarray | None,
    param_dtype: torch.dtype,
    device: str,
) -> dict[str, torch.nn.Parameter | None]:
    """weight, bias and alpha as Parameters: the given values, or the layer's initial ones in
    ``param_dtype``; None for those the spec lacks."""
    shape = spec.param_shape(input_shape)
    params: dict[str, torch.nn.Parameter | None] = {}
    initial = {"weight": spec.scale_init, "bias": 0.0, "alpha": spec.alpha_init}
    present = {"weight": spec.scale, "bias": bool(spec.bias), "alpha": spec.kind == "dyt"}
    values = {"weight": scale, "bias": bias, "alpha": alpha}
    for name in ("weight", "bias", "alpha"):
        value = values[name]
        if not present[name]:
            params[name] = None
        elif value is None:
            size = (1,) if name == "alpha" else shape
            init = initial[name]
            assert init is not None
            params[name] = torch.nn.Parameter(
                torch.full(size, init, dtype=param_dtype, device=device)
            )
        else:
            params[name] = torch.nn.Parameter(to_torch(value, device).clone())
    return params
