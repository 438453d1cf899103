"""normkit.torch's own at the edges: second derivatives of the closed forms on degenerate rows
(autograd's double backward) and the eps its functions refuse for a dtype.

The values at the edges (overflowing statistics, large means, long rows, k = 1, NaN and
infinity, underflowing squares) are cases of tests/conformance/test_every_target.py, on every
target."""

from __future__ import annotations

import pytest
import torch

from normkit import NormSpec
from normkit.torch import functional as F

PLACEMENTS = ["inside", "outside"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("spec", [NormSpec("partial_rms", p=0.1), NormSpec("layer")], ids=str)
def test_double_backward_on_degenerate_rows(spec: NormSpec, placement: str) -> None:
    """The closed forms are differentiable: second derivatives pass gradgradcheck."""
    n = 8 if spec.kind == "partial_rms" else 2
    spec = spec.replace(eps_placement=placement, eps=1e-2)
    x = torch.linspace(-1.0, 2.0, 3 * n, dtype=torch.float64).reshape(3, n).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: F.normalize(t, spec), (x,))


@pytest.mark.parametrize(
    "eps, dtype",
    [
        (1e-46, torch.float32),
        (1e-39, torch.float32),
        (1e-39, torch.bfloat16),
        (1e-320, torch.float64),
    ],
)
def test_eps_out_of_range_for_the_dtype_is_refused(eps: float, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"out of range for a {name} input"):
        F.rms_norm(torch.zeros(2, 4, dtype=dtype), 4, eps=eps, eps_placement="outside")
