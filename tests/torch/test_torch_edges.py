"""normkit.torch at the edges of float32: overflowing statistics, large means, long rows, k = 1,
eps against the dtype; forward and gradients against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normkit import NormSpec, reference, tolerances
from normkit.torch import functional as F

KINDS = [
    pytest.param({"kind": "rms"}, id="rms"),
    pytest.param({"kind": "partial_rms", "p": 0.5}, id="partial"),
    pytest.param({"kind": "layer"}, id="layer"),
]
PLACEMENTS = ["inside", "outside"]


def check(spec: NormSpec, x: np.ndarray, dy: np.ndarray, what: str) -> None:
    """Forward (with and without autograd) and gradients against the reference."""
    xt = torch.tensor(x, requires_grad=True)
    w = torch.linspace(0.5, 1.5, spec.param_shape(x.shape)[0], dtype=xt.dtype, requires_grad=True)
    w_np = w.detach().numpy()
    y = F.normalize(xt, spec, w)
    y.backward(torch.tensor(dy))
    with torch.no_grad():
        y_eager = F.normalize(xt.detach(), spec, w.detach())
    expected = reference.normalize(x, spec, w_np)
    dx, dw, _ = reference.normalize_vjp(x, dy, spec, w_np)
    tolerances.assert_close(y.detach().numpy(), expected, what=f"{what} y")
    tolerances.assert_close(y_eager.numpy(), expected, what=f"{what} y (no grad)")
    assert xt.grad is not None and w.grad is not None
    tolerances.assert_close(xt.grad.numpy(), dx, quantity="grad", what=f"{what} dx")
    tolerances.assert_close(w.grad.numpy(), dw, quantity="grad", what=f"{what} dw")


SCALES = np.array([1.0, 1e20, 3e38, 1e15, 1e-30, 1.0])


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_far_from_unit_scale(kind: dict, placement: str) -> None:
    """|x| above 1.8e19 overflows x**2 in float32; the rows are rescaled, the answer is the
    reference's (values near +-1), and so are the gradients (dy scaled so that they are normal
    float32 numbers). Ordinary rows in the same batch are unaffected."""
    rng = np.random.default_rng(0)
    spec = NormSpec(**kind, eps_placement=placement)
    x = rng.standard_normal((len(SCALES), 16)) * SCALES[:, None]
    x[2] = np.sign(x[2]) * 3e38
    dy = rng.standard_normal(x.shape) * np.minimum(SCALES, 1e30)[:, None]
    check(spec, x.astype(np.float32), dy.astype(np.float32), f"{spec} scales {SCALES}")


def test_module_on_overflowing_rows_matches_the_reference() -> None:
    from normkit.torch import RMSNorm

    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0)) * 1e20
    module = RMSNorm(8)
    y = module(x)
    expected = reference.normalize(x.numpy(), module.spec)
    tolerances.assert_close(y.detach().numpy(), expected, what="RMSNorm(8) on 1e20 rows")
    assert np.abs(y.detach().numpy()).max() > 0.5


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_large_mean_layer_norm_float32(placement: str) -> None:
    """Rows of mean 1e6 and spread 1: the correction pass brings float32 within the bound."""
    rng = np.random.default_rng(1)
    spec = NormSpec("layer", eps_placement=placement)
    x = (rng.standard_normal((4, 256)) + 1e6).astype(np.float32)
    check(spec, x, rng.standard_normal(x.shape).astype(np.float32), "mean 1e6")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_long_float32_rms_rows(grad: bool) -> None:
    """n = 2**20: the statistic is accumulated in blocks, within the float32 bound."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 2**20)).astype(np.float32)
    spec = NormSpec(scale=False)
    with torch.set_grad_enabled(grad):
        y = F.normalize(torch.tensor(x, requires_grad=grad), spec)
    tolerances.assert_close(y.detach().numpy(), reference.normalize(x, spec), what="n = 2**20")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_partial_rms_with_one_statistic_element(placement: str, n: int, dtype: type) -> None:
    """k = 1: element 0's gradient, of order eps r**3 where dy is zero elsewhere, is taken in
    closed form (1 - y_hat_0**2 would cancel)."""
    spec = NormSpec("partial_rms", p=1 / 16, eps_placement=placement, scale=False)
    x = np.linspace(0.5, 3.0, 3 * n).reshape(3, n).astype(dtype)
    dy = np.zeros_like(x)
    dy[:, 0] = 1.0
    xt = torch.tensor(x, requires_grad=True)
    F.normalize(xt, spec).backward(torch.tensor(dy))
    assert xt.grad is not None
    expected = reference.normalize_vjp(x, dy, spec)[0]
    tolerances.assert_close(xt.grad.numpy(), expected, quantity="grad", what=f"k = 1, n = {n}")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("spec", [NormSpec("partial_rms", p=0.1), NormSpec("layer")], ids=str)
def test_double_backward_on_degenerate_rows(spec: NormSpec, placement: str) -> None:
    """The closed forms are differentiable: second derivatives pass gradgradcheck."""
    n = 8 if spec.kind == "partial_rms" else 2
    spec = spec.replace(eps_placement=placement, eps=1e-2)
    x = torch.linspace(-1.0, 2.0, 3 * n, dtype=torch.float64).reshape(3, n).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: F.normalize(t, spec), (x,))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_stay_where_the_reference_has_them(kind: dict, placement: str) -> None:
    spec = NormSpec(**kind, eps_placement=placement)
    x = np.random.default_rng(3).standard_normal((4, 10)).astype(np.float32)
    x[0, 7], x[1, 2], x[2, 0] = np.nan, np.inf, 1e30
    with torch.no_grad():
        y = F.normalize(torch.tensor(x), spec)
    tolerances.assert_close(y.numpy(), reference.normalize(x, spec), what="NaN/inf rows")


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


def test_smallest_eps_on_zero_and_tiny_rows() -> None:
    eps = 2.0**-126
    spec = NormSpec(eps=eps, eps_placement="outside", scale=False)
    x = np.zeros((2, 6), np.float32)
    x[1] = 1e-30
    check(spec.replace(scale=True), x, np.ones_like(x), "smallest eps")


def _tiny_rows(scale: float, kind: str) -> np.ndarray:
    """Rows whose statistic's squares are ``scale**2``-sized: the issue's row (four read
    elements, the first ``scale``, then ones the statistic does not read), a row of one tiny
    element, and for LayerNorm a row whose centered values are all tiny."""
    x = np.zeros((3, 16))
    x[0, :4] = [scale, 0.0, -scale / 3, scale / 7]
    x[0, 4:] = 1.0 if kind == "partial_rms" else 0.0
    x[1, 0] = scale
    x[2, :6] = np.array([1.0, -2.0, 0.5, 3.0, -1.5, 0.25]) * scale
    return x


UNDERFLOW_KINDS = [
    pytest.param({"kind": "rms"}, id="rms"),
    pytest.param({"kind": "partial_rms", "p": 0.25}, id="partial-k4"),
    pytest.param({"kind": "partial_rms", "p": 1 / 16}, id="partial-k1"),
    pytest.param({"kind": "layer"}, id="layer"),
]


@pytest.mark.parametrize("kernel", ["composite", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1e-12, 1e-25, 1e-40])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", UNDERFLOW_KINDS)
def test_gradient_where_the_statistics_squares_underflow(
    kind: dict, placement: str, scale: float, dtype: torch.dtype, kernel: str
) -> None:
    """eps outside: ``x_i r'(s) = -r**2 x_i / (2 sqrt(s))`` with x_i / sqrt(s) scale-free. At
    scale 1e-25 the float32 squares flush to s = 0; the term must not be dropped (the issue's
    partial RMS row: dx[0, 0] = -6.0e10, not 1e5). Forward and gradients against the
    reference, with and without autograd, every kind, both placements."""
    from normkit.bridges import TorchBridge

    to_numpy = TorchBridge().to_numpy

    spec = NormSpec(**kind, eps=1e-5, eps_placement=placement)
    if (spec.kind, placement, scale, kernel, dtype) == (
        "layer", "inside", 1e-40, "composite", torch.float32
    ):
        pytest.skip("this takes torch's fused F.layer_norm, which centers subnormal float32 "
                    "inputs in float32 (a forward limit of torch's kernel; no 1/sqrt(s) term)")
    xt = torch.tensor(_tiny_rows(scale, spec.kind), dtype=torch.float32).to(dtype)
    dy = torch.linspace(-1.0, 2.0, xt.numel()).reshape(xt.shape).to(dtype)
    w = torch.linspace(0.5, 1.5, 16).to(dtype)
    x_np, dy_np, w_np = to_numpy(xt), to_numpy(dy), to_numpy(w)
    leaves = [xt.clone().requires_grad_(), w.clone().requires_grad_()]
    y = F.normalize(leaves[0], spec, leaves[1], kernel=kernel)
    y.backward(dy)
    with torch.no_grad():
        y_no_grad = F.normalize(xt, spec, w, kernel=kernel)
    expected = reference.normalize(x_np, spec, w_np)
    dx, dw, _ = reference.normalize_vjp(x_np, dy_np, spec, w_np)
    what = f"{spec} {kernel} scale {scale}"
    for got in (y, y_no_grad):
        tolerances.assert_close(to_numpy(got.detach()), expected, what=f"{what} y")
    assert leaves[0].grad is not None and leaves[1].grad is not None
    tolerances.assert_close(to_numpy(leaves[0].grad), dx, quantity="grad", what=f"{what} dx")
    tolerances.assert_close(to_numpy(leaves[1].grad), dw, quantity="grad", what=f"{what} dw")


def test_the_issues_partial_rms_row_gets_its_large_gradient() -> None:
    """The row of the report, composite path: dx[0, 0] is the reference's -6.0e10."""
    spec = NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside")
    x = np.array([[1e-25, 0, 0, 0] + [1] * 12], np.float32)
    xt = torch.tensor(x, requires_grad=True)
    F.normalize(xt, spec, kernel="composite").backward(torch.ones_like(xt))
    expected = reference.normalize_vjp(x, np.ones_like(x), spec)[0]
    assert xt.grad is not None and expected[0, 0] == pytest.approx(-6.0e10, rel=1e-3)
    tolerances.assert_close(xt.grad.numpy(), expected, quantity="grad", what="issue row")
