"""Meta and fake tensors (deferred initialization, FSDP, shape inference): every module,
function and kernel choice runs forward and backward without reading a value, and gives the
shapes, dtypes, devices and strides that torch's own layers give, outside ``torch.compile``."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import normkit.torch as nt  # noqa: E402
from normkit import NormSpec  # noqa: E402
from normkit.torch import functional as F  # noqa: E402

TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
KERNELS = ["auto", "composite", "cpu"] + (["triton"] if TRITON else [])
CONTEXTS = ["meta", "fake"]
DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def _context(name: str) -> Iterator[str]:
    """The device tensors are made on: "meta", or "cpu" under FakeTensorMode."""
    if name == "meta":
        yield "meta"
    else:
        with FakeTensorMode():
            yield "cpu"


def _check_like(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got.shape, got.dtype, got.device, got.stride()) == (
        want.shape, want.dtype, want.device, want.stride()
    ), what
    assert got.is_meta or isinstance(got, FakeTensor), what


MODULES = [
    pytest.param(lambda **kw: nt.RMSNorm((3, 8), **kw), torch.nn.RMSNorm, id="RMSNorm"),
    pytest.param(lambda **kw: nt.LayerNorm((3, 8), **kw), torch.nn.LayerNorm, id="LayerNorm"),
    pytest.param(lambda **kw: nt.PartialRMSNorm((3, 8), 0.25, **kw), torch.nn.RMSNorm,
                 id="PartialRMSNorm"),
]


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("build, torch_class", MODULES)
def test_modules_forward_and_backward(
    build: Callable[..., torch.nn.Module], torch_class: type, context: str, kernel: str,
    dtype: torch.dtype, placement: str,
) -> None:
    """The issue: ``RMSNorm(4, device="meta")(torch.ones(2, 4, device="meta"))`` raised
    "Tensor.item() cannot be called on meta tensors"."""
    with _context(context) as device:
        module = build(kernel=kernel, eps_placement=placement, device=device, dtype=dtype)
        theirs = torch_class((3, 8), device=device, dtype=dtype)
        x = torch.ones(2, 5, 3, 8, device=device, dtype=dtype, requires_grad=True)
        y, want = module(x), theirs(x)
        _check_like(y, want, "y")
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
        (want_dx,) = torch.autograd.grad(want, x, torch.ones_like(want))
        _check_like(dx, want_dx, "dx")
        y.sum().backward()
        assert module.weight.grad is not None
        _check_like(module.weight.grad, module.weight, "dweight")


@pytest.mark.parametrize("kernel", ["auto", "composite"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_dyt(context: str, kernel: str) -> None:
    with _context(context) as device:
        module = nt.DyT(8, kernel=kernel, device=device)
        x = torch.ones(4, 8, device=device, requires_grad=True)
        y = module(x)
        _check_like(y, torch.empty_like(x), "y")
        y.sum().backward()
        assert x.grad is not None and module.alpha.grad is not None
        _check_like(x.grad, x, "dx")
        _check_like(module.alpha.grad, module.alpha, "dalpha")


@pytest.mark.parametrize("rounding", ["rounded", "float32", "float32_normalized"])
@pytest.mark.parametrize("kernel", ["auto", "composite"] + (["triton"] if TRITON else []))
@pytest.mark.parametrize("context", CONTEXTS)
def test_residual_modules(context: str, kernel: str, rounding: str) -> None:
    with _context(context) as device:
        module = nt.RMSNorm(8, residual=rounding, kernel=kernel, device=device)
        x = torch.ones(4, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
        residual = torch.ones_like(x, requires_grad=True)
        y, h = module(x, residual)
        _check_like(y, torch.empty_like(x), "y")
        h_dtype = torch.float32 if rounding == "float32" else x.dtype
        _check_like(h, torch.empty_like(x, dtype=h_dtype), "h")
        (y.float().sum() + h.float().sum()).backward()
        assert x.grad is not None and residual.grad is not None
        _check_like(x.grad, x, "dx")
        _check_like(residual.grad, residual, "dresidual")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_functions(context: str, kernel: str) -> None:
    real = torch.ones(2, 6, 8, requires_grad=True)
    moved_y = F.normalize(real, NormSpec(axis=1), kernel="composite")
    (moved_dx,) = torch.autograd.grad(moved_y, real, torch.ones_like(moved_y))
    with _context(context) as device:
        x = torch.ones(2, 6, 8, device=device, requires_grad=True)
        w = torch.ones(8, device=device, requires_grad=True)
        b = torch.zeros(8, device=device, requires_grad=True)
        cases = [
            (F.rms_norm(x, 8, w, kernel=kernel), torch.nn.functional.rms_norm(x, [8], w)),
            (F.layer_norm(x, 8, w, b, kernel=kernel),
             torch.nn.functional.layer_norm(x, [8], w, b)),
            (F.partial_rms_norm(x, 8, 0.5, w, eps_placement="outside", kernel=kernel),
             torch.nn.functional.rms_norm(x, [8], w)),
            # a normalized axis that is not the last: moved to the end and back, as on data
            (F.normalize(x, NormSpec(axis=1), kernel=kernel),
             torch.empty_strided(x.shape, moved_y.stride(), device=device)),
        ]
        want_dx = [x, x, x, torch.empty_strided(x.shape, moved_dx.stride(), device=device)]
        for i, (y, want) in enumerate(cases):
            _check_like(y, want, f"case {i} y")
            (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
            _check_like(dx, want_dx[i], f"case {i} dx")
        (dw,) = torch.autograd.grad(F.layer_norm(x, 8, w, b, kernel=kernel).sum(), w)
        _check_like(dw, w, "dweight")


def test_the_issues_meta_module_returns_a_meta_tensor() -> None:
    y = nt.RMSNorm(4, device="meta")(torch.ones(2, 4, device="meta"))
    assert y.is_meta and y.shape == (2, 4) and y.dtype == torch.float32
