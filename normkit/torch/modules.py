"""``torch.nn.Module`` layers for the normkit norms, state_dict-compatible with torch's own."""

from __future__ import annotations

import torch
from torch import nn

from normkit.spec import (
    DEFAULT_ALPHA_INIT,
    DEFAULT_EPS,
    EXTENDED_DEFAULTS,
    Backward,
    Cast,
    EpsPlacement,
    Gate,
    GateActivation,
    NormSpec,
    OffsetDtype,
    OutputDtype,
    Residual,
    Variance,
)
from normkit.torch import kernels
from normkit.torch._plan import Plans
from normkit.torch.functional import TORCH_LAYER_NORM_EPS, ShapeLike, as_shape, torch_eps
from normkit.torch.kernels import Kernel

__all__ = ["RMSNorm", "GatedRMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec"]


class _Norm(nn.Module):
    """A norm over the trailing ``normalized_shape``, with parameters ``weight`` and ``bias``
    (and DyT's ``alpha``, shape (1,))."""

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    alpha: nn.Parameter | None

    def __init__(
        self,
        normalized_shape: ShapeLike,
        spec: NormSpec,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        kernel: Kernel,
        torch_eps_rule: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = as_shape(normalized_shape)
        self._spec = spec
        # torch's eps=None: float64 inputs take float64's machine eps, the others float32's.
        self._torch_eps_rule = torch_eps_rule
        self._float64_spec = spec.replace(eps=torch_eps(torch.float64)) if torch_eps_rule else spec
        self._with_residual = spec.residual is not None
        self.kernel = kernel
        factory = {"device": device, "dtype": dtype}
        for name, present in (("weight", spec.scale), ("bias", spec.bias)):
            if present:
                setattr(self, name, nn.Parameter(torch.empty(self.normalized_shape, **factory)))
            else:
                self.register_parameter(name, None)
        if spec.kind == "dyt":
            self.alpha = nn.Parameter(torch.empty((1,), **factory))
        else:
            self.register_parameter("alpha", None)
        self.reset_parameters()

    @property
    def spec(self) -> NormSpec:
        """The `NormSpec` this module implements (for float64 inputs: `spec_for`)."""
        return self._spec

    @property
    def kernel(self) -> Kernel:
        """The ``kernel=`` choice (`normkit.torch.kernels`); setting it drops the plans made
        for the previous one."""
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: Kernel) -> None:
        self._kernel = kernels.check_kernel(kernel)
        self._make_plans()

    def _make_plans(self) -> None:
        """The module's plans (`normkit.torch._plan.Plans`), none built yet."""
        self._plans = Plans(self._spec, self._kernel, self._float64_spec, self.normalized_shape)

    def spec_for(self, dtype: torch.dtype) -> NormSpec:
        """The `NormSpec` applied to inputs of ``dtype``: `spec`, except that an `RMSNorm` built
        with ``eps=None`` (torch's rule) uses float64's machine eps for float64 inputs."""
        return self._float64_spec if dtype == torch.float64 else self._spec

    @property
    def eps(self) -> float | None:
        """eps as given (None: torch's rule, the machine eps of the compute dtype); None for
        DyT."""
        return None if self._torch_eps_rule else self._spec.eps

    @property
    def elementwise_affine(self) -> bool:
        """Whether there is a learned ``weight``."""
        return self._spec.scale

    def reset_parameters(self) -> None:
        """``weight = spec.scale_init`` (1, or 0 with scale_offset 1), ``bias = 0``,
        ``alpha = spec.alpha_init``."""
        if self.weight is not None:
            nn.init.constant_(self.weight, self._spec.scale_init)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.alpha is not None:
            assert self._spec.alpha_init is not None
            nn.init.constant_(self.alpha, self._spec.alpha_init)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x`` over its trailing ``normalized_shape``; in ``x``'s dtype, or the
        promoted one with ``output_dtype="promote"``.

        With ``residual`` (required exactly when the spec has one): ``(y, h)`` for
        ``h = x + residual`` (`normkit.torch.functional.add_norm`). With ``gate`` (required
        exactly when the spec has one): the gated norm of ``x`` and ``gate``.
        """
        if (residual is not None) != self._with_residual:
            self._residual_error()
        params = self._parameters  # Module.__getattr__ costs about 0.3 us an attribute
        if "weight" in params and "bias" in params and "alpha" in params:
            y, h = self._plans(x, residual, gate, params["weight"], params["bias"],
                               params["alpha"])
        else:  # a parametrization replaced one
            y, h = self._plans(x, residual, gate, *self._params())
        return y if h is None else (y, h)

    def _params(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(weight, bias, alpha)``, by attribute (a parametrization's too)."""
        return self.weight, self.bias, self.alpha

    def _residual_error(self) -> None:
        if not self._with_residual:
            raise ValueError(
                f"{type(self).__name__} was given a residual but its spec has "
                "residual=None: build it with residual='rounded', 'float32' or "
                "'float32_normalized' to add one"
            )
        raise ValueError(
            f"{type(self).__name__} has residual={self._spec.residual!r}: call it as "
            "module(x, residual), which returns (y, h)"
        )

    def __prepare_scriptable__(self) -> nn.Module:
        """What ``torch.jit.script`` compiles: the same parameters and the eager op sequence
        (`normkit.torch._scripted`)."""
        from normkit.torch._scripted import ScriptedNorm

        return ScriptedNorm(
            self.normalized_shape, self._spec, self._float64_spec, self.weight, self.bias,
            self.alpha,
        )

    def extra_repr(self) -> str:
        s = self._spec
        text = f"{self.normalized_shape}"
        if s.kind == "dyt":
            text += f", alpha_init={s.alpha_init:g}"
        else:
            text += f", eps={self.eps}"
        if s.p is not None:
            text += f", p={s.p:g}"
        text += f", elementwise_affine={s.scale}, bias={s.bias}"
        if s.eps_placement not in (None, "inside"):
            text += f", eps_placement={s.eps_placement!r}"
        if s.scale_offset:
            text += f", scale_offset={s.scale_offset:g}"
        text += f", cast={s.cast!r}"
        for name, default in EXTENDED_DEFAULTS.items():
            value = getattr(s, name)
            if value is not None and value != default:
                text += f", {name}={value!r}"
        return text if self.kernel == "auto" else text + f", kernel={self.kernel!r}"


class RMSNorm(_Norm):
    r"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (scale_offset + weight) + bias``.

    The mean runs over the trailing ``normalized_shape``. A drop-in for ``torch.nn.RMSNorm``:
    the same positional arguments, defaults, attributes and state_dict; normkit's options are
    keyword-only.

    Args:
      normalized_shape: an int or a sequence of ints, the trailing dims normalized.
      eps: added to the mean square (inside) or to the RMS (outside). Default None, torch's
        rule: the machine eps of the compute dtype (float32's, 1.19e-7, for float32, bfloat16
        and float16 inputs; float64's for float64), recorded in `spec` as float32's.
      elementwise_affine: whether there is a learned ``weight`` (initialized to
        ``1 - scale_offset``). Default True.
      device, dtype: of the parameters.
      eps_placement: ``"inside"`` (default) or ``"outside"`` the square root.
      scale_offset: constant added to ``weight``; 1.0 is Gemma's ``(1 + w)``. Default 0.0.
      bias: whether there is a learned ``bias`` (initialized to 0). Default False.
      cast: for float16/bfloat16 inputs, ``"after_scale"`` (affine in float32, one rounding;
        default) or ``"before_scale"`` (Llama: round the normalized value, then the affine).
      residual: None (default), or how ``h = x + residual`` is rounded (``"rounded"``,
        ``"float32"``, ``"float32_normalized"``); the module is then called as
        ``module(x, residual)`` and returns ``(y, h)``.
      offset_dtype: where ``scale_offset + weight`` is computed: ``"float32"`` (default) or
        ``"param"`` (in the weight's dtype, rounded there).
      output_dtype: ``"input"`` (default: y in x's dtype) or ``"promote"`` (the promoted dtype
        of x and the parameters).
      backward: ``"exact"`` (default: the exact gradient, rounded once) or ``"autograd"``
        (autograd through the eager op sequence: Hugging Face Llama's gradients, bit for bit).
      kernel: the implementation: ``"auto"`` (default: normkit's CPU kernel on the CPU, its
        Triton kernels for CUDA tensors, torch ops elsewhere), ``"composite"``, ``"cpu"``
        or ``"triton"`` (`normkit.torch.kernels`).

    Examples:
      >>> import torch
      >>> norm = RMSNorm(2)
      >>> [round(v, 4) for v in norm(torch.tensor([[3.0, 4.0]]))[0].tolist()]  # / sqrt(12.5)
      [0.8485, 1.1314]
      >>> norm(torch.ones(8, 2, dtype=torch.bfloat16)).dtype
      torch.bfloat16
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        kernel: Kernel = "auto",
    ) -> None:
        spec = NormSpec(
            kind="rms", eps=torch_eps(torch.float32) if eps is None else eps,
            eps_placement=eps_placement, axis=_trailing(normalized_shape),
            scale=elementwise_affine, scale_offset=scale_offset, bias=bias, cast=cast,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward,
        )
        super().__init__(normalized_shape, spec, device, dtype, kernel, eps is None)


class GatedRMSNorm(_Norm):
    r"""The gated RMSNorm of hybrid models: ``norm(x * a(gate))`` (``gate="before"``: Mamba2,
    Bamba, Zamba2) or ``norm(x) * a(gate)`` (``"after"``: Qwen3-Next, Kimi Linear), ``a`` SiLU
    or sigmoid, with ``norm`` the RMSNorm of `RMSNorm`, its statistic per group of
    ``group_size`` elements when given. Called as ``module(x, gate)``; without a gate, the
    plain (grouped) RMSNorm of ``x``, as Mamba2's module does.

    Args:
      normalized_shape: an int or a sequence of ints, the trailing dims normalized.
      eps: added to the mean square (inside) or to the RMS (outside). Default 1e-6.
      elementwise_affine, device, dtype, eps_placement, scale_offset, bias, cast, offset_dtype,
        output_dtype, kernel: as in `RMSNorm`. With ``gate="after"`` and
        ``cast="before_scale"``, the affine result is rounded to its dtype before the gate
        multiplies it in float32 (Qwen3-Next).
      gate: ``"before"`` or ``"after"`` the normalization. Default ``"after"``.
      gate_activation: ``"silu"`` (default) or ``"sigmoid"``.
      group_size: the statistic per group of this many consecutive elements (it must divide
        the normalized size), or None (default) for the whole row.

    Examples:
      >>> import torch
      >>> norm = GatedRMSNorm(2)
      >>> [round(v, 4) for v in norm(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2))[0].tolist()]
      [0.0, 0.0]
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = DEFAULT_EPS,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        gate: Gate = "after",
        gate_activation: GateActivation = "silu",
        group_size: int | None = None,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        kernel: Kernel = "auto",
    ) -> None:
        spec = NormSpec(
            kind="rms", eps=eps, eps_placement=eps_placement, axis=_trailing(normalized_shape),
            scale=elementwise_affine, scale_offset=scale_offset, bias=bias, cast=cast,
            offset_dtype=offset_dtype, output_dtype=output_dtype, gate=gate,
            gate_activation=gate_activation, group_size=group_size,
        )
        super().__init__(normalized_shape, spec, device, dtype, kernel)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The gated norm of ``x`` and ``gate`` over the trailing ``normalized_shape``; with
        ``gate=None``, the norm of ``x`` alone."""
        weight, bias, _ = self._params()
        plans = self._plans if gate is not None else self._ungated
        return plans(x, None, gate, weight, bias, None)[0]

    def _make_plans(self) -> None:
        super()._make_plans()
        ungated = self._spec.replace(gate=None, gate_activation=None)
        self._ungated = Plans(ungated, self._kernel, shape=self.normalized_shape)


class PartialRMSNorm(_Norm):
    r"""Partial RMSNorm (pRMSNorm): RMSNorm whose statistic reads the first ``k`` elements only.

    ``y = x / sqrt(mean(x[:k]^2) + eps) * (scale_offset + weight) + bias`` with
    ``k = max(1, floor(n * p))`` of the ``n`` elements of ``normalized_shape`` (row-major);
    the scaling applies to all ``n`` elements.

    Args:
      normalized_shape: an int or a sequence of ints, the trailing dims normalized.
      p: the fraction of the row the statistic reads, ``0 < p <= 1`` (the paper used 0.0625).
      eps: as in `RMSNorm`; default 1e-6 (torch has no partial RMSNorm whose default to follow).
      elementwise_affine, device, dtype, eps_placement, scale_offset, bias, cast, residual,
        offset_dtype, output_dtype, backward, kernel: as in `RMSNorm`.

    Examples:
      >>> import torch
      >>> norm = PartialRMSNorm(4, p=0.5)  # the statistic reads the first 2 of 4 elements
      >>> [round(v, 4) for v in norm(torch.tensor([[3.0, 4.0, 6.0, 8.0]]))[0].tolist()]
      [0.8485, 1.1314, 1.6971, 2.2627]
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        p: float,
        eps: float = DEFAULT_EPS,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        bias: bool = False,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        kernel: Kernel = "auto",
    ) -> None:
        spec = NormSpec(
            kind="partial_rms", p=p, eps=eps, eps_placement=eps_placement,
            axis=_trailing(normalized_shape), scale=elementwise_affine,
            scale_offset=scale_offset, bias=bias, cast=cast, residual=residual,
            offset_dtype=offset_dtype, output_dtype=output_dtype, backward=backward,
        )
        super().__init__(normalized_shape, spec, device, dtype, kernel)


class LayerNorm(_Norm):
    r"""LayerNorm: ``y = (x - mean(x)) / sqrt(var(x) + eps) * (scale_offset + weight) + bias``.

    Population variance over the trailing ``normalized_shape``. A drop-in for
    ``torch.nn.LayerNorm``: the same positional arguments, defaults, attributes and state_dict;
    normkit's options are keyword-only.

    Args:
      normalized_shape: an int or a sequence of ints, the trailing dims normalized.
      eps: added to the variance (inside) or to the standard deviation (outside). Default 1e-5.
      elementwise_affine: whether there are a learned ``weight`` and ``bias``. Default True.
      bias: whether there is a learned ``bias`` (initialized to 0) when ``elementwise_affine``.
        Default True. (`from_spec` builds the spec's other combinations.)
      device, dtype: of the parameters.
      variance: ``"two_pass"`` (default: ``mean((x - mean)^2)``) or ``"fast"``
        (``max(0, mean(x^2) - mean^2)`` in float32: Flax's and Keras' default).
      eps_placement, scale_offset, cast, residual, offset_dtype, output_dtype, backward, kernel:
        as in `RMSNorm`.

    Examples:
      >>> import torch
      >>> norm = LayerNorm(2)
      >>> [round(v, 4) for v in norm(torch.tensor([[1.0, 3.0]]))[0].tolist()]
      [-1.0, 1.0]
      >>> sorted(norm.state_dict())
      ['bias', 'weight']
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = TORCH_LAYER_NORM_EPS,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        eps_placement: EpsPlacement = "inside",
        scale_offset: float = 0.0,
        cast: Cast = "after_scale",
        variance: Variance = "two_pass",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        kernel: Kernel = "auto",
    ) -> None:
        spec = NormSpec(
            kind="layer", eps=eps, eps_placement=eps_placement, axis=_trailing(normalized_shape),
            scale=elementwise_affine, scale_offset=scale_offset, bias=bias and elementwise_affine,
            cast=cast,
            variance=variance, residual=residual, offset_dtype=offset_dtype,
            output_dtype=output_dtype, backward=backward,
        )
        super().__init__(normalized_shape, spec, device, dtype, kernel)


class DyT(_Norm):
    r"""Dynamic Tanh ("Transformers without Normalization"), the drop-in LayerNorm replacement:
    ``y = tanh(alpha * x) * (scale_offset + weight) + bias``.

    ``alpha`` is a learned scalar, a parameter of shape (1,) starting at ``alpha_init`` (the
    DyT paper's and Liger's checkpoints store ``ones(1) * alpha_init``). No statistic: no eps.
    For half inputs tanh is computed in float32.

    Args:
      normalized_shape: an int or a sequence of ints, the trailing dims ``weight`` and ``bias``
        span.
      alpha_init: the initial ``alpha``, positive. Default 0.5 (the paper's; x-transformers
        uses 1.0).
      elementwise_affine, scale_offset, bias (default True), cast, residual, offset_dtype,
        output_dtype, backward, device, dtype, kernel: as in `LayerNorm`; ``dtype`` is also
        alpha's.

    Examples:
      >>> import torch
      >>> dyt = DyT(2)
      >>> [round(v, 4) for v in dyt(torch.tensor([[1.0, -2.0]]))[0].tolist()]  # tanh(x / 2)
      [0.4621, -0.7616]
      >>> sorted(dyt.state_dict())
      ['alpha', 'bias', 'weight']
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        alpha_init: float = DEFAULT_ALPHA_INIT,
        *,
        elementwise_affine: bool = True,
        scale_offset: float = 0.0,
        bias: bool = True,
        cast: Cast = "after_scale",
        residual: Residual | None = None,
        offset_dtype: OffsetDtype = "float32",
        output_dtype: OutputDtype = "input",
        backward: Backward = "exact",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kernel: Kernel = "auto",
    ) -> None:
        spec = NormSpec(
            kind="dyt", alpha_init=alpha_init, axis=_trailing(normalized_shape),
            scale=elementwise_affine, scale_offset=scale_offset, bias=bias, cast=cast,
            residual=residual, offset_dtype=offset_dtype, output_dtype=output_dtype,
            backward=backward,
        )
        super().__init__(normalized_shape, spec, device, dtype, kernel)


def _trailing(normalized_shape: ShapeLike) -> tuple[int, ...]:
    return tuple(range(-len(as_shape(normalized_shape)), 0))


def from_spec(
    spec: NormSpec,
    normalized_shape: ShapeLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    kernel: Kernel = "auto",
) -> RMSNorm | GatedRMSNorm | PartialRMSNorm | LayerNorm | DyT:
    """The module (`RMSNorm`, `GatedRMSNorm`, `PartialRMSNorm`, `LayerNorm` or `DyT`)
    implementing ``spec``. A gated RMS spec gives a `GatedRMSNorm`; the other gated kinds take
    their gate as ``module(x, gate=z)``.

    Args:
      spec: the norm, any valid `NormSpec`; its ``axis`` must be the last
        ``len(normalized_shape)`` axes.
      normalized_shape: the trailing dims normalized, the shape of ``weight`` and ``bias``.
      device, dtype: of the parameters.
      kernel: the implementation (see `RMSNorm`). Default ``"auto"``.
    """
    shape = as_shape(normalized_shape)
    trailing = _trailing(shape)
    if tuple(sorted(spec.axis)) != trailing:
        raise ValueError(
            f"NormSpec.axis={spec.axis!r} does not fit normalized_shape {shape}: a module "
            f"normalizes the trailing axes {trailing} (use normkit.torch.functional.normalize "
            "for other axes)"
        )
    # The spec as it is: the constructors' torch-style arguments cannot express every spec
    # (LayerNorm drops the bias without elementwise_affine).
    classes: dict[str, type[RMSNorm | GatedRMSNorm | PartialRMSNorm | LayerNorm | DyT]] = {
        "rms": RMSNorm if spec.gate is None else GatedRMSNorm, "partial_rms": PartialRMSNorm,
        "layer": LayerNorm, "dyt": DyT,
    }
    module = classes[spec.kind].__new__(classes[spec.kind])
    _Norm.__init__(module, shape, spec.replace(axis=trailing), device, dtype, kernel)
    return module
