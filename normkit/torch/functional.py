"""The normkit norms as functions on torch tensors.

`normalize` applies any `NormSpec` without a residual (any axes, DyT included), `add_norm` one
with a residual (``h = x + residual; y = norm(h)``, returning ``(y, h)``); `rms_norm`,
`partial_rms_norm` and `layer_norm` take torch's arguments (``normalized_shape`` = trailing
dims) like ``torch.nn.functional``.

Dtype policy (that of `NormSpec`): float16 and bfloat16 inputs are normalized in float32 and cast
back once (``cast="after_scale"``) or before and after the affine step (``"before_scale"``);
float32 in float32, float64 in float64. Parameters of any float dtype are applied in that
compute dtype. The output has the input's dtype (``output_dtype="input"``) or the promoted
dtype of the input and the parameters (``"promote"``). ``backward="autograd"`` runs the eager
op sequence of model code (`normkit.torch._eager`) and lets autograd differentiate it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, NormSpec
from normkit.torch import _eager, _gated, kernels
from normkit.torch._autograd import (
    DytFunction,
    FusedNorm,
    GradInFormat,
    NormFunction,
    RoundThrough,
    _acc_dtype,
    _shape_only,
    apply,
)
from normkit.torch.kernels import Kernel, kernel_options

__all__ = [
    "normalize", "add_norm", "output_dtype", "rms_norm", "partial_rms_norm", "layer_norm",
    "torch_eps", "SUPPORTED_DTYPES", "TORCH_LAYER_NORM_EPS",
]

ShapeLike = int | Sequence[int]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64
)
_HALF = kernels.HALF_DTYPES
#: ``torch.nn.LayerNorm``'s and ``F.layer_norm``'s default eps.
TORCH_LAYER_NORM_EPS = 1e-5


def torch_eps(dtype: torch.dtype) -> float:
    """torch's ``eps=None`` for RMSNorm: the machine eps of the compute dtype, float64's for
    float64 inputs and float32's (1.19e-7) for float32, bfloat16 and float16."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what} has dtype {str(t.dtype).removeprefix('torch.')}; normkit.torch supports "
            f"{_dtype_names()}"
        )
    return t


def as_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints (an int means a 1-tuple)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    valid = all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    if not shape or not valid:
        raise ValueError(
            f"normalized_shape={normalized_shape!r} is invalid: expected a positive int or a "
            "non-empty sequence of positive ints"
        )
    return shape


def check_trailing(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> None:
    """ValueError unless ``x``'s trailing dims are ``normalized_shape``."""
    m = len(normalized_shape)
    if x.dim() < m or tuple(x.shape[x.dim() - m :]) != normalized_shape:
        raise ValueError(
            f"input of shape {tuple(x.shape)} does not end in normalized_shape "
            f"{normalized_shape}"
        )


def _param(
    value: torch.Tensor | None, name: str, present: bool, shape: tuple[int, ...]
) -> torch.Tensor | None:
    if value is None:
        return None
    if not present:
        field = "scale" if name == "weight" else name
        raise ValueError(f"{name} was given but the spec has {field}=False")
    _check_tensor(value, name)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    return value


def _refuse_alpha(alpha: torch.Tensor | None, spec: NormSpec) -> None:
    if alpha is not None and spec.kind != "dyt":
        raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")


def _check_alpha(
    alpha: torch.Tensor | None, spec: NormSpec, x: torch.Tensor
) -> torch.Tensor | None:
    """DyT's alpha: the given tensor (shape () or (1,)), or ``spec.alpha_init`` in the compute
    dtype; None for the normalization kinds, which take none."""
    _refuse_alpha(alpha, spec)
    if spec.kind != "dyt":
        return None
    if alpha is None:
        assert spec.alpha_init is not None
        return torch.full((1,), spec.alpha_init, dtype=_acc_dtype(x.dtype), device=x.device)
    _check_tensor(alpha, "alpha")
    if tuple(alpha.shape) not in ((), (1,)):
        raise ValueError(
            f"alpha has shape {tuple(alpha.shape)}, expected a scalar (shape () or (1,))"
        )
    return alpha


def _check_gate(x: torch.Tensor, gate: torch.Tensor | None, spec: NormSpec) -> None:
    """A gate exactly when ``spec.gate`` is set: a float tensor of x's shape and device."""
    if spec.gate is None:
        if gate is not None:
            raise ValueError(
                "normalize: a gate was given but the spec has gate=None; build the spec with "
                "gate='before' or 'after' to gate the norm"
            )
        return
    if gate is None:
        raise ValueError(
            f"normalize: the spec has gate={spec.gate!r}, which needs the gate tensor: "
            "normalize(x, spec, weight, bias, gate=z)"
        )
    _check_tensor(gate, "gate")
    if gate.shape != x.shape:
        raise ValueError(f"gate has shape {tuple(gate.shape)}, x has {tuple(x.shape)}")
    if gate.device != x.device:
        raise ValueError(f"gate is on {gate.device}, x on {x.device}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor, spec: NormSpec) -> None:
    """TypeError/ValueError unless ``residual`` fits ``x`` for ``spec.residual``: x's shape, and
    x's dtype (or the compute dtype, for ``"float32"``)."""
    _check_tensor(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}, expected the shape of x, "
            f"{tuple(x.shape)}"
        )
    allowed = {x.dtype}
    if spec.residual == "float32":
        allowed.add(_acc_dtype(x.dtype))
    if residual.dtype not in allowed:
        names = " or ".join(sorted(_name(d) for d in allowed))
        raise TypeError(
            f"residual has dtype {_name(residual.dtype)}; residual={spec.residual!r} with x of "
            f"dtype {_name(x.dtype)} needs {names}"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def normalize(
    x: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    gate: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """``spec`` applied to ``x``: ``y = y_hat(x) * (spec.scale_offset + weight) + bias``; with
    ``spec.gate``, ``y(x * a(gate))`` (``"before"``) or ``y(x) * a(gate)`` (``"after"``).

    Args:
      x: float16, bfloat16, float32 or float64 tensor, normalized over ``spec.axis``.
      spec: the norm, any `NormSpec` without a residual (those go to `add_norm`).
      weight: ``w``, of shape ``spec.param_shape(x.shape)``, or None for its initial value
        (an effective scale of 1). Only if ``spec.scale``.
      bias: ``b``, of the same shape, or None for zero. Only if ``spec.bias``.
      gate: ``z``, a float tensor of x's shape, required exactly when ``spec.gate`` is set.
      alpha: DyT's ``alpha`` (``kind="dyt"`` only), a tensor of shape () or (1,), or None for
        ``spec.alpha_init``.
      kernel: ``"auto"`` (default: normkit's CPU kernel on the CPU, its Triton kernels for
        CUDA tensors, torch ops elsewhere),
        ``"composite"`` (torch ops), ``"cpu"`` (the numba kernel) or ``"triton"``; see
        `normkit.torch.kernels`.

    Returns y in x's dtype, or with ``output_dtype="promote"`` in the promoted dtype of x and
    the parameters given.

    Raises TypeError for a non-float input, gate or parameter, ValueError for a bad axis, shape
    or kernel name, a gate given or missing against the spec, a ``group_size`` that does not
    divide the normalized size, a spec with a residual, or an eps out of the range of the
    compute dtype (`NormSpec.check_eps`), RuntimeError for a kernel that cannot run here, and
    ValueError for a kernel asked for by name that does not compute one of the spec's fields.
    """
    if spec.residual is not None:
        raise ValueError(
            f"normalize: the spec has residual={spec.residual!r}, which describes an add and "
            "norm; use add_norm(x, residual, spec, ...)"
        )
    _check_tensor(x, "x")
    _check_gate(x, gate, spec)
    spec.check_eps(_name(x.dtype))
    kernels.check_kernel(kernel)
    _refuse_alpha(alpha, spec)
    # A DTensor sharded on a normalized dim has its statistic reduced across the shards; any
    # other DTensor is normalized rank by rank, by the kernel asked for.
    if "torch.distributed.tensor" in sys.modules:  # only then can x be a DTensor
        from normkit.torch import distributed

        if distributed.shards_normalized_axis(x, spec):
            return distributed.normalize_sharded(x, spec, weight, bias)
        if isinstance(x, distributed.DTensor):
            if gate is not None:
                raise ValueError("normalize: a gated norm of a DTensor is not supported")
            local = distributed.localize(x, spec, weight, bias, alpha=alpha)
            y = normalize(local.x, spec, local.weight, local.bias, alpha=local.alpha,
                          kernel=kernel)
            return local.wrap(y)
    if _autocasts_to_float32(x, spec):
        x = x.float()
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
    return _along_axes(_Operands(x, None, gate, weight, bias, alpha), spec, kernel)[0]


#: The dispatch key of each device type's autocast.
_AUTOCAST_KEYS = {
    "cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"
}


def _autocasts_to_float32(x: torch.Tensor, spec: NormSpec) -> bool:
    """Whether torch's own op for ``spec`` (``layer_norm``, ``rms_norm`` for the RMS kinds)
    would run in float32 here: autocast is on for x's device and registers a (float32) kernel
    for it there, as on CUDA; not on the CPU, nor for DyT, which torch lacks."""
    key = _AUTOCAST_KEYS.get(x.device.type)  # none for meta tensors, which have no autocast
    if key is None or spec.kind == "dyt" or x.dtype not in _HALF:
        return False
    if not torch.is_autocast_enabled(x.device.type):
        return False
    op = "aten::layer_norm" if spec.kind == "layer" else "aten::rms_norm"
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    alpha: torch.Tensor | None = None,
    kernel: Kernel = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``, rounded as ``spec.residual`` says, and ``(normalize(h), h)``.

    ``"rounded"``: h in x's dtype, and that h normalized; ``"float32"``: h kept, normalized and
    returned in float32 (float64 for float64 x); ``"float32_normalized"``: the float32 sum
    normalized, h returned in x's dtype. The norm has the dtype policy of x's dtype. Gradients:
    ``dx = dresidual = dh + (the norm's input gradient)``, added before the one rounding.

    Args:
      x: float16, bfloat16, float32 or float64 tensor.
      residual: of x's shape and dtype (or, with ``residual="float32"``, float32).
      spec: a `NormSpec` with a residual; weight, bias, alpha, kernel: as in `normalize`
        (``kernel="triton"`` fuses the add; the CPU kernel has no residual).

    Raises what `normalize` raises, ValueError for a spec without a residual or a residual of
    another shape, TypeError for one of the wrong dtype.
    """
    if spec.residual is None:
        raise ValueError(
            "add_norm needs a spec with a residual rounding (residual='rounded', 'float32' or "
            "'float32_normalized'), got residual=None; use normalize"
        )
    _check_tensor(x, "x")
    _check_residual(x, residual, spec)
    spec.check_eps(_name(x.dtype))
    kernels.check_kernel(kernel)
    if "torch.distributed.tensor" in sys.modules:
        from normkit.torch import distributed

        if distributed.shards_normalized_axis(x, spec):
            raise ValueError(
                "add_norm: x is a DTensor sharded on a normalized dim; a residual is not "
                "supported there (add it and use normalize with a spec without a residual)"
            )
        if isinstance(x, distributed.DTensor):
            local = distributed.localize(x, spec, weight, bias, alpha=alpha, residual=residual)
            assert local.residual is not None
            y, h = add_norm(local.x, local.residual, spec, local.weight, local.bias,
                            alpha=local.alpha, kernel=kernel)
            return local.wrap(y), local.wrap(h)
    y, h = _along_axes(_Operands(x, residual, None, weight, bias, alpha), spec, kernel)
    assert h is not None
    return y, h


class _Operands(NamedTuple):
    """The tensors of one call: the input, its residual and gate (None where the spec has
    none), and the parameters (None: their initial values)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    gate: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    alpha: torch.Tensor | None


def _along_axes(
    ops: _Operands, spec: NormSpec, kernel: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_normalize_trailing` with ``spec.axis`` moved to the end and back; the outputs, and the
    gradients of x, residual and gate, in their memory format."""
    layout = _memory_format(ops.x)
    x = _grad_in_format(ops.x)
    residual, gate = _grad_in_format(ops.residual), _grad_in_format(ops.gate)
    assert x is not None
    axes = spec.resolve_axes(x.dim())
    trailing = tuple(range(x.dim() - len(axes), x.dim()))
    if axes != trailing:
        x, residual, gate = (None if t is None else t.movedim(axes, trailing)
                             for t in (x, residual, gate))
    assert x is not None
    y, h = _normalize_trailing(_Operands(x, residual, gate, *ops[3:]), spec, len(axes), kernel)
    if axes != trailing:
        y, h = y.movedim(trailing, axes), None if h is None else h.movedim(trailing, axes)
    if layout is None:
        return y, h
    return y.contiguous(memory_format=layout), None if h is None else h.contiguous(
        memory_format=layout
    )


def _grad_in_format(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, whose gradient keeps t's channels-last layout (`GradInFormat`) where it has one."""
    if t is None or not t.requires_grad:
        return t
    layout = _memory_format(t)
    return t if layout is None else apply(GradInFormat, t, layout)


def _memory_format(x: torch.Tensor) -> torch.memory_format | None:
    """x's channels-last layout, which the outputs keep as torch's ops do; None otherwise."""
    if x.is_contiguous():
        return None
    for layout, rank in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == rank and x.is_contiguous(memory_format=layout):
            return layout
    return None


def _effective_scale(
    weight: torch.Tensor | None, spec: NormSpec, acc: torch.dtype
) -> torch.Tensor | None:
    """``scale_offset + w`` in ``acc``: added in float32 or wider (``offset_dtype="float32"``)
    or in w's dtype, then converted (``"param"``)."""
    if weight is None:
        return None
    if spec.offset_dtype == "param":
        return (weight + spec.scale_offset).to(acc)
    g = weight.to(acc)
    return g + spec.scale_offset if spec.scale_offset != 0 else g


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


def _shaped(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t.reshape(shape)``, or t itself where it has that shape already (a reshape, even to
    the same shape, is an op: an autograd node when t requires grad)."""
    return t if t.shape == shape else t.reshape(shape)


def _normalize_trailing(
    ops: _Operands, spec: NormSpec, m: int, kernel: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, h)`` of ``spec`` normalizing the ``m`` trailing dims of ``ops.x`` (h None without a
    residual): a kernel where one computes the spec, else the eager op sequence when recorded
    or asked for (``backward="autograd"``), else `NormFunction` and its kin."""
    x, residual, gate, weight, bias, alpha = ops
    shape = tuple(x.shape[x.dim() - m :])
    n = math.prod(shape)
    k = spec.stat_size(n)
    group = n // spec.group_count(n)
    weight = _param(weight, "weight", spec.scale, shape)
    bias = _param(bias, "bias", spec.bias, shape)
    alpha_t = _check_alpha(alpha, spec, x)
    out = output_dtype(x, spec, weight, bias, alpha)  # a default alpha takes no part
    rows = _shaped(x, (x.numel() // n, n))
    res_rows = None if residual is None else _shaped(residual, rows.shape)
    w = None if weight is None else _shaped(weight, (n,))
    b = None if bias is None else _shaped(bias, (n,))
    recorded = _recorded()
    chosen = "composite" if recorded else kernels.resolve(kernel, x, spec, n)
    kernel_dtypes = (torch.float32, x.dtype)
    if (
        chosen != "composite"
        and all(p is None or p.dtype in kernel_dtypes for p in (weight, bias))
        and (res_rows is None or res_rows.dtype == x.dtype)
        and (gate is None or gate.dtype == x.dtype)
    ):
        round_affine = (
            spec.gate == "after" and spec.cast == "before_scale" and x.dtype in _HALF
            and _affine_dtype(x.dtype, spec, weight, bias) == x.dtype
        )
        options = kernel_options(spec, n, round_affine)
        chosen_module = kernels.module(chosen)
        if res_rows is None:
            gate_rows = None if gate is None else _shaped(gate, rows.shape).contiguous()
            y = chosen_module.norm_rows(rows.contiguous(), w, b, options, gate=gate_rows)
            return _shaped(y, x.shape), None
        y, h = chosen_module.add_norm_rows(rows.contiguous(), res_rows.contiguous(), w, b, options)
        return _shaped(y, x.shape), _shaped(h, x.shape)
    if (spec.backward == "autograd" or recorded) and spec.gate is None:
        values, h = rows, None
        if res_rows is not None:
            assert spec.residual is not None
            values, h = _eager.add(rows, res_rows, spec.residual)
        y = _eager.norm_rows(values, _eager.eager_spec(spec), k, w, b, alpha_t, x.dtype, out,
                             group)
        return y.reshape(x.shape), None if h is None else h.reshape(x.shape)
    acc = _acc_dtype(x.dtype)
    g = _effective_scale(w, spec, acc)
    b_acc = None if b is None else b.to(acc)
    if spec.gate is not None or spec.group_size is not None:
        values = rows
        h = None
        if res_rows is not None:
            values, h = _add(rows, res_rows, spec.residual, acc)
        affine = _affine_dtype(x.dtype, spec, weight, bias)
        y = _gated.norm_rows(
            values, None if gate is None else gate.reshape(rows.shape), spec, min(k, group),
            g, b_acc, x.dtype, affine, out, eager=recorded,
        )
        return y.reshape(x.shape), None if h is None else h.reshape(x.shape)
    h = None
    values = rows
    if res_rows is not None:
        values, h = _add(rows, res_rows, spec.residual, acc)
    if spec.kind == "dyt":
        assert alpha_t is not None
        y = apply(DytFunction, values, g, b_acc, alpha_t, spec.cast, x.dtype, out)
        return y.reshape(x.shape), None if h is None else h.reshape(x.shape)
    fused = _fused(x, spec, shape, g, b_acc, out) if res_rows is None else None
    if fused is not None:
        return fused, None
    y, _ = apply(
        NormFunction, values, g, b_acc, spec.kind, k, spec.eps, spec.eps_placement == "outside",
        spec.cast, x.dtype, out, spec.variance == "fast",
    )
    return y.reshape(x.shape), None if h is None else h.reshape(x.shape)


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


def _recorded() -> bool:
    """Whether the ops are being recorded into a graph of torch ops (``torch.jit.trace``, the
    ONNX exporters, ``torch.export``), which then holds the eager op sequence (`_eager`): the
    spec's forward without the rescaling of rows whose statistic overflows or underflows
    float32, and autograd's gradients."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def _fused(
    x: torch.Tensor,
    spec: NormSpec,
    shape: tuple[int, ...],
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    out: torch.dtype,
) -> torch.Tensor | None:
    """torch's fused kernels, where they compute the spec; else None: LayerNorm, and on CUDA
    RMSNorm without bias, through `FusedNorm`, where it serves every row.

    Not for half inputs: on CPU, F.layer_norm's weight and bias gradients for them are far from
    float32-accurate. Nor for rows of n <= 2 (LayerNorm) or 1 (RMSNorm), whose gradient
    `NormFunction` takes in closed form. A batch with a row the fused kernels do not serve
    (their statistics overflow or underflow, or a LayerNorm mean exceeds the spread) is
    recomputed by `NormFunction`; so is every traced call (meta and fake tensors too), whose
    rows cannot be checked.
    """
    if spec.eps_placement != "inside" or x.dtype in _HALF or out != x.dtype:
        return None
    assert spec.eps is not None
    g_shaped = None if g is None else g.reshape(shape)
    b_shaped = None if b is None else b.reshape(shape)
    n = math.prod(shape)
    layer = spec.kind == "layer" and spec.variance == "two_pass" and n > 2
    rms = spec.kind == "rms" and b is None and x.device.type == "cuda" and n > 1
    if (layer or rms) and not _shape_only(x):
        y, refused, *_ = apply(FusedNorm, x, spec.kind, list(shape), g_shaped, b_shaped, spec.eps)
        if not bool(refused.any()):
            return y
    return None


def _trailing_spec(x: torch.Tensor, normalized_shape: ShapeLike, **fields: object) -> NormSpec:
    shape = as_shape(normalized_shape)
    _check_tensor(x, "input")
    check_trailing(x, shape)
    return NormSpec(axis=tuple(range(-len(shape), 0)), **fields)  # type: ignore[arg-type]


def rms_norm(
    input: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    bias: torch.Tensor | None = None,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape``: ``x / sqrt(mean(x^2) + eps) * w + b``.

    The positional arguments and defaults are ``torch.nn.functional.rms_norm``'s.

    Args:
      input: float16, bfloat16, float32 or float64 tensor whose trailing dims are
        ``normalized_shape``.
      normalized_shape: an int or a sequence of ints, the normalized trailing dims.
      weight: ``w`` of shape ``normalized_shape``, or None for no scale.
      eps: added to the mean square (``"inside"``) or to the RMS (``"outside"``). Default None,
        torch's rule (`torch_eps`).
      bias: ``b`` of shape ``normalized_shape``, or None for no bias.
      eps_placement: ``"inside"`` or ``"outside"`` the square root.
      scale_offset: added to ``w`` (1.0 for Gemma's ``1 + w``); needs ``weight``.
      cast: half-precision cast order, ``"after_scale"`` or ``"before_scale"`` (Llama).
      kernel: which implementation computes it (see `normalize`). Default ``"auto"``.
    """
    _check_tensor(input, "input")
    spec = _trailing_spec(
        input, normalized_shape, kind="rms",
        eps=torch_eps(input.dtype) if eps is None else eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(input, spec, weight, bias, kernel=kernel)


def partial_rms_norm(
    input: torch.Tensor,
    normalized_shape: ShapeLike,
    p: float,
    weight: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    *,
    bias: torch.Tensor | None = None,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Partial RMSNorm: `rms_norm` whose statistic reads only the first ``k`` elements of a row.

    ``k = max(1, floor(n * p))`` of the ``n`` elements of ``normalized_shape`` (row-major); the
    scaling still applies to all ``n``. ``p`` is the fraction, ``0 < p <= 1``; eps defaults to
    1e-6; the other arguments are those of `rms_norm`.
    """
    spec = _trailing_spec(
        input, normalized_shape, kind="partial_rms", p=p, eps=eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(input, spec, weight, bias, kernel=kernel)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = TORCH_LAYER_NORM_EPS,
    *,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """LayerNorm: ``(x - mean(x)) / sqrt(var(x) + eps) * w + b`` (population variance).

    The positional arguments and defaults are ``torch.nn.functional.layer_norm``'s (eps 1e-5);
    the keyword options are those of `rms_norm`.
    """
    spec = _trailing_spec(
        input, normalized_shape, kind="layer", eps=eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(input, spec, weight, bias, kernel=kernel)
