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

from collections.abc import Sequence

import torch

from normkit.spec import DEFAULT_EPS, Cast, EpsPlacement, NormSpec
from normkit.torch import kernels
from normkit.torch._cached import cached
from normkit.torch._checks import SUPPORTED_DTYPES, check_tensor
from normkit.torch._plan import Plans, check_trailing, output_dtype
from normkit.torch.kernels import Kernel

__all__ = [
    "normalize", "add_norm", "output_dtype", "rms_norm", "partial_rms_norm", "layer_norm",
    "torch_eps", "SUPPORTED_DTYPES", "TORCH_LAYER_NORM_EPS",
]

ShapeLike = int | Sequence[int]

#: ``torch.nn.LayerNorm``'s and ``F.layer_norm``'s default eps.
TORCH_LAYER_NORM_EPS = 1e-5


def torch_eps(dtype: torch.dtype) -> float:
    """torch's ``eps=None`` for RMSNorm: the machine eps of the compute dtype, float64's for
    float64 inputs and float32's (1.19e-7) for float32, bfloat16 and float16."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


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


def _plans(spec: NormSpec, kernel: Kernel) -> Plans:
    """The functions' plans for ``spec`` and ``kernel`` (ValueError for a kernel name that is
    not one, hashable or not)."""
    if not isinstance(kernel, str):
        kernels.check_kernel(kernel)
    return _plans_of(spec, kernel)


@cached(256)
def _plans_of(spec: NormSpec, kernel: Kernel) -> Plans:
    return Plans(spec, kernels.check_kernel(kernel))


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
    return _plans(spec, kernel)(x, None, gate, weight, bias, alpha)[0]


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
    check_tensor(residual, "residual")
    y, h = _plans(spec, kernel)(x, residual, None, weight, bias, alpha)
    assert h is not None
    return y, h


def _trailing_spec(x: torch.Tensor, normalized_shape: ShapeLike, **fields: object) -> NormSpec:
    shape = as_shape(normalized_shape)
    check_tensor(x, "input")
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
    check_tensor(input, "input")
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
