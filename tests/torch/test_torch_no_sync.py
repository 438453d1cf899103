"""No path reads a tensor's value back to the host: every kind, kernel path and dtype, forward
and forward+backward, recorded by a dispatch mode (nothing is timed). A read back is a host
synchronisation on a GPU (the host waits for the queue to drain) and is refused inside a CUDA
graph capture; on any device it makes the rows' computation depend on the whole batch.

The backward runs on the calling thread here (CPU tensors), so the mode sees its ops too. The
Triton kernels run in Triton's interpreter, through their custom ops (a dispatch mode traces).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from normkit import NormSpec  # noqa: E402
from normkit.torch import from_spec  # noqa: E402
from normkit.torch.functional import add_norm  # noqa: E402
from tests.helpers.dispatched import DispatchedOps  # noqa: E402

#: The aten ops that read a tensor's value on the host (``bool(t)``, ``t.item()``, boolean
#: indexing).
HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item"}

TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
NUMBA = importlib.util.find_spec("numba") is not None
KINDS = {
    "rms": NormSpec(eps=1e-6),
    "rms-outside-bias": NormSpec(eps=1e-5, eps_placement="outside", bias=True),
    "partial_rms": NormSpec("partial_rms", p=0.25, eps=1e-6),
    "layer": NormSpec("layer", eps=1e-5),
    "gated": NormSpec(eps=1e-6, gate="after", group_size=8),
}
PATHS = ["composite", "eager"] + (["cpu"] if NUMBA else []) + (["triton"] if TRITON else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _module(spec: NormSpec, path: str, n: int) -> torch.nn.Module:
    if path == "eager":  # the op sequence of model code, differentiated by autograd
        return from_spec(spec.replace(backward="autograd"), n, device=DEVICE)
    return from_spec(spec, n, kernel=path, device=DEVICE)  # type: ignore[arg-type]


def _host_reads(names: list[str]) -> list[str]:
    return [name for name in names if name in HOST_READS]


def _call(module: torch.nn.Module, x: torch.Tensor, gated: bool) -> torch.Tensor:
    if gated:
        return module(x, torch.randn_like(x))
    return module(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_no_path_reads_a_value_back(kind: str, path: str, dtype: torch.dtype) -> None:
    spec = KINDS[kind]
    if path == "eager" and spec.gate is not None:
        pytest.skip("backward='autograd' is not a field of the gated norms")
    if path in ("cpu", "triton") and dtype == torch.float64:
        pytest.skip("float64 is not a kernel case: it takes the composite path")
    n = 16
    module = _module(spec, path, n)
    gated = spec.gate is not None
    x = torch.randn(3, n, device=DEVICE, dtype=dtype)
    _call(module, x, gated)  # compiled and warm
    with torch.no_grad(), DispatchedOps() as forward:
        _call(module, x, gated)
    xg = x.clone().requires_grad_()
    with DispatchedOps() as training:
        y = _call(module, xg, gated)
        y.backward(torch.randn_like(y))
    assert xg.grad is not None
    assert _host_reads(forward.names) == [], forward.names
    assert _host_reads(training.names) == [], training.names


@pytest.mark.parametrize("rounding", ["rounded", "float32", "float32_normalized"])
@pytest.mark.parametrize("path", ["composite"] + (["triton"] if TRITON else []))
def test_the_residual_add_reads_no_value_back(path: str, rounding: str) -> None:
    spec = NormSpec(eps=1e-6, residual=rounding)  # type: ignore[arg-type]
    x = torch.randn(3, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    add_norm(x, residual, spec, kernel=path)  # type: ignore[arg-type]
    with DispatchedOps() as ops:
        y, h = add_norm(x, residual, spec, kernel=path)  # type: ignore[arg-type]
        (y.float().sum() + h.float().sum()).backward()
    assert _host_reads(ops.names) == [], ops.names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_dyt_reads_no_value_back(dtype: torch.dtype) -> None:
    module = from_spec(NormSpec("dyt"), 16, device=DEVICE)
    x = torch.randn(3, 16, device=DEVICE, dtype=dtype, requires_grad=True)
    with DispatchedOps() as ops:
        module(x).sum().backward()
    assert _host_reads(ops.names) == [], ops.names


# ---- a row's bits are its own (issue 48, defect 4) --------------------------------------------


def _unusual(kind: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` with row 200 made unusual: a NaN, a large mean, values whose squares overflow."""
    x = x.clone()
    if kind == "nan":
        x[200, 3] = float("nan")
    elif kind == "large mean":
        x[200] += 1e6
    else:
        x[200] *= 1e25
    return x


@pytest.mark.parametrize("unusual", ["nan", "large mean", "huge"])
@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "composite"),
                                           (torch.float64, "auto"),
                                           (torch.bfloat16, "composite")], ids=str)
@pytest.mark.parametrize("spec", [NormSpec("layer", eps=1e-5), NormSpec(eps=1e-6),
                                  NormSpec("partial_rms", p=0.25, eps=1e-5,
                                           eps_placement="outside")],
                         ids=lambda s: f"{s.kind}-{s.eps_placement}")
def test_a_rows_bits_do_not_depend_on_the_other_rows(
    spec: NormSpec, dtype: torch.dtype, kernel: str, unusual: str
) -> None:
    """The issue's case: x = randn(509, 64), x[200, 3] = nan, LayerNorm eps 1e-5 on the
    composite path: rows 0-63 differed between a batch of 64 and the batch of 509 (one unusual
    row sent the whole batch to the careful program). Every row's bits are now the same in a
    batch of 64, in the batch of 509 beside the unusual row, alone, and moved to another
    position; forward and the input gradient."""
    from normkit.torch.functional import normalize

    x = _unusual(unusual, torch.randn(509, 64, generator=torch.Generator().manual_seed(48)))
    x = x.to(dtype)
    weight = torch.linspace(0.5, 1.5, 64, dtype=dtype)
    dy = torch.randn(509, 64, generator=torch.Generator().manual_seed(49)).to(dtype)

    def run(rows: torch.Tensor, cotangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xg = rows.clone().requires_grad_()
        y = normalize(xg, spec, weight, kernel=kernel)  # type: ignore[arg-type]
        y.backward(cotangent)
        assert xg.grad is not None
        return y.detach(), xg.grad

    whole = run(x, dy)
    first = run(x[:64], dy[:64])
    for got, want in zip(first, whole, strict=True):
        assert got.view(-1).view(torch.int8).equal(want[:64].reshape(-1).view(torch.int8))
    alone = run(x[7:8], dy[7:8])
    moved = run(torch.cat([x[200:201], x[7:8]]), torch.cat([dy[200:201], dy[7:8]]))
    for got, other, want in zip(alone, moved, whole, strict=True):
        assert got[0].view(torch.int8).equal(want[7].view(torch.int8))
        assert other[1].view(torch.int8).equal(want[7].view(torch.int8))
    # the unusual row itself is the reference's (NaN where the reference has NaN)
    from normkit import reference, tolerances

    xn = x[200:201].double().numpy()
    want_y = reference.normalize(xn, spec, weight.double().numpy())
    got_y = whole[0][200:201].double().numpy()
    assert np.array_equal(np.isnan(got_y), np.isnan(want_y))
    finite = ~np.isnan(want_y)
    if finite.any():
        tolerances.assert_close(np.where(finite, got_y, 0), np.where(finite, want_y, 0),
                                str(dtype).removeprefix("torch."), cast=spec.cast, what="y")


# ---- a CUDA graph captures a forward and backward ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["triton", "composite", "auto"])
@pytest.mark.parametrize("spec", [NormSpec(eps=1e-6), NormSpec("layer", eps=1e-5, bias=True),
                                  NormSpec("partial_rms", p=0.25, eps_placement="outside"),
                                  NormSpec(gate="after", group_size=256)],
                         ids=lambda s: s.kind + ("-gated" if s.gate else ""))
def test_a_cuda_graph_of_a_forward_and_backward_replays_bit_for_bit(
    spec: NormSpec, kernel: str, dtype: torch.dtype
) -> None:
    """A layer's forward and backward captured in a CUDA graph (no value is read back, which a
    capture refuses) and replayed on new inputs give the bits an eager call gives on them: y
    and the gradients of x, the weight and the bias."""
    import copy

    torch.manual_seed(0)
    module = from_spec(spec, 1024, device="cuda", kernel=kernel)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    eager = copy.deepcopy(module)
    x = torch.randn(64, 1024, device="cuda", dtype=dtype, requires_grad=True)
    z = torch.randn(64, 1024, device="cuda", dtype=dtype) if spec.gate else None
    dy = torch.randn(64, 1024, device="cuda", dtype=dtype)

    def step(layer: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        y = layer(rows) if z is None else layer(rows, z)
        y.backward(dy)
        return y

    def clear(layer: torch.nn.Module) -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, plan) on a side stream, as capture asks
        for _ in range(3):
            clear(module)
            step(module, x)
    torch.cuda.current_stream().wait_stream(side)
    clear(module)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step(module, x)
    for seed in (1, 2):
        with torch.no_grad():
            x.copy_(torch.randn(64, 1024, device="cuda", generator=torch.Generator(
                "cuda").manual_seed(seed)).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [y.detach().clone(), x.grad.clone()] + [
            p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
        xe = x.detach().clone().requires_grad_(True)
        for p in eager.parameters():
            p.grad = None
        ye = step(eager, xe)
        want = [ye.detach(), xe.grad] + [p.grad for p in eager.parameters()]
        for got, expected in zip(replayed, want, strict=True):
            assert expected is not None and torch.equal(got, expected)
