"""The ``kernel=`` switch of every normkit.torch API: the names, and the spec fields each kernel
computes. Which implementation runs a call is chosen once per call signature, by its plan
(`normkit.torch._plan`).

- ``"composite"``: torch ops (`normkit.torch._autograd.NormFunction` and its kin).
- ``"cpu"``: normkit's numba kernel (`normkit.torch.kernels.cpu`), CPU tensors only.
- ``"triton"``: normkit's Triton kernels (`normkit.torch.kernels.triton`), CUDA tensors (CPU
  tensors too under ``TRITON_INTERPRET=1``, Triton's interpreter: slow, for testing).
- ``"auto"`` (the default): ``"cpu"`` on the CPU when numba is installed, else ``"composite"``
  (with one warning); ``"triton"`` on CUDA when triton is installed; ``"composite"``
  everywhere else.

float64 inputs, parameters in a dtype other than float32 or the input's, a residual or a gate
in another dtype than the input's, and degenerate rows (n = 1 for the RMS kinds, n <= 2 for
LayerNorm; for the CPU kernel also such groups) always take the composite path, which computes
them exactly. So do meta and fake tensors outside ``torch.compile`` (a meta tensor passes for
any device): that path reads no values, and gives the outputs' shapes, dtypes and strides.
Each kernel module exports ``norm_rows(x, weight, bias, rows, *, gate=None)`` on rows ``x``
of shape (rows, n), ``rows`` the spec as every path reads it (`normkit.torch._spec.RowSpec`,
built once per spec and n by `normkit.torch._spec.row_spec`); the Triton module also
``add_norm_rows(x, residual, weight, bias, rows)`` (`SUPPORTED` lists the spec fields each
computes). A spec with a field a kernel lacks takes the composite path under ``"auto"``
(silently: that is a choice, not a failure) and is an error when the kernel is named.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Literal, TypeAlias, cast

import torch

from normkit.spec import EXTENDED_DEFAULTS, NormSpec
from normkit.torch._cached import cached
from normkit.torch.kernels import cpu

__all__ = ["KERNELS", "SUPPORTED", "Kernel", "check_kernel", "module", "unsupported"]

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

NUMBA = importlib.util.find_spec("numba") is not None
TRITON = importlib.util.find_spec("triton") is not None


def check_kernel(kernel: object) -> Kernel:
    """``kernel`` if it names a kernel, else ValueError listing them."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is invalid: expected one of {KERNELS}")
    return cast(Kernel, kernel)


@cached(256)
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


_MODULES: dict[str, ModuleType] = {"cpu": cpu}


def module(kernel: str) -> ModuleType:
    """The kernel module for ``"cpu"`` or ``"triton"`` (the latter imported on first use)."""
    if kernel not in _MODULES:
        _MODULES[kernel] = importlib.import_module(f"normkit.torch.kernels.{kernel}")
    return _MODULES[kernel]
