"""Plans: what a call of a normkit.torch norm runs, decided once per call signature.

A call's signature is what its plan depends on: x's dtype, device, normalized sizes and
layout, whether autograd records the call, and the dtypes, shapes and devices of the
parameters, the residual and the gate. The first call with a signature builds its `Plan`: every
check of the arguments, the spec encoded for the rows (`normkit.torch._spec.RowSpec`), and the
choice of implementation (`choose`: the CPU kernel, the Triton kernels, the composite path or
the eager op sequence), which is made here and nowhere else. A later call with the same
signature looks its plan up (`Plans`), allocates its outputs and launches.

Calls that are traced (``torch.compile``, ``torch.func`` transforms, a dispatch mode,
``torch.jit.trace``, ``torch.export``) or whose tensor is not a plain one (a DTensor, a fake
tensor) build their plan on every call: it depends on the tracing state, and building it is
what a tracer records once.
"""

from __future__ import annotations

import math
import os
import sys
import typing
import warnings
from collections.abc import Callable
from typing import Any

import torch

from normkit.spec import NormSpec
from normkit.torch import _eager, _gated, kernels
from normkit.torch._autograd import (
    DytFunction,
    FusedNorm,
    GradInFormat,
    NormFunction,
    RoundThrough,
    _acc_dtype,
    _shape_only,
    _without_data,
    apply,
    apply_eager,
    fused_computes,
)
from normkit.torch._checks import check_param, check_tensor, dtype_name
from normkit.torch._spec import RowSpec, row_spec
from normkit.torch._stacklevel import user_stacklevel
from normkit.torch.kernels import HALF_DTYPES, KERNEL_DTYPES, Kernel, cpu

__all__ = ["Plan", "Plans", "check_trailing", "choose", "output_dtype"]

#: The most plans one `Plans` keeps; past it the oldest is dropped (a loop over ever new row
#: counts does not add plans: the row count is not part of a signature).
MAX_PLANS = 64
_warned = {"auto": False}

Operands = tuple[torch.Tensor | None, ...]
"""``(residual, gate, weight, bias, alpha)`` of a call, None where absent."""


# ---- the checks, made when a plan is built ----------------------------------------------------


def check_trailing(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> None:
    """ValueError unless ``x``'s trailing dims are ``normalized_shape``."""
    m = len(normalized_shape)
    if x.dim() < m or tuple(x.shape[x.dim() - m :]) != normalized_shape:
        raise ValueError(
            f"input of shape {tuple(x.shape)} does not end in normalized_shape "
            f"{normalized_shape}"
        )


def _check_alpha(alpha: torch.Tensor | None, spec: NormSpec) -> None:
    if alpha is None:
        return
    if spec.kind != "dyt":
        raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
    check_tensor(alpha, "alpha")
    if tuple(alpha.shape) not in ((), (1,)):
        raise ValueError(
            f"alpha has shape {tuple(alpha.shape)}, expected a scalar (shape () or (1,))"
        )


def _given_as_the_spec_asks(
    x: torch.Tensor, tensor: torch.Tensor | None, name: str, field: object, *, unasked: str,
    missing: str,
) -> bool:
    """Whether ``tensor`` (the argument ``name``) is given, which it must be exactly when the
    spec's field ``field`` is set (else ValueError ``unasked`` or ``missing``); a given one must
    be a float tensor of x's shape."""
    if field is None:
        if tensor is not None:
            raise ValueError(unasked)
        return False
    if tensor is None:
        raise ValueError(missing)
    check_tensor(tensor, name)
    if tensor.shape != x.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected the shape of x, {tuple(x.shape)}"
        )
    return True


def _check_gate(x: torch.Tensor, gate: torch.Tensor | None, spec: NormSpec) -> None:
    """A gate exactly when ``spec.gate`` is set: a float tensor of x's shape and device."""
    if _given_as_the_spec_asks(
        x, gate, "gate", spec.gate,
        unasked="normalize: a gate was given but the spec has gate=None; build the spec with "
        "gate='before' or 'after' to gate the norm",
        missing=f"normalize: the spec has gate={spec.gate!r}, which needs the gate tensor: "
        "normalize(x, spec, weight, bias, gate=z)",
    ):
        assert gate is not None
        if gate.device != x.device:
            raise ValueError(f"gate is on {gate.device}, x on {x.device}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor | None, spec: NormSpec) -> None:
    """TypeError/ValueError unless ``residual`` fits ``x`` for ``spec.residual``: given exactly
    when the spec has one, of x's shape, and x's dtype (or the compute dtype, for
    ``"float32"``)."""
    if not _given_as_the_spec_asks(
        x, residual, "residual", spec.residual,
        unasked="a residual was given but the spec has residual=None: build it with "
        "residual='rounded', 'float32' or 'float32_normalized' to add one",
        missing=f"the spec has residual={spec.residual!r}: add_norm(x, residual, spec, ...) (a "
        "module: module(x, residual)), which returns (y, h)",
    ):
        return
    assert residual is not None
    allowed = {x.dtype}
    if spec.residual == "float32":
        allowed.add(_acc_dtype(x.dtype))
    if residual.dtype not in allowed:
        names = " or ".join(sorted(dtype_name(d) for d in allowed))
        raise TypeError(
            f"residual has dtype {dtype_name(residual.dtype)}; residual={spec.residual!r} with x "
            f"of dtype {dtype_name(x.dtype)} needs {names}"
        )


def output_dtype(
    x: torch.Tensor, spec: NormSpec, *params: torch.Tensor | None
) -> torch.dtype:
    """y's dtype: x's (``output_dtype="input"``), or x's promoted with the given parameters'
    (``"promote"``; float16 with bfloat16 gives float32)."""
    out = x.dtype
    if spec.output_dtype == "promote":
        for p in params:
            if p is not None:
                out = torch.promote_types(out, p.dtype)
    return out


def _affine_dtype(
    dtype: torch.dtype, spec: NormSpec, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.dtype:
    """The affine step's dtype, as the reference's: x's promoted with the effective scale's
    (w's, or at least float32 where the offset is added in float32) and the bias's; the initial
    parameters (None) take no part."""
    if weight is not None:
        scale = weight.dtype
        if spec.scale_offset and spec.offset_dtype == "float32":
            scale = torch.promote_types(scale, torch.float32)
        dtype = torch.promote_types(dtype, scale)
    return dtype if bias is None else torch.promote_types(dtype, bias.dtype)


# ---- the choice of implementation -------------------------------------------------------------


def _recorded() -> bool:
    """Whether the ops are being recorded into a graph of torch ops (``torch.jit.trace``, the
    ONNX exporters, ``torch.export``), which then holds the eager op sequence (`_eager`): the
    spec's forward without the rescaling of rows whose statistic overflows or underflows
    float32, and autograd's gradients."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def choose(kernel: str, x: torch.Tensor, spec: NormSpec, rows: RowSpec) -> str:
    """The implementation that computes ``spec`` on ``rows`` of ``x`` for ``kernel``:
    ``"composite"``, ``"cpu"`` or ``"triton"``.

    ``"auto"`` takes the CPU kernel only where `normkit.torch.kernels.cpu.ready` says it is
    compiled (the composite path meanwhile, the same for the whole process).

    Raises RuntimeError when ``kernel`` names one that cannot run here (numba or triton
    missing, or the wrong device), ValueError when it names one that does not compute a field
    of ``spec``; both name the reason.
    """
    device = x.device.type
    auto = kernel == "auto"
    if kernel == "composite":
        return kernel
    if kernel != "auto":
        lacking = kernels.unsupported(kernel, spec)
        if lacking is not None:
            raise ValueError(
                f"kernel={kernel!r} does not compute NormSpec.{lacking}: use kernel='auto' or "
                "'composite'"
            )
    if kernel == "cpu":
        if device not in ("cpu", "meta"):
            raise RuntimeError(f"kernel='cpu' runs on CPU tensors; x is on {x.device}")
        if not kernels.NUMBA:
            raise RuntimeError(
                "kernel='cpu' needs numba, which is not installed: pip install 'normkit[torch]'"
            )
    elif kernel == "triton":
        if device not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernel='triton' runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1); "
                f"x is on {x.device}"
            )
        if not kernels.TRITON:
            raise RuntimeError(
                "kernel='triton' needs triton, which is not installed: pip install triton"
            )
    elif device == "cuda" and kernels.TRITON:
        if kernels.unsupported("triton", spec) is not None:
            return "composite"
        kernel = "triton"
    elif device != "cpu" or kernels.unsupported("cpu", spec) is not None:
        return "composite"
    elif not kernels.NUMBA:
        if not _warned["auto"] and not torch.compiler.is_compiling():
            _warned["auto"] = True
            warnings.warn(
                "normkit.torch: numba is not installed, so the CPU kernel is unavailable and "
                f"this process runs the slower composite path; {cpu.INSTALL}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return "composite"
    else:
        kernel = "cpu"
    if x.dtype not in KERNEL_DTYPES or cpu.degenerate(rows) or _without_data(x):
        return "composite"
    if auto and kernel == "cpu" and not torch.compiler.is_compiling():
        gated = rows.gate != "" or rows.group != rows.n
        if not cpu.ready(x.dtype, gated):  # not compiled on this machine yet
            return "composite"
    return kernel


# ---- plans ------------------------------------------------------------------------------------


class Plans:
    """The plans of one spec and ``kernel=`` choice, by call signature: a module's, or the
    functions' for one spec.

    ``spec64``: the spec for float64 inputs where it differs (an RMSNorm built with torch's
    ``eps=None`` takes float64's machine eps for them); ``shape``: the trailing dims an input
    must end in (a module's ``normalized_shape``), or None.
    """

    __slots__ = ("by_key", "kernel", "m", "shape", "spec", "spec64", "trailing")

    def __init__(self, spec: NormSpec, kernel: Kernel, spec64: NormSpec | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
        self.spec, self.kernel, self.shape = spec, kernel, shape
        self.spec64 = spec if spec64 is None else spec64
        axis = spec.axis if isinstance(spec.axis, tuple) else (spec.axis,)
        self.m = len(axis)
        self.trailing = axis == tuple(range(-self.m, 0))
        self.by_key: dict[tuple[Any, ...], Plan] = {}

    def __getstate__(self) -> tuple[Any, ...]:
        # A copied or pickled module starts without plans: they hold launchers and closures.
        return self.spec, self.kernel, self.spec64, self.shape

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, h)`` of one call (h None without a residual)."""
        if (  # compiling first: dynamo folds it (torch.export traces with dynamo or fakes)
            torch.compiler.is_compiling() or type(x) is not torch.Tensor
            or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() or torch._C._get_tracing_state() is not None
        ):
            return self.build(None, x, residual, gate, weight, bias, alpha)(
                x, residual, gate, weight, bias, alpha
            )
        grad = torch.is_grad_enabled() and (
            x.requires_grad or _requires_grad(weight) or _requires_grad(bias)
            or _requires_grad(residual) or _requires_grad(gate) or _requires_grad(alpha)
        )
        key = (
            x.dtype, x.device, x.shape[-self.m:] if self.trailing else x.shape,
            True if x.is_contiguous() else _memory_format(x), grad,
            x.dtype in HALF_DTYPES and _autocast_on(x.device.type),
            # the other operands' dtypes, shapes, devices and layouts, written out: a call each
            # would be most of a lookup's Python work
            None if weight is None else (
                weight.dtype, weight.shape, weight.device, weight.is_contiguous()),
            None if bias is None else (bias.dtype, bias.shape, bias.device, bias.is_contiguous()),
            None if alpha is None else (alpha.dtype, alpha.shape, alpha.device),
            None if residual is None else (
                residual.dtype, residual.shape == x.shape, residual.device,
                residual.is_contiguous()),
            None if gate is None else (
                gate.dtype, gate.shape == x.shape, gate.device, gate.is_contiguous()),
        )
        plan = self.by_key.get(key)
        if plan is None:
            plan = self.build(key, x, residual, gate, weight, bias, alpha)
        return plan(x, residual, gate, weight, bias, alpha)

    def build(
        self, key: tuple[Any, ...] | None, x: torch.Tensor, residual: torch.Tensor | None,
        gate: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
        alpha: torch.Tensor | None,
    ) -> Plan:
        """The plan of a call (checking every argument), kept under ``key`` when not None."""
        check_tensor(x, "x")
        if self.shape is not None:
            check_trailing(x, self.shape)
        spec = self.spec64 if x.dtype == torch.float64 else self.spec
        _check_gate(x, gate, spec)
        _check_residual(x, residual, spec)
        spec.check_eps(dtype_name(x.dtype))
        _check_alpha(alpha, spec)
        plan = _build(spec, self.kernel, x, residual, gate, weight, bias, alpha)
        if key is not None:
            if len(self.by_key) >= MAX_PLANS:
                del self.by_key[next(iter(self.by_key))]
            self.by_key[key] = plan
        return plan


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a device without autocast)."""
    return device_type in _AUTOCAST_KEYS and torch.is_autocast_enabled(device_type)


def _requires_grad(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad


Route = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""An implementation on rows: ``route(x, residual, gate, weight, bias, alpha) -> (y, h)`` with
x (rows, n) contiguous, the residual and gate rows of its shape (or None) and the parameters
flat, (n,)."""


class Plan:
    """One signature's call: x (and its residual and gate) as rows (rows, n), the parameters
    flat, the ``route`` on them, the outputs in x's shape and memory format.

    ``axes``: the normalized axes of x, moved to the end and back where they are not the
    trailing ones (None where they are); ``layout``: x's channels-last memory format, which
    the outputs and the gradients keep (None for a contiguous x).
    """

    __slots__ = ("axes", "layout", "n", "route", "with_h")

    def __init__(
        self, route: Route, n: int, with_h: bool, axes: tuple[int, ...] | None = None,
        layout: torch.memory_format | None = None,
    ) -> None:
        self.route, self.n, self.with_h, self.axes, self.layout = route, n, with_h, axes, layout

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = self.n
        if self.axes is None and self.layout is None:
            shape = x.shape
            if x.dim() != 2 or shape[1] != n:  # rows of several axes: one row per (a, b) too
                x = x.reshape(-1, n)
                residual = None if residual is None else residual.reshape(-1, n)
                gate = None if gate is None else gate.reshape(-1, n)
            if weight is not None and weight.dim() != 1:
                weight = weight.reshape(n)
            if bias is not None and bias.dim() != 1:
                bias = bias.reshape(n)
            y, h = self.route(x, residual, gate, weight, bias, alpha)
            if y.shape != shape:
                y = y.view(shape)
                h = None if h is None else h.view(shape)
            return y, h
        return self._moved(x, residual, gate, weight, bias, alpha)

    def _moved(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`__call__` where the axes are moved or x is channels-last."""
        layout, axes = self.layout, self.axes
        x = _grad_in_format(x, layout)
        residual, gate = _grad_in_format(residual, layout), _grad_in_format(gate, layout)
        if axes is not None:
            trailing = tuple(range(x.dim() - len(axes), x.dim()))
            x = x.movedim(axes, trailing)
            residual = None if residual is None else residual.movedim(axes, trailing)
            gate = None if gate is None else gate.movedim(axes, trailing)
        shape = x.shape
        flat = [None if t is None else t.reshape(-1, self.n) for t in (x, residual, gate)]
        params = [None if p is None else p.reshape(self.n) for p in (weight, bias)]
        y, h = self.route(flat[0].contiguous(), *flat[1:], *params, alpha)  # type: ignore[union-attr]
        y, h = y.reshape(shape), None if h is None else h.reshape(shape)
        if axes is not None:
            y, h = y.movedim(trailing, axes), None if h is None else h.movedim(trailing, axes)
        if layout is not None:
            y = y.contiguous(memory_format=layout)
            h = None if h is None else h.contiguous(memory_format=layout)
        return y, h


@typing.overload
def _grad_in_format(t: torch.Tensor, layout: torch.memory_format | None) -> torch.Tensor: ...


@typing.overload
def _grad_in_format(t: None, layout: torch.memory_format | None) -> None: ...


def _grad_in_format(
    t: torch.Tensor | None, layout: torch.memory_format | None
) -> torch.Tensor | None:
    """``t``, whose gradient keeps its channels-last layout (`GradInFormat`) where it has one."""
    if t is None or layout is None or not t.requires_grad:
        return t
    return typing.cast(torch.Tensor, apply(GradInFormat, t, layout))


def _memory_format(x: torch.Tensor) -> torch.memory_format | None:
    """x's channels-last layout, which the outputs keep as torch's ops do; None otherwise."""
    if x.is_contiguous():
        return None
    for layout, rank in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == rank and x.is_contiguous(memory_format=layout):
            return layout
    return None


def _autocasts_to_float32(x: torch.Tensor, spec: NormSpec) -> bool:
    """Whether torch's own op for ``spec`` (``layer_norm``, ``rms_norm`` for the RMS kinds)
    would run in float32 here: autocast is on for x's device and registers a (float32) kernel
    for it there, as on CUDA; not on the CPU, nor for DyT, which torch lacks."""
    key = _AUTOCAST_KEYS.get(x.device.type)  # none for meta tensors, which have no autocast
    if key is None or spec.kind == "dyt" or x.dtype not in HALF_DTYPES:
        return False
    if not torch.is_autocast_enabled(x.device.type):
        return False
    op = "aten::layer_norm" if spec.kind == "layer" else "aten::rms_norm"
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


#: The dispatch key of each device type's autocast.
_AUTOCAST_KEYS = {
    "cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"
}


def _build(
    spec: NormSpec, kernel: str, x: torch.Tensor, residual: torch.Tensor | None,
    gate: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
) -> Plan:
    """The plan of a call whose arguments `Plans.build` checked."""
    if "torch.distributed.tensor" in sys.modules:  # only then can x be a DTensor
        from normkit.torch import distributed

        if isinstance(x, distributed.DTensor):
            return _distributed(spec, kernel, x, gate)
    if _autocasts_to_float32(x, spec):
        return _Whole(_Autocast(spec, kernel))  # type: ignore[arg-type]
    axes = spec.resolve_axes(x.dim())
    trailing = tuple(range(x.dim() - len(axes), x.dim()))
    shape = tuple(x.shape[a] for a in axes)
    check_param(weight, "weight", spec.scale, shape)
    check_param(bias, "bias", bool(spec.bias), shape)
    n = math.prod(shape)
    rows = row_spec(spec, n)
    route = _route(spec, kernel, x, rows, residual, gate, weight, bias, alpha)
    layout = _memory_format(x)
    moved = None if axes == trailing else axes
    operands = (x, residual, gate)
    if not all(t is None or t.is_contiguous() for t in operands) and layout is None:
        route = _contiguous(route)  # rows of any strides, copied as rows
    return Plan(route, n, spec.residual is not None, moved, layout)


def _contiguous(route: Route) -> Route:
    def contiguous(x: torch.Tensor, *operands: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return route(x.contiguous(), *(None if t is None else t.contiguous() for t in operands))

    return contiguous


class _Autocast:
    """A half input under an autocast that runs torch's norms in float32 (CUDA): x and the
    parameters cast to float32, then the float32 call's plan."""

    def __init__(self, spec: NormSpec, kernel: Kernel) -> None:
        self.plans = Plans(spec, kernel)

    def __call__(self, x: torch.Tensor, *operands: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual, gate, weight, bias, alpha = operands
        with torch.autocast(x.device.type, enabled=False):
            return self.plans(
                x.float(), residual, gate, None if weight is None else weight.float(),
                None if bias is None else bias.float(), alpha,
            )


def _distributed(spec: NormSpec, kernel: str, x: torch.Tensor, gate: torch.Tensor | None
                 ) -> Plan:
    """A DTensor: sharded on a normalized dim, its statistic reduced across the shards;
    otherwise normalized rank by rank, by the kernel asked for."""
    from normkit.torch import distributed

    if distributed.shards_normalized_axis(x, spec):
        if spec.residual is not None:
            raise ValueError(
                "add_norm: x is a DTensor sharded on a normalized dim; a residual is not "
                "supported there (add it and use normalize with a spec without a residual)"
            )

        def sharded(x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
                    weight: torch.Tensor | None, bias: torch.Tensor | None,
                    alpha: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            return distributed.normalize_sharded(x, spec, weight, bias), None

        return _Whole(sharded)
    if gate is not None:
        raise ValueError("normalize: a gated norm of a DTensor is not supported")
    local_plans = Plans(spec, kernel)  # type: ignore[arg-type]

    def by_rank(x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
                weight: torch.Tensor | None, bias: torch.Tensor | None,
                alpha: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        local = distributed.localize(x, spec, weight, bias, alpha=alpha, residual=residual)  # type: ignore[arg-type]
        y, h = local_plans(local.x, local.residual, None, local.weight, local.bias, local.alpha)
        return local.wrap(y), None if h is None else local.wrap(h)

    return _Whole(by_rank)


class _Whole(Plan):
    """A plan whose route takes the call's tensors as they are (DTensors)."""

    def __init__(self, route: Route) -> None:
        super().__init__(route, 0, False)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.route(x, residual, gate, weight, bias, alpha)


def _route(
    spec: NormSpec, kernel: str, x: torch.Tensor, rows: RowSpec, residual: torch.Tensor | None,
    gate: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
) -> Route:
    """The implementation on rows for this call: a kernel where one computes the spec, else the
    eager op sequence when recorded or asked for (``backward="autograd"``), else the composite
    Functions."""
    recorded = _recorded()
    chosen = "composite" if recorded else choose(kernel, x, spec, rows)
    out = output_dtype(x, spec, weight, bias, alpha)  # a default alpha takes no part
    kernel_dtypes = (torch.float32, x.dtype)
    graph = _needs_graph(x, residual, gate, weight, bias, alpha)
    if (
        chosen != "composite"
        and all(p is None or p.dtype in kernel_dtypes for p in (weight, bias))
        and (residual is None or residual.dtype == x.dtype)
        and (gate is None or gate.dtype == x.dtype)
    ):
        round_affine = (
            spec.gate == "after" and spec.cast == "before_scale" and x.dtype in HALF_DTYPES
            and _affine_dtype(x.dtype, spec, weight, bias) == x.dtype
        )
        if chosen == "cpu":
            return _CpuRoute(rows, x, round_affine, graph, strict=False)
        return _TritonRoute(rows, round_affine, graph)
    if (spec.backward == "autograd" or recorded) and spec.gate is None:
        return _EagerRoute(spec, rows, x.dtype, out)
    affine = _affine_dtype(x.dtype, spec, weight, bias)
    values = x.dtype if residual is None else _acc_dtype(x.dtype)  # a residual sum: the acc dtype
    fused = not recorded and not _shape_only(x) and fused_computes(
        rows, x.dtype, values, out, x.device.type, bias is not None)
    return _CompositeRoute(spec, rows, x.dtype, out, affine, eager=recorded, fused=fused)


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    if torch._C._are_functorch_transforms_active():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- the routes ------------------------------------------------------------------------------


class _CpuRoute:
    """normkit's CPU kernel (`normkit.torch.kernels.cpu`): the float32 effective scale and bias
    it reads, then one launch."""

    __slots__ = ("direct", "gated", "graph", "no_bias", "ones", "round_affine", "rows", "strict")

    def __init__(
        self, rows: RowSpec, x: torch.Tensor, round_affine: bool, graph: bool, strict: bool
    ) -> None:
        self.rows, self.round_affine, self.graph, self.strict = rows, round_affine, graph, strict
        self.gated = rows.gate != "" or rows.group != rows.n
        self.direct = not _shape_only(x)
        # the parameters a norm without them reads, shared by its calls where direct
        self.ones = cpu.effective_scale(None, rows, x) if self.direct else None
        self.no_bias = cpu.float32_bias(None, rows, x) if self.direct else None

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.rows
        if weight is None:
            g = self.ones if self.ones is not None else cpu.effective_scale(None, rows, x)
        else:
            g = weight if weight.dtype == torch.float32 else weight.to(torch.float32)
            if rows.scale_offset != 0:
                g = g + rows.scale_offset
        if bias is None:
            b = self.no_bias if self.no_bias is not None else cpu.float32_bias(None, rows, x)
        else:
            b = bias if bias.dtype == torch.float32 else bias.to(torch.float32)
        if self.gated or not self.direct:
            y = cpu.launch(x, gate, g, b, rows, self.round_affine, self.strict, self.direct,
                           self.graph)
        elif self.graph:
            y = apply_eager(cpu.CpuNormFunction, x, g, b, rows, self.strict, True)[0]
        else:
            y = cpu.forward(x, g, b, rows, self.strict)[0]
        return y, None


class _TritonRoute:
    """normkit's Triton kernels (`normkit.torch.kernels.triton`), the residual add fused."""

    __slots__ = ("graph", "launch", "round_affine", "rows")

    def __init__(self, rows: RowSpec, round_affine: bool, graph: bool) -> None:
        self.rows, self.round_affine, self.graph = rows, round_affine, graph
        self.launch = kernels.module("triton").launch

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, h = self.launch(x, residual, gate, weight, bias, self.rows, self.round_affine,
                           self.graph)
        return y, None if residual is None else h


class _EagerRoute:
    """The op sequence of eager model code (`normkit.torch._eager`), differentiated by
    autograd: ``backward="autograd"``, and graphs being recorded."""

    __slots__ = ("alpha_init", "dtype", "out", "rows")

    def __init__(self, spec: NormSpec, rows: RowSpec, dtype: torch.dtype, out: torch.dtype
                 ) -> None:
        self.rows, self.dtype, self.out = rows, dtype, out
        self.alpha_init = spec.alpha_init

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.rows
        values, h = x, None
        if residual is not None:
            values, h = _eager.add(x, residual, rows.residual)
        if alpha is None and rows.kind == "dyt":
            alpha = _default_alpha(x, self.alpha_init)
        return _eager.norm_rows(values, rows, weight, bias, alpha, self.dtype, self.out), h


class _CompositeRoute:
    """torch ops: `NormFunction` (`FusedNorm` where torch's fused kernels compute the spec, in
    plain eager code), `DytFunction` and the gated norms of `normkit.torch._gated`, the
    residual added in the compute dtype."""

    __slots__ = ("acc", "affine", "alpha_init", "dtype", "eager", "function", "out", "rows")

    def __init__(self, spec: NormSpec, rows: RowSpec, dtype: torch.dtype, out: torch.dtype,
                 affine: torch.dtype, eager: bool, fused: bool = False) -> None:
        self.rows, self.dtype, self.out, self.affine, self.eager = rows, dtype, out, affine, eager
        self.acc = _acc_dtype(dtype)
        self.alpha_init = spec.alpha_init
        self.function = FusedNorm if fused else NormFunction

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate: torch.Tensor | None,
        weight: torch.Tensor | None, bias: torch.Tensor | None, alpha: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, acc = self.rows, self.acc
        g = _effective_scale(weight, rows, acc)
        b = None if bias is None else bias.to(acc)
        values, h = x, None
        if residual is not None:
            values, h = _add(x, residual, rows.residual, acc)
        if rows.gate or rows.group != rows.n:
            y = _gated.norm_rows(values, gate, rows, g, b, self.dtype, self.affine, self.out,
                                 eager=self.eager)
        elif rows.kind == "dyt":
            if alpha is None:
                alpha = _default_alpha(x, self.alpha_init)
            y = apply(DytFunction, values, g, b, alpha, rows.before_scale, self.dtype, self.out)
        else:
            y = apply(self.function, values, g, b, rows, self.dtype, self.out)[0]
        return y, h


def _default_alpha(x: torch.Tensor, alpha_init: float | None) -> torch.Tensor:
    """DyT's alpha where none is given: ``spec.alpha_init`` in the compute dtype."""
    assert alpha_init is not None
    return torch.full((1,), alpha_init, dtype=_acc_dtype(x.dtype), device=x.device)


def _effective_scale(
    weight: torch.Tensor | None, rows: RowSpec, acc: torch.dtype
) -> torch.Tensor | None:
    """``scale_offset + w`` in ``acc``: added in float32 or wider (``offset_dtype="float32"``)
    or in w's dtype, then converted (``"param"``)."""
    if weight is None:
        return None
    if rows.offset_in_param:
        return (weight + rows.scale_offset).to(acc)
    g = weight.to(acc)
    return g + rows.scale_offset if rows.scale_offset != 0 else g


def _add(
    x: torch.Tensor, residual: torch.Tensor, rounding: str, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, h)``: the sum the norm reads (in ``acc``) and the h returned.

    The sum is taken in ``acc``; ``"rounded"`` normalizes it rounded to x's dtype, through
    `RoundThrough`, so that the gradients of y and h add in ``acc`` before the one rounding.
    """
    total = x.to(acc) + residual.to(acc)
    if rounding == "float32":
        return total, total
    h = total.to(x.dtype)
    if rounding == "rounded" and x.dtype != acc:
        return apply(RoundThrough, total, x.dtype), h
    return total, h
