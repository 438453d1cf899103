"""The conformance hook of normkit.torch: its modules or functions, eager or compiled, on any of
its kernels (a `normkit.conformance.harness.Harness`)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import torch

from normkit.bridges import TorchBridge, VjpFn
from normkit.conformance.harness import Harness
from normkit.conformance.support import PROBE_SHAPE, Cell
from normkit.spec import NormSpec
from normkit.torch import kernels
from normkit.torch.functional import add_norm, normalize
from normkit.torch.modules import from_spec

__all__ = [
    "VARIANTS", "build", "devices", "evaluate", "probes_skipped", "set_threads", "support",
]

VARIANTS: dict[str, tuple[object, ...] | None] = {
    "api": ("module", "functional"), "compiled": (True, False), "kernel": kernels.KERNELS,
}
"""The variants `evaluate` takes."""
_BRIDGE = TorchBridge()
_WEIGHTS = {"scale": "weight", "bias": "bias", "alpha": "alpha"}
"""The modules' names of the parameters."""


def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, **variant: Any,
) -> VjpFn:
    """``fn(x[, residual or gate], **params)``: normkit.torch for ``spec``.

    Variants: ``api="module"`` (`from_spec`, the default when ``spec.axis`` is the trailing axes
    of the input) or ``api="functional"`` (`normalize` / `add_norm`, the default otherwise);
    ``compiled=True`` runs it under ``torch.compile(fullgraph=True)`` (with Inductor's
    ``emulate_precision_casts`` for ``backward="autograd"``, which keeps the eager program's
    roundings); ``kernel=`` one of `normkit.torch.kernels.KERNELS` (default ``"auto"``).

    Raises NotImplementedError (a SKIP) for a named kernel that does not compute one of the
    spec's fields, and for the CPU kernel on another device.
    """
    del dtype  # the modules take the input's dtype as it comes
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
    axes = spec.resolve_axes(len(shape))
    trailing = axes == tuple(range(len(shape) - len(axes), len(shape)))
    api = variant.get("api", "module" if trailing else "functional")
    if api == "module" and not trailing:
        raise ValueError(
            f"api='module' is invalid for axis {spec.axis} of a rank-{len(shape)} input: "
            "expected 'functional', or 'module' for the trailing axes"
        )
    if api == "module":
        trailing_spec = spec.replace(axis=tuple(range(-len(axes), 0)))
        torch_dtype = _BRIDGE.to_tensor(np.zeros(0, param_dtype)).dtype
        module = from_spec(
            trailing_spec, spec.param_shape(shape), device, torch_dtype, kernel=kernel
        )

        def call(x: torch.Tensor, second: torch.Tensor | None = None, **params: Any) -> Any:
            weights = {_WEIGHTS[name]: value for name, value in params.items()}
            if spec.gate is not None:
                return torch.func.functional_call(module, weights, (x,), {"gate": second})
            inputs = (x,) if second is None else (x, second)
            return torch.func.functional_call(module, weights, inputs)

        own = dict(module.named_parameters())
        initial = {n: _BRIDGE.to_numpy(own[w]) for n, w in _WEIGHTS.items() if w in own}

    else:

        def call(x: torch.Tensor, second: torch.Tensor | None = None, **params: Any) -> Any:
            weight, bias, alpha = (params.get(name) for name in _WEIGHTS)
            if second is None or spec.residual is None:
                return normalize(x, spec, weight, bias, gate=second, alpha=alpha, kernel=kernel)
            return add_norm(x, second, spec, weight, bias, alpha=alpha, kernel=kernel)

        initial = {}  # the functions have no parameters of their own
    if variant.get("compiled", False):
        options: dict[str, Any] | None = None
        if spec.backward == "autograd":
            options = {"emulate_precision_casts": True}
        call = torch.compile(call, fullgraph=True, options=options)
    call.initial_params = initial  # type: ignore[attr-defined]
    return call


_HARNESS = Harness(_BRIDGE, build, VARIANTS)
devices = _HARNESS.devices
evaluate = _HARNESS.evaluate


def set_threads(count: int) -> int:
    """Run torch's CPU ops (and normkit's CPU kernel, which follows them) on ``count`` threads;
    returns the count before."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    return before


def probes_skipped(device: str, **variant: Any) -> str | None:
    """Why the batch-invariance probes do not run for ``variant`` on ``device``, or None: the
    Triton kernels off a GPU run in Triton's interpreter, too slow for the probes' batches
    (tests/conformance/test_batch_invariance.py checks them there on small ones)."""
    if variant.get("kernel") == "triton" and not device.startswith("cuda"):
        return "the Triton kernels run in Triton's interpreter here"
    return None


def _refused(spec: NormSpec, argument: str | None, call: Any) -> Cell:
    """``call(x, second)`` on `PROBE_SHAPE` ones: ``("no", message)`` where normkit.torch
    refuses the spec (a ValueError) or has no ``argument``, else ``("yes", "")``."""
    if argument is not None and argument not in inspect.signature(call).parameters:
        return "no", f"normkit.torch.{call.__name__} takes no {argument}="
    x = torch.ones(PROBE_SHAPE)
    try:
        call(x, x if spec.gate is not None or spec.residual is not None else None)
    except ValueError as exc:
        return "no", str(exc)
    return "yes", ""


def support(spec: NormSpec, argument: str | None) -> dict[str, Cell]:
    """What each implementation does with ``spec`` and the call ``argument``
    (`normkit.conformance.support`): the composite path (`normalize` and `add_norm`, which
    compute every spec normkit.torch accepts), each named kernel (`kernels.unsupported`: a
    field it lacks takes the composite path under ``kernel="auto"``) and a sharded normalized
    dim (`normkit.torch.distributed.normalize_sharded`)."""
    from normkit.torch.distributed import normalize_sharded

    def composite(x: torch.Tensor, second: torch.Tensor | None) -> Any:
        if spec.residual is not None:
            return add_norm(x, x, spec, kernel="composite")
        return normalize(x, spec, gate=second, kernel="composite")

    composite.__name__ = "add_norm" if spec.residual is not None else "normalize"
    composite.__signature__ = inspect.signature(  # type: ignore[attr-defined]
        add_norm if spec.residual is not None else normalize
    )
    found = {"composite": _refused(spec, argument, composite)}
    for kernel in kernels.KERNELS:
        if kernel in ("auto", "composite"):
            continue
        lacking = kernels.unsupported(kernel, spec)
        if found["composite"][0] == "no":
            found[kernel] = found["composite"]
        elif lacking is not None:
            found[kernel] = "fallback", "composite"
        else:
            found[kernel] = "yes", ""

    def sharded(x: torch.Tensor, second: torch.Tensor | None) -> Any:
        try:
            return normalize_sharded(x, spec)
        except RuntimeError:  # the spec accepted; torch.distributed is not initialized here
            return None

    sharded.__signature__ = inspect.signature(normalize_sharded)  # type: ignore[attr-defined]
    sharded.__name__ = "distributed.normalize_sharded"
    found["sharded"] = _refused(spec, argument, sharded)
    return found
