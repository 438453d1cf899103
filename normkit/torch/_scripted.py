"""What ``torch.jit.script`` compiles in place of a normkit module.

TorchScript cannot type a `NormSpec`, so `ScriptedNorm` holds the module's parameters (the same
``Parameter`` objects, so the state_dict keys and values are the module's) and its spec as an
`normkit.torch._spec.RowSpec`, and runs the eager op sequence of ``backward="autograd"``
(`normkit.torch._eager`): the spec's forward, without the rescaling of rows whose statistic
overflows or underflows float32, and autograd's gradients, as in a traced graph.
"""

import math

import torch
from torch import nn

from normkit.spec import NormSpec
from normkit.torch._eager import norm_rows
from normkit.torch._spec import RowSpec, row_spec


class ScriptedNorm(nn.Module):
    """A normkit module without a residual, as TorchScript compiles it."""

    spec: RowSpec
    float64_spec: RowSpec
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    alpha: torch.Tensor | None

    def __init__(
        self,
        normalized_shape: tuple[int, ...],
        spec: NormSpec,
        float64_spec: NormSpec,
        weight: nn.Parameter | None,
        bias: nn.Parameter | None,
        alpha: nn.Parameter | None,
    ) -> None:
        super().__init__()
        if spec.residual is not None:
            raise ValueError(
                f"torch.jit.script: a normkit module with residual={spec.residual!r} returns "
                "(y, h), which TorchScript cannot type with the plain norm's y; trace it with "
                "torch.jit.trace instead"
            )
        if spec.gate is not None:
            raise ValueError(
                f"torch.jit.script: a normkit module with gate={spec.gate!r} takes a second "
                "input; trace it with torch.jit.trace instead"
            )
        self.normalized_shape = list(normalized_shape)
        self.n = math.prod(normalized_shape)
        self.spec = row_spec(spec, self.n)
        self.float64_spec = row_spec(float64_spec, self.n)
        self.promote = spec.output_dtype == "promote"
        for name, value in (("weight", weight), ("bias", bias), ("alpha", alpha)):
            self.register_parameter(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = len(self.normalized_shape)
        if x.dim() < m or list(x.shape[x.dim() - m :]) != self.normalized_shape:
            raise ValueError("input does not end in the module's normalized_shape")
        weight, bias, alpha = self.weight, self.bias, self.alpha  # locals: TorchScript refines
        out = x.dtype
        if self.promote:
            if weight is not None:
                out = torch.promote_types(out, weight.dtype)
            if bias is not None:
                out = torch.promote_types(out, bias.dtype)
            if alpha is not None:
                out = torch.promote_types(out, alpha.dtype)
        spec = self.float64_spec if x.dtype == torch.float64 else self.spec
        y = norm_rows(x.reshape(-1, self.n), spec, weight, bias, alpha, x.dtype, out)
        return y.reshape(x.shape)
