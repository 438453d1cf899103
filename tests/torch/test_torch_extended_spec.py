"""normkit.torch's own on the fields beyond the original spec: add_norm's h and the residual
stream's dtypes, the DyT module, from_spec, torch.func transforms, and the error messages.

The values of every field, kind and dtype against the reference (modules, functions, the
compiled program) are tests/conformance/test_every_target.py's cases, on every target.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import normkit.torch as nt  # noqa: E402
from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.bridges import TorchBridge  # noqa: E402
from normkit.conformance import targets_torch as conformance  # noqa: E402
from normkit.torch import _plan, functional, kernels  # noqa: E402
from normkit.torch._spec import row_spec  # noqa: E402

to_numpy = TorchBridge().to_numpy


@pytest.mark.parametrize("rounding, h_dtype", [
    ("rounded", torch.bfloat16), ("float32", torch.float32),
    ("float32_normalized", torch.bfloat16),
])
def test_add_norm_returns_h_in_its_dtype(rounding, h_dtype):
    spec = NormSpec(residual=rounding)
    x = torch.randn(2, 8).to(torch.bfloat16)
    residual = torch.randn(2, 8).to(torch.bfloat16)
    y, h = functional.add_norm(x, residual, spec)
    assert y.dtype == torch.bfloat16 and h.dtype == h_dtype
    want_y, want_h = reference.add_normalize(to_numpy(x), to_numpy(residual), spec)
    np.testing.assert_array_equal(to_numpy(h), want_h)
    tolerances.assert_close(to_numpy(y), want_y)


def test_float32_residual_stream_with_a_half_input():
    spec = NormSpec(residual="float32", bias=True)
    x = torch.randn(2, 8).to(torch.bfloat16).requires_grad_()
    residual = torch.randn(2, 8, requires_grad=True)
    y, h = functional.add_norm(x, residual, spec)
    (y.float().sum() + h.sum()).backward()
    assert h.dtype == torch.float32 and residual.grad is not None
    assert residual.grad.dtype == torch.float32 and x.grad is not None
    grads = reference.add_normalize_vjp(
        to_numpy(x), to_numpy(residual.detach()), np.ones((2, 8)), np.ones((2, 8)), spec
    )
    tolerances.assert_close(to_numpy(residual.grad), grads.dresidual, quantity="grad")


def test_dyt_module_parameters_and_state_dict():
    dyt = nt.DyT(6, alpha_init=1.0, dtype=torch.float64)
    assert sorted(dyt.state_dict()) == ["alpha", "bias", "weight"]
    assert dyt.alpha.shape == (1,) and dyt.alpha.dtype == torch.float64
    assert dyt.alpha.item() == 1.0 and dyt.spec.alpha_init == 1.0
    assert torch.equal(dyt.weight, torch.ones(6, dtype=torch.float64))
    assert torch.equal(dyt.bias, torch.zeros(6, dtype=torch.float64))
    assert "alpha_init=1" in repr(dyt) and "eps" not in repr(dyt)
    bare = nt.DyT((2, 3), elementwise_affine=False, bias=False)
    assert sorted(bare.state_dict()) == ["alpha"] and bare.spec.alpha_init == 0.5
    assert bare.spec == NormSpec("dyt", axis=(-2, -1), scale=False, bias=False)
    with pytest.raises(ValueError, match="alpha_init=-1.0 is invalid"):
        nt.DyT(4, alpha_init=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dyt_gradient_where_cosh_squared_overflows(dtype: torch.dtype) -> None:
    """tanh'(u) = sech(u)**2 is taken as (d sech(u)) sech(u), sech(u) = 2 e**-|u| / (1 +
    e**-2|u|): ``d / cosh(u)**2`` was 0 for |u| > 44.4 (cosh(u)**2 overflows float32), where
    with a large cotangent dx is far from it (u = 50, dy = 1e30: 1.5e-13). Expected values
    from float64's cosh, independently of the code under test."""
    u = np.array([[3.0, -20.0, 44.0, 45.0, -50.0, 60.0, 87.0]])
    alpha = 0.5
    x = torch.tensor(u / alpha, dtype=dtype, requires_grad=True)
    dy = torch.full(x.shape, 1e30, dtype=dtype)
    module = nt.DyT(u.shape[1], alpha_init=alpha, elementwise_affine=False, bias=False,
                    kernel="composite")
    module(x).backward(dy)
    xs, dys = x.detach().double().numpy(), dy.double().numpy()
    slope = 1.0 / np.cosh(alpha * xs) ** 2
    want_dx = alpha * dys * slope
    got_dx = x.grad.double().numpy()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23
    # within 4 ulps, or below the dtype's least subnormal (u = 87: 5.4e-46, float32's 0)
    np.testing.assert_allclose(got_dx, want_dx, rtol=4 * ulp,
                               atol=float(torch.finfo(dtype).smallest_normal) * ulp)
    want_alpha = float((xs * dys * slope).sum())
    assert module.alpha.grad is not None
    np.testing.assert_allclose(module.alpha.grad.double().item(), want_alpha, rtol=1e-5)


def test_dyt_module_alpha_gradient():
    dyt = nt.DyT(8)
    with torch.no_grad():
        dyt.alpha.fill_(0.8)
        dyt.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x = torch.randn(4, 8) * 2
    dy = torch.randn(4, 8)
    dyt(x).backward(dy)
    args = (to_numpy(x), to_numpy(dy), dyt.spec, to_numpy(dyt.weight.detach()),
            np.zeros(8, np.float32), to_numpy(dyt.alpha.detach()))
    want = reference.normalize_vjp(*args)
    assert dyt.alpha.grad is not None and dyt.alpha.grad.shape == (1,)
    tolerances.assert_close(to_numpy(dyt.alpha.grad), want.dalpha, quantity="grad")
    assert dyt.weight.grad is not None
    tolerances.assert_close(to_numpy(dyt.weight.grad), want.dscale, quantity="grad")


FROM_SPEC = [
    NormSpec("dyt", alpha_init=2.0, scale_offset=1.0, offset_dtype="param", residual="float32"),
    NormSpec("layer", variance="fast", output_dtype="promote", backward="autograd",
             cast="before_scale", eps=1e-5),
    NormSpec("partial_rms", p=0.25, residual="float32_normalized", eps_placement="outside"),
    NormSpec("rms", axis=(-2, -1), bias=True, residual="rounded", backward="autograd"),
]


@pytest.mark.parametrize("spec", FROM_SPEC, ids=str)
def test_from_spec_builds_every_spec(spec):
    module = nt.from_spec(spec, (3, 4) if len(spec.axis) == 2 else 4)
    assert module.spec == spec
    assert type(module).__name__ == {
        "dyt": "DyT", "layer": "LayerNorm", "partial_rms": "PartialRMSNorm", "rms": "RMSNorm"
    }[spec.kind]


# ---- errors -------------------------------------------------------------------------------


def test_residual_errors_name_the_problem():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"residual='rounded'.*use add_norm\(x, residual"):
        functional.normalize(x, NormSpec(residual="rounded"))
    with pytest.raises(ValueError, match="add_norm needs a spec with a residual rounding"):
        functional.add_norm(x, x, NormSpec())
    with pytest.raises(ValueError, match=r"residual has shape \(2, 4\), expected the shape"):
        functional.add_norm(x, x[:, :4], NormSpec(residual="float32"))
    half = x.to(torch.bfloat16)
    with pytest.raises(TypeError, match="residual='rounded' with x of dtype bfloat16 needs"):
        functional.add_norm(half, x, NormSpec(residual="rounded"))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        functional.add_norm(x, to_numpy(x), NormSpec(residual="rounded"))


def test_module_residual_errors():
    plain, fused = nt.RMSNorm(8), nt.RMSNorm(8, residual="rounded")
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="RMSNorm was given a residual but its spec has"):
        plain(x, x)
    with pytest.raises(ValueError, match=r"call it as module\(x, residual\)"):
        fused(x)


def test_alpha_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="alpha was given but the spec has kind='rms'"):
        functional.normalize(x, NormSpec(), alpha=torch.ones(1))
    with pytest.raises(ValueError, match=r"alpha has shape \(2,\), expected a scalar"):
        functional.normalize(x, NormSpec("dyt"), alpha=torch.ones(2))


def test_named_kernel_refuses_a_field_it_lacks_and_auto_falls_back_quietly(monkeypatch):
    x = torch.randn(2, 8)
    for spec, field in (
        (NormSpec(residual="rounded"), "residual='rounded'"),
        (NormSpec("layer", variance="fast"), "variance='fast'"),
        (NormSpec(scale_offset=1.0, offset_dtype="param"), "offset_dtype='param'"),
        (NormSpec(output_dtype="promote"), "output_dtype='promote'"),
        (NormSpec(backward="autograd"), "backward='autograd'"),
        (NormSpec("dyt"), "kind='dyt'"),
    ):
        rows = row_spec(spec, 8)
        with pytest.raises(ValueError, match=f"kernel='cpu' does not compute NormSpec.{field}"):
            _plan.choose("cpu", x, spec, rows)
        assert _plan.choose("auto", x, spec, rows) == "composite"
    with pytest.raises(ValueError, match="kernel='cpu' does not compute NormSpec.residual"):
        functional.add_norm(x, x, NormSpec(residual="rounded"), kernel="cpu")
    # Without numba, "auto" warns when it misses the kernel, not when the spec needs composite.
    monkeypatch.setattr(kernels, "NUMBA", False)
    monkeypatch.setitem(_plan._warned, "auto", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        functional.normalize(x, NormSpec("dyt"))
    with pytest.warns(RuntimeWarning, match="numba is not installed"):
        functional.normalize(x, NormSpec())


def test_promote_counts_the_parameters_given():
    spec = NormSpec("dyt", output_dtype="promote")
    x = torch.randn(2, 8).to(torch.bfloat16)
    for kwargs, out in (
        ({}, torch.bfloat16),  # alpha_init, no parameter given
        ({"alpha": torch.full((1,), 0.5)}, torch.float32),
        ({"weight": torch.ones(8, dtype=torch.float16)}, torch.float32),
        ({"bias": torch.zeros(8, dtype=torch.float64)}, torch.float64),
    ):
        y = functional.normalize(x, spec, **kwargs)
        arrays = {k: to_numpy(v) for k, v in kwargs.items()}
        expected = reference.normalize(to_numpy(x), spec, arrays.get("weight"),
                                       arrays.get("bias"), arrays.get("alpha"))
        assert y.dtype == out and to_numpy(y).dtype == expected.dtype
        tolerances.assert_close(to_numpy(y), expected)


def test_hook_skips_a_named_kernel_that_lacks_a_field():
    x = dy = np.ones((2, 8), np.float32)
    with pytest.raises(NotImplementedError, match="kernel='cpu' does not compute NormSpec.kind"):
        conformance.evaluate(NormSpec("dyt"), x, dy, kernel="cpu")
    with pytest.raises(ValueError, match="residual and dh are given exactly when"):
        conformance.evaluate(NormSpec(residual="rounded"), x, dy)


def test_torch_func_transforms_through_dyt_and_add_norm():
    # Rows are independent: per-sample gradients under vmap are the rows of the batch gradient.
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    alpha = torch.full((1,), 0.7, dtype=torch.float64)

    def dyt(t):
        return functional.normalize(t, NormSpec("dyt"), alpha=alpha).square().sum()

    def fused(t):
        y, h = functional.add_norm(t, 2 * t, NormSpec(residual="rounded"))
        return y.square().sum() + h.sum()

    for loss in (dyt, fused):
        per_sample = torch.func.vmap(torch.func.grad(loss))(x)
        whole = torch.func.grad(loss)(x)
        torch.testing.assert_close(per_sample, whole, rtol=1e-12, atol=1e-12)
