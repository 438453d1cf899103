"""Channels-last inputs: outputs and the gradients of x and residual keep the input's memory
format, as torch's own layers' do (torch's ``test_memory_format``), for every kernel; the values
are the reference's."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import normkit.torch as nt  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.torch import functional as F  # noqa: E402

to_numpy = TorchBridge().to_numpy

TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
KERNELS = ["auto", "composite", "cpu"] + (["triton"] if TRITON else [])
LAYOUTS = [
    pytest.param(torch.channels_last, (4, 2, 2, 5), id="channels_last"),
    pytest.param(torch.channels_last_3d, (2, 3, 2, 2, 5), id="channels_last_3d"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _input(
    shape: tuple[int, ...], layout: torch.memory_format, seed: int, device: str = DEVICE
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device).to(memory_format=layout)
    assert x.is_contiguous(memory_format=layout) and not x.is_contiguous()
    return x.requires_grad_()


def _cotangent(
    shape: tuple[int, ...], layout: torch.memory_format, start: float, device: str = DEVICE
) -> torch.Tensor:
    """A cotangent in ``layout``, as ``torch.rand_like(y)`` makes for a channels-last ``y``."""
    values = torch.linspace(start, 1.0, math.prod(shape), device=device).reshape(shape)
    return values.contiguous(memory_format=layout)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout, shape", LAYOUTS)
@pytest.mark.parametrize("module_class", [nt.RMSNorm, nt.LayerNorm], ids=lambda c: c.__name__)
def test_input_gradient_keeps_the_memory_format(
    module_class: type, layout: torch.memory_format, shape: tuple[int, ...], kernel: str
) -> None:
    """``torch.autograd.grad`` (no leaf's layout contract): dx in x's layout, as
    ``torch.nn.RMSNorm`` gives it (the issue: (20, 1, 10, 2), not (20, 10, 5, 1)).
    ``torch.nn.LayerNorm``'s fused backward returns a contiguous dx; normkit's LayerNorm keeps
    x's layout, as RMSNorm does. kernel='cpu' (numba) runs on CPU tensors, on a GPU machine too."""
    device = "cpu" if kernel == "cpu" else DEVICE
    normalized = shape[-3:]
    module = module_class(normalized, kernel=kernel).to(device)
    x = _input(shape, layout, seed=0, device=device)
    dy = _cotangent(shape, layout, -1.0, device=device)
    (dx,) = torch.autograd.grad(module(x), x, dy)
    (torch_dx,) = torch.autograd.grad(torch.nn.RMSNorm(normalized).to(device)(x), x, dy)
    assert dx.stride() == torch_dx.stride() == x.stride()
    weight = to_numpy(module.weight.detach())
    bias = None if module.bias is None else to_numpy(module.bias.detach())
    expected = reference.normalize_vjp(to_numpy(x.detach()), to_numpy(dy), module.spec, weight,
                                       bias)
    tolerances.assert_close(to_numpy(dx), expected[0], quantity="grad", what=f"{kernel} dx")


@pytest.mark.parametrize("kernel", ["auto", "composite"] + (["triton"] if TRITON else []))
@pytest.mark.parametrize("layout, shape", LAYOUTS)
def test_residual_gradients_keep_the_memory_format(
    layout: torch.memory_format, shape: tuple[int, ...], kernel: str
) -> None:
    spec = NormSpec(axis=(-3, -2, -1), residual="rounded")
    x, residual = _input(shape, layout, seed=1), _input(shape, layout, seed=2)
    y, h = F.add_norm(x, residual, spec, kernel=kernel)
    dy, dh = _cotangent(shape, layout, -1.0), _cotangent(shape, layout, 2.0)
    dx, dresidual = torch.autograd.grad([y, h], [x, residual], [dy, dh])
    assert y.is_contiguous(memory_format=layout) and h.is_contiguous(memory_format=layout)
    want = reference.add_normalize_vjp(*(to_numpy(t.detach()) for t in (x, residual, dy, dh)),
                                       spec)
    for name, grad, expected in (("dx", dx, want[0]), ("dresidual", dresidual, want[1])):
        assert grad.stride() == x.stride(), (name, grad.stride())
        tolerances.assert_close(to_numpy(grad), expected, quantity="grad", what=name)
