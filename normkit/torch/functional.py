"""The normkit norms as functions on torch tensors.

`normalize` applies any `NormSpec` (any axes); `rms_norm`, `partial_rms_norm` and `layer_norm`
take torch's arguments (``normalized_shape`` = trailing dims) like ``torch.nn.functional``.

Dtype policy (that of `NormSpec`): float16 and bfloat16 inputs are normalized in float32 and cast
back once (``cast="after_scale"``) or before and after the affine step (``"before_scale"``);
float32 in float32, float64 in float64. Parameters of any float dtype are applied in that
compute dtype. The output always has the input's dtype.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, NormSpec
from normkit.torch import kernels
from normkit.torch._autograd import NormFunction, _acc_dtype, _out_of_range, _traced
from normkit.torch.kernels import Kernel

__all__ = ["normalize", "rms_norm", "partial_rms_norm", "layer_norm", "SUPPORTED_DTYPES"]

ShapeLike = int | Sequence[int]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64
)
_HALF = (torch.float16, torch.bfloat16)


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


def normalize(
    x: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """``spec`` applied to ``x``: ``y = y_hat(x) * (spec.scale_offset + weight) + bias``.

    Args:
      x: float16, bfloat16, float32 or float64 tensor, normalized over ``spec.axis``.
      spec: the norm (its kind, eps, eps placement, p, axes, offset and cast order).
      weight: ``w``, of shape ``spec.param_shape(x.shape)``, or None for its initial value
        (an effective scale of 1). Only if ``spec.scale``.
      bias: ``b``, of the same shape, or None for zero. Only if ``spec.bias``.
      kernel: ``"auto"`` (default: normkit's CPU kernel on the CPU, torch ops elsewhere),
        ``"composite"`` (torch ops), ``"cpu"`` (the numba kernel) or ``"triton"``; see
        `normkit.torch.kernels`.

    Raises TypeError for a non-float input or parameter, ValueError for a bad axis, shape or
    kernel name, or an eps out of the range of the compute dtype (`NormSpec.check_eps`),
    RuntimeError for a kernel that cannot run here.
    """
    spec.require_defaults("normkit.torch")
    _check_tensor(x, "x")
    spec.check_eps(str(x.dtype).removeprefix("torch."))
    kernels.check_kernel(kernel)
    # A DTensor sharded on a normalized dim has its statistic reduced across the shards; any
    # other DTensor is normalized rank by rank, by the kernel asked for.
    if "torch.distributed.tensor" in sys.modules:  # only then can x be a DTensor
        from normkit.torch import distributed

        if distributed.shards_normalized_axis(x, spec):
            return distributed.normalize_sharded(x, spec, weight, bias)
        if isinstance(x, distributed.DTensor):
            local = distributed.localize(x, spec, weight, bias)
            return local.wrap(normalize(local.x, spec, local.weight, local.bias, kernel=kernel))
    axes = spec.resolve_axes(x.dim())
    trailing = tuple(range(x.dim() - len(axes), x.dim()))
    if axes != trailing:
        moved = x.movedim(axes, trailing)
        y = _normalize_trailing(moved, spec, len(axes), weight, bias, kernel)
        return y.movedim(trailing, axes)
    return _normalize_trailing(x, spec, len(axes), weight, bias, kernel)


def _normalize_trailing(
    x: torch.Tensor,
    spec: NormSpec,
    m: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kernel: str,
) -> torch.Tensor:
    shape = tuple(x.shape[x.dim() - m :])
    n = math.prod(shape)
    k = spec.stat_size(n)
    weight = _param(weight, "weight", spec.scale, shape)
    bias = _param(bias, "bias", spec.bias, shape)
    chosen = kernels.resolve(kernel, x, spec.kind, n)
    kernel_dtypes = (torch.float32, x.dtype)
    if chosen != "composite" and all(
        p is None or p.dtype in kernel_dtypes for p in (weight, bias)
    ):
        y = kernels.module(chosen).norm_rows(
            x.reshape(x.numel() // n, n),
            None if weight is None else weight.reshape(n),
            None if bias is None else bias.reshape(n),
            kind=spec.kind, k=k, eps=spec.eps, outside=spec.eps_placement == "outside",
            scale_offset=spec.scale_offset, cast=spec.cast,
        )
        return y.reshape(x.shape)
    acc = _acc_dtype(x.dtype)
    g = None if weight is None else weight.to(acc)
    if g is not None and spec.scale_offset != 0:
        g = g + spec.scale_offset
    b = None if bias is None else bias.to(acc)
    inside = spec.eps_placement == "inside"
    # torch's fused kernels, where they compute the spec. Not for half inputs: on CPU,
    # F.layer_norm's weight and bias gradients for them are far from float32-accurate.
    # Nor for rows of n <= 2, whose gradient `NormFunction` takes in closed form. F.layer_norm
    # does not correct its mean (float32 rows of mean 1e6 and spread 1 were off by 1e-2) nor
    # rescale overflowing rows: where a row's |mean| exceeds its spread, or its r(s) is out of
    # range, the batch is recomputed by `NormFunction` (in eager code; traced code always is).
    if inside and x.dtype not in _HALF:
        if spec.kind == "layer" and n > 2 and not _traced():
            y, mean, rstd = torch.native_layer_norm(x, shape, g, b, spec.eps)
            if not bool((_out_of_range(rstd) | (mean.abs() * rstd > 1)).any()):
                return y
        if spec.kind == "rms" and b is None and x.device.type == "cuda":
            return F.rms_norm(x, shape, g, spec.eps)
    rows = x.reshape(x.numel() // n, n)
    y, _ = NormFunction.apply(
        rows,
        None if g is None else g.reshape(n),
        None if b is None else b.reshape(n),
        spec.kind,
        k,
        spec.eps,
        not inside,
        spec.cast,
    )
    return y.reshape(x.shape)


def _trailing_spec(x: torch.Tensor, normalized_shape: ShapeLike, **fields: object) -> NormSpec:
    shape = as_shape(normalized_shape)
    _check_tensor(x, "x")
    check_trailing(x, shape)
    return NormSpec(axis=tuple(range(-len(shape), 0)), **fields)  # type: ignore[arg-type]


def rms_norm(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    *,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape``: ``x / sqrt(mean(x^2) + eps) * w + b``.

    Args:
      x: float16, bfloat16, float32 or float64 tensor whose trailing dims are ``normalized_shape``.
      normalized_shape: an int or a sequence of ints, the normalized trailing dims.
      weight: ``w`` of shape ``normalized_shape``, or None for no scale.
      bias: ``b`` of shape ``normalized_shape``, or None for no bias.
      eps: added to the mean square (``"inside"``) or to the RMS (``"outside"``). Default 1e-6.
      eps_placement: ``"inside"`` or ``"outside"`` the square root.
      scale_offset: added to ``w`` (1.0 for Gemma's ``1 + w``); needs ``weight``.
      cast: half-precision cast order, ``"after_scale"`` or ``"before_scale"`` (Llama).
      kernel: which implementation computes it (see `normalize`). Default ``"auto"``.
    """
    spec = _trailing_spec(
        x, normalized_shape, kind="rms", eps=eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, weight, bias, kernel=kernel)


def partial_rms_norm(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    p: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    *,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Partial RMSNorm: `rms_norm` whose statistic reads only the first ``k`` elements of a row.

    ``k = max(1, floor(n * p))`` of the ``n`` elements of ``normalized_shape`` (row-major); the
    scaling still applies to all ``n``. ``p`` is the fraction, ``0 < p <= 1``; the other
    arguments are those of `rms_norm`.
    """
    spec = _trailing_spec(
        x, normalized_shape, kind="partial_rms", p=p, eps=eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, weight, bias, kernel=kernel)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    *,
    eps_placement: EpsPlacement = "inside",
    scale_offset: float = 0.0,
    cast: Cast = "after_scale",
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """LayerNorm: ``(x - mean(x)) / sqrt(var(x) + eps) * w + b`` (population variance).

    The arguments are those of `rms_norm`; the default eps is 1e-6 (torch's is 1e-5).
    """
    spec = _trailing_spec(
        x, normalized_shape, kind="layer", eps=eps, eps_placement=eps_placement,
        scale=weight is not None, scale_offset=scale_offset, bias=bias is not None, cast=cast,
    )
    return normalize(x, spec, weight, bias, kernel=kernel)
