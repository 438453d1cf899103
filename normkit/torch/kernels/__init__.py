"""Which implementation computes a norm: the ``kernel=`` switch of every normkit.torch API.

- ``"composite"``: torch ops (`normkit.torch._autograd.NormFunction` and torch's fused
  LayerNorm where it computes the spec).
- ``"cpu"``: normkit's numba kernel (`normkit.torch.kernels.cpu`), CPU tensors only.
- ``"triton"``: normkit's Triton kernels (`normkit.torch.kernels.triton`), CUDA tensors (CPU
  tensors too under ``TRITON_INTERPRET=1``, Triton's interpreter: slow, for testing).
- ``"auto"`` (the default): ``"cpu"`` on the CPU when numba is installed, else ``"composite"``
  (with one warning); ``"triton"`` on CUDA when triton is installed (for float32 too: eager,
  it is faster there than torch's fused kernels behind normkit's checks, which read their row
  flags back on every call: docs/benchmarks-gpu.md); ``"composite"`` everywhere else.

float64 inputs, parameters in a dtype other than float32 or the input's, a residual or a gate
in another dtype than the input's, and degenerate rows (n = 1 for the RMS kinds, n <= 2 for
LayerNorm; for the CPU kernel also such groups) always take the composite path, which computes
them exactly. So do meta and fake tensors outside ``torch.compile`` (a meta tensor passes for
any device): that path reads no values, and gives the outputs' shapes, dtypes and strides.
Each kernel module exports ``norm_rows(x, weight, bias, options, *, gate=None)`` on rows ``x``
of shape (rows, n), ``options`` the spec as the kernels read it (`KernelOptions`, built once per
spec and n by `kernel_options`); the Triton module also ``add_norm_rows(x, residual, weight,
bias, options)`` (`SUPPORTED` lists the spec fields each computes). A spec with a field a
kernel lacks takes the composite path under ``"auto"`` (silently: that is a choice, not a
failure) and is an error when the kernel is named.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Literal, TypeAlias, cast

import torch

from normkit.spec import EXTENDED_DEFAULTS, NormSpec
from normkit.torch._autograd import _without_data
from normkit.torch.kernels import cpu
from normkit.torch.kernels.options import KernelOptions, kernel_options

__all__ = [
    "KERNELS", "SUPPORTED", "Kernel", "KernelOptions", "check_kernel", "kernel_options", "module",
    "resolve", "unsupported",
]

Kernel: TypeAlias = Literal["auto", "composite", "cpu", "triton"]
KERNELS: tuple[str, ...] = ("auto", "composite", "cpu", "triton")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.bfloat16, torch.float16)

SUPPORTED: dict[str, frozenset[str]] = {
    "cpu": frozenset({"gate", "gate_activation", "group_size"}),
    "triton": frozenset({"residual", "gate", "gate_activation", "group_size"}),
}
"""The fields of `normkit.spec.EXTENDED_DEFAULTS` each kernel computes beyond their defaults
(neither computes ``kind="dyt"``)."""

_NUMBA = importlib.util.find_spec("numba") is not None
_TRITON = importlib.util.find_spec("triton") is not None
_warned = {"auto": False}


def check_kernel(kernel: object) -> Kernel:
    """``kernel`` if it names a kernel, else ValueError listing them."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is invalid: expected one of {KERNELS}")
    return cast(Kernel, kernel)


def _degenerate(kind: str, n: int) -> bool:
    return n <= (2 if kind == "layer" else 1)


@functools.lru_cache(maxsize=256)
def unsupported(kernel: str, spec: NormSpec) -> str | None:
    """The first field of ``spec`` that ``kernel`` (``"cpu"`` or ``"triton"``) does not compute,
    as ``"name=value"``, or None when it computes them all."""
    if spec.kind == "dyt":
        return "kind='dyt'"
    for name, default in EXTENDED_DEFAULTS.items():
        value = getattr(spec, name)
        if value != default and name not in SUPPORTED[kernel]:
            return f"{name}={value!r}"
    return None


def resolve(kernel: str, x: torch.Tensor, spec: NormSpec, n: int) -> str:
    """The implementation that computes ``spec`` on rows of ``n`` elements of ``x`` for
    ``kernel``: ``"composite"``, ``"cpu"`` or ``"triton"``.

    Raises RuntimeError when ``kernel`` names one that cannot run here (numba or triton
    missing, or the wrong device), ValueError when it names one that does not compute a field
    of ``spec``; both name the reason.
    """
    check_kernel(kernel)
    device = x.device.type
    if kernel == "composite":
        return kernel
    if kernel != "auto":
        lacking = unsupported(kernel, spec)
        if lacking is not None:
            raise ValueError(
                f"kernel={kernel!r} does not compute NormSpec.{lacking}: use kernel='auto' or "
                "'composite'"
            )
    if kernel == "cpu":
        if device not in ("cpu", "meta"):
            raise RuntimeError(f"kernel='cpu' runs on CPU tensors; x is on {x.device}")
        if not _NUMBA:
            raise RuntimeError(
                "kernel='cpu' needs numba, which is not installed: pip install 'normkit[torch]'"
            )
    elif kernel == "triton":
        if device not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernel='triton' runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1); "
                f"x is on {x.device}"
            )
        if not _TRITON:
            raise RuntimeError(
                "kernel='triton' needs triton, which is not installed: pip install triton"
            )
    elif device == "cuda" and _TRITON:
        if unsupported("triton", spec) is not None:
            return "composite"
        kernel = "triton"
    elif device != "cpu" or unsupported("cpu", spec) is not None:
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
    if x.dtype not in KERNEL_DTYPES or _degenerate(spec.kind, n) or _without_data(x):
        return "composite"
    return kernel


_MODULES: dict[str, ModuleType] = {"cpu": cpu}


def module(kernel: str) -> ModuleType:
    """The kernel module for ``"cpu"`` or ``"triton"`` (the latter imported on first use)."""
    if kernel not in _MODULES:
        _MODULES[kernel] = importlib.import_module(f"normkit.torch.kernels.{kernel}")
    return _MODULES[kernel]
