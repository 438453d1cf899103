"""Which implementation computes a norm: the ``kernel=`` switch of every normkit.torch API.

- ``"composite"``: torch ops (`normkit.torch._autograd.NormFunction` and torch's fused
  LayerNorm where it computes the spec).
- ``"cpu"``: normkit's numba kernel (`normkit.torch.kernels.cpu`), CPU tensors only.
- ``"triton"``: normkit's Triton kernels (`normkit.torch.kernels.triton`), CUDA tensors (CPU
  tensors too under ``TRITON_INTERPRET=1``, Triton's interpreter: slow, for testing).
- ``"auto"`` (the default): ``"cpu"`` on the CPU when numba is installed, else ``"composite"``
  (with one warning); ``"composite"`` on every other device.

float64 inputs, parameters in a dtype other than float32 or the input's, and degenerate rows
(n = 1 for the RMS kinds, n <= 2 for LayerNorm) always take the composite path, which computes
them exactly. Each kernel module exports ``norm_rows(x,
weight, bias, *, kind, k, eps, outside, scale_offset, cast)`` on rows ``x`` of shape (rows, n).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Literal, TypeAlias, cast

import torch

from normkit.torch.kernels import cpu

__all__ = ["KERNELS", "Kernel", "check_kernel", "module", "resolve"]

Kernel: TypeAlias = Literal["auto", "composite", "cpu", "triton"]
KERNELS: tuple[str, ...] = ("auto", "composite", "cpu", "triton")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_NUMBA = importlib.util.find_spec("numba") is not None
_warned = {"auto": False}


def check_kernel(kernel: object) -> Kernel:
    """``kernel`` if it names a kernel, else ValueError listing them."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is invalid: expected one of {KERNELS}")
    return cast(Kernel, kernel)


def _degenerate(kind: str, n: int) -> bool:
    return n <= (2 if kind == "layer" else 1)


def resolve(kernel: str, x: torch.Tensor, kind: str, n: int) -> str:
    """The implementation that computes rows of ``n`` elements of ``x`` for ``kernel``.

    ``"composite"``, ``"cpu"`` or ``"triton"``. Raises RuntimeError when ``kernel`` names one
    that cannot run here (numba or triton missing, or the wrong device), naming the reason.
    """
    check_kernel(kernel)
    device = x.device.type
    if kernel == "composite":
        return kernel
    if kernel == "cpu":
        if device != "cpu":
            raise RuntimeError(f"kernel='cpu' runs on CPU tensors; x is on {x.device}")
        if not _NUMBA:
            raise RuntimeError(
                "kernel='cpu' needs numba, which is not installed: pip install 'normkit[torch]'"
            )
    elif kernel == "triton":
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernel='triton' runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1); "
                f"x is on {x.device}"
            )
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(
                "kernel='triton' needs triton, which is not installed: pip install triton"
            )
    elif device != "cpu":
        return "composite"
    elif not _NUMBA:
        if not _warned["auto"] and not torch.compiler.is_compiling():
            _warned["auto"] = True
            warnings.warn(
                "normkit's CPU kernel needs numba, which is not installed; using the composite "
                "path. Install it with pip install 'normkit[torch]'.",
                RuntimeWarning,
                stacklevel=4,
            )
        return "composite"
    else:
        kernel = "cpu"
    if x.dtype not in KERNEL_DTYPES or _degenerate(kind, n):
        return "composite"
    return kernel


def module(kernel: str) -> ModuleType:
    """The kernel module for ``"cpu"`` or ``"triton"`` (the latter imported on first use)."""
    if kernel == "cpu":
        return cpu
    return importlib.import_module(f"normkit.torch.kernels.{kernel}")
