"""The composite path (torch ops) on rows that torch's own kernels serve and on rows they do not:
LayerNorm (and on CUDA RMSNorm) through torch's fused kernels on rows preconditioned one by one
(`normkit.torch._autograd.FusedNorm`), bit for bit torch's layer on ordinary rows and the
reference's values on the others; every row's bits its own, in batches of any size."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import normkit.torch as nt
from normkit import NormSpec, reference, tolerances
from normkit.torch import _autograd
from normkit.torch._autograd import FusedNorm, apply
from normkit.torch._spec import row_spec
from normkit.torch.functional import normalize

FULL_PRECISION = [torch.float32, torch.float64]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _pair(n: int | tuple[int, ...], dtype: torch.dtype, affine: bool = True
          ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """normkit's LayerNorm on the composite path and torch's, with the same parameters."""
    ours = nt.LayerNorm(n, elementwise_affine=affine, kernel="composite", dtype=dtype)
    if affine:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
            ours.bias.normal_(generator=torch.Generator().manual_seed(4))
    own = torch.nn.LayerNorm(n, elementwise_affine=affine, dtype=dtype)
    own.load_state_dict(ours.state_dict())
    return ours, own


def _step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    xg = x.clone().requires_grad_()
    y = module(xg)
    y.backward(dy)
    assert xg.grad is not None
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads)
    return [y, xg.grad] + grads  # type: ignore[list-item]


@pytest.mark.parametrize("dtype", FULL_PRECISION, ids=str)
@pytest.mark.parametrize("shape, normalized", [((7, 3), 3), ((5, 64), 64), ((2, 3, 1000), 1000),
                                               ((4, 8, 16), (8, 16)), ((3, 4096), 4096)],
                         ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_the_composite_layer_norm_is_torchs_own_bit_for_bit(
    dtype: torch.dtype, shape: tuple[int, ...], normalized: int | tuple[int, ...], affine: bool
) -> None:
    """``nt.LayerNorm(kernel="composite")`` (``"auto"``'s choice for float64, without numba, and
    in a process that finds the CPU kernel uncompiled) on ordinary rows: y and the gradients of
    x, the weight and the bias have the bits of ``torch.nn.LayerNorm``'s."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    ours, own = _pair(normalized, dtype, affine)
    for got, want in zip(_step(ours, x, dy), _step(own, x, dy), strict=True):
        assert _bits(got) == _bits(want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_composite_half_layer_norm_has_torchs_forward_and_float32_parameter_gradients(
    dtype: torch.dtype,
) -> None:
    """Half inputs with float32 parameters: y is torch's bit for bit; the weight and bias
    gradients are summed in float32 (torch's kernels sum them in the half dtype, 3e-2 of their
    largest off on 512 rows), within the tolerance of the reference."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=gen).to(dtype)
    dy = torch.randn(512, 256, generator=gen).to(dtype)
    ours, own = _pair(256, torch.float32)
    got, want = _step(ours, x, dy), _step(own, x, dy)
    assert _bits(got[0]) == _bits(want[0])
    weight, bias = (p.detach().double().numpy() for p in ours.parameters())
    grads = reference.normalize_vjp(x.double().numpy(), dy.double().numpy(), ours.spec, weight,
                                    bias)
    name = str(dtype).removeprefix("torch.")
    tolerances.assert_close(got[1].double().numpy(), grads.dx, name, quantity="grad", what="dx")
    for what, tensor, expected in (("dweight", got[2], grads.dscale),
                                   ("dbias", got[3], grads.dbias)):
        tolerances.assert_close(tensor.double().numpy(), expected, "float32", quantity="grad",
                                what=what)


def _unusual_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows torch's fused kernels get wrong as they are, beside an ordinary one."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(9, n, generator=gen, dtype=torch.float64)
    # float64: rows from 2**300 (2e90) on are scaled; the reference's gradients hold to 1e103
    big, largest = (1e95, 1e102) if dtype == torch.float64 else (1e25, 3e37)
    rows = [
        base[0],                          # ordinary
        base[1] * big,                    # squares overflow
        base[2] * 1e-30,                  # tiny: eps decides it
        base[3] + 1e6,                    # a mean that dwarfs the spread
        base[4] * 1e24 + 1e30,            # both
        torch.full((n,), 3.0, dtype=torch.float64),   # constant: y = bias
        base[5].abs() + 2.0,              # one sign, range below its least value: shifted
        base[6] * largest,                # near the largest the reference computes
        base[7] * 1e-20 + 1e-18,          # tiny with a mean
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("eps", [1e-5, 2.0**-100])
def test_rows_torchs_kernels_get_wrong_get_the_references_values(
    dtype: torch.dtype, eps: float
) -> None:
    """LayerNorm on the composite path (torch's kernels on preconditioned rows), forward and
    backward, against the reference, row by row: squares that overflow, a large mean, tiny rows
    (eps 1e-5, and eps 2**-100, the least the preconditioning serves), constant rows, rows near
    the largest float; a cotangent of 1e29 on rows of 1e9, whose products dy x overflow
    float32."""
    n = 64
    x = _unusual_rows(n, dtype)
    spec = NormSpec("layer", eps=eps)
    weight = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    bias = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    if dtype != torch.float64:
        x = torch.cat([x, (torch.randn(1, n, generator=gen) * 1e9).to(dtype)])
        dy = torch.cat([dy, torch.randn(1, n, generator=gen, dtype=torch.float64) * 1e29])
    dy = dy.to(dtype)
    name = str(dtype).removeprefix("torch.")
    for i in range(x.shape[0]):
        row, cot = x[i:i + 1], dy[i:i + 1]
        xg = row.clone().requires_grad_()
        w = weight.to(pdtype, copy=True).requires_grad_()
        b = bias.to(pdtype, copy=True).requires_grad_()
        y = normalize(xg, spec, w, b, kernel="composite")
        assert type(y.grad_fn).__name__ == "FusedNormBackward"
        y.backward(cot)
        xs, dys = row.double().numpy(), cot.double().numpy()
        args = (spec, w.detach().double().numpy(), b.detach().double().numpy())
        tolerances.assert_close(y.detach().double().numpy(), reference.normalize(xs, *args),
                                name, what=f"y of row {i}")
        grads = reference.normalize_vjp(xs, dys, *args)
        assert xg.grad is not None and w.grad is not None and b.grad is not None
        tolerances.assert_close(xg.grad.double().numpy(), grads.dx, name, quantity="grad",
                                what=f"dx of row {i}")
        tolerances.assert_close(w.grad.double().numpy(), grads.dscale, str(pdtype)[6:],
                                quantity="grad", what=f"dweight of row {i}")


def test_nan_and_infinity_stay_in_their_rows() -> None:
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    ours, own = _pair(32, torch.float32)
    y = ours(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert _bits(y[[0, 3]]) == _bits(own(x[[0, 3]]))


@pytest.mark.parametrize("dtype", FULL_PRECISION, ids=str)
def test_the_cuda_rmsnorm_route_is_torchs_own_and_serves_every_row(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """On CUDA the composite RMSNorm (eps inside, no bias) runs torch's fused RMSNorm kernels
    on preconditioned rows; here on the CPU, with torch's decomposition of the backward kernel
    (which the CPU lacks) in its place: ordinary rows get torch's bits forward and backward
    (the backward's rows scaled by powers of two change none), the others the reference's."""
    from torch._decomp import decomposition_table

    backward = decomposition_table[torch.ops.aten._fused_rms_norm_backward.default]
    monkeypatch.setattr(_autograd, "_rms_norm_backward", backward)
    n = 64
    spec = NormSpec(eps=1e-6)
    rows = row_spec(spec, n)
    x = _unusual_rows(n, dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    g = torch.linspace(0.5, 1.5, n, dtype=dtype).requires_grad_()
    xg = x.clone().requires_grad_()
    y, r = apply(FusedNorm, xg, g, None, rows, dtype, dtype)
    y.backward(dy)
    assert xg.grad is not None and g.grad is not None
    want_y, want_r = torch.ops.aten._fused_rms_norm(x[:1], [n], g.detach(), 1e-6)
    assert _bits(y[:1]) == _bits(want_y)
    want_dx, _ = backward(dy[:1], x[:1], [n], want_r, g.detach(), [True, True])
    assert _bits(xg.grad[:1]) == _bits(want_dx)
    name = str(dtype).removeprefix("torch.")
    xs, dys = x.double().numpy(), dy.double().numpy()
    weight = g.detach().double().numpy()
    tolerances.assert_close(y.detach().double().numpy(), reference.normalize(xs, spec, weight),
                            name, what="y")
    grads = reference.normalize_vjp(xs, dys, spec, weight)
    tolerances.assert_close(xg.grad.double().numpy(), grads.dx, name, quantity="grad", what="dx")
    tolerances.assert_close(g.grad.double().numpy(), grads.dscale, name, quantity="grad",
                            what="dweight")


class _Passes(TorchDispatchMode):
    """The ops that read or write a tensor of ``size`` elements or more (a pass over the rows),
    by name; allocations and views are not passes."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.names = size, []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        name = str(func.overloadpacket.__name__)
        passes = not func.is_view and not name.startswith(("empty", "set_"))
        if passes and any(t.numel() >= self.size for t in tensors):
            self.names.append(name)
        return out


@pytest.mark.parametrize("dtype", FULL_PRECISION, ids=str)
def test_a_layer_norm_call_is_torchs_kernel_and_two_passes_more(dtype: torch.dtype) -> None:
    """By structure (nothing timed): a forward reads the rows for their largest and smallest
    values, writes the preconditioned rows (a multiplication and an addition by one value per
    row) and runs torch's LayerNorm kernel; a backward writes the rows scaled for it and runs
    torch's backward kernel, then scales dx. Every other op is on one value per row."""
    ours, _ = _pair(512, dtype)
    rows = 2**17 // 512  # large enough for amax and amin (aminmax below 2**16 elements)
    x = torch.randn(rows, 512, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, 512, dtype=dtype)
    ours(x).backward(dy)
    x.grad = None  # no accumulation into an earlier gradient
    with _Passes(x.numel()) as forward:
        y = ours(x)
    with _Passes(x.numel()) as backward:
        y.backward(dy)
    assert forward.names == ["amax", "amin", "mul", "add_", "native_layer_norm"]
    assert backward.names == ["addcmul", "mul_", "native_layer_norm_backward", "mul_"]


SPECS = [NormSpec("layer", eps=1e-5), NormSpec(eps=1e-6), NormSpec("layer", variance="fast"),
         NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside"),
         NormSpec("layer", eps=1e-5, eps_placement="outside")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.eps_placement}-{s.variance}")
def test_a_long_rows_bits_do_not_depend_on_the_batch(spec: NormSpec, dtype: torch.dtype) -> None:
    """Rows of 40000: torch's CPU sums (``sum``, ``mean``, ``vecdot``) split such a row among
    threads in some batch sizes and not others, which changed its bits between a batch of 16
    and the row alone; the composite path reads rows by torch's 2-norm, its LayerNorm kernels
    and blocked sums, the same in any batch."""
    n = 40000
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(16, n, generator=gen).to(dtype)
    dy = torch.randn(16, n, generator=gen).to(dtype)
    weight = torch.linspace(0.5, 1.5, n).to(dtype)

    def run(rows: torch.Tensor, cot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xg = rows.clone().requires_grad_()
        y = normalize(xg, spec, weight, kernel="composite")
        y.backward(cot)
        assert xg.grad is not None
        return y.detach(), xg.grad

    whole = run(x, dy)
    for i in (0, 7, 15):
        for got, want in zip(run(x[i:i + 1], dy[i:i + 1]), whole, strict=True):
            assert _bits(got) == _bits(want[i:i + 1]), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", FULL_PRECISION, ids=str)
@pytest.mark.parametrize("layer", ["RMSNorm", "LayerNorm"])
def test_the_composite_path_on_cuda_is_torchs_own_bit_for_bit(layer: str, dtype: torch.dtype
                                                              ) -> None:
    """On CUDA the composite RMSNorm and LayerNorm run torch's fused kernels (on rows
    preconditioned one by one): on ordinary rows y and every gradient are torch's layer's bits;
    a row of 1e25 beside them gets the reference's values."""
    n = 1024
    ours = getattr(nt, layer)(n, 1e-5, kernel="composite", device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    own = getattr(torch.nn, layer)(n, 1e-5, device="cuda", dtype=dtype)
    own.load_state_dict(ours.state_dict())
    x = torch.randn(64, n, device="cuda", dtype=dtype)
    dy = torch.randn(64, n, device="cuda", dtype=dtype)
    for got, want in zip(_step(ours, x, dy), _step(own, x, dy), strict=True):
        assert torch.equal(got, want)
    x[5] *= 1e25
    y = ours(x)
    spec = ours.spec_for(dtype)
    params = [p.detach().double().cpu().numpy() for p in ours.parameters()]
    want_y = reference.normalize(x.double().cpu().numpy(), spec, *params)
    tolerances.assert_close(y.detach().double().cpu().numpy(), want_y,
                            str(dtype).removeprefix("torch."), what="y")
    assert np.isfinite(want_y).all()
