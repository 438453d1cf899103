"""The host work of an eager call on the CPU kernel, by structure (nothing is timed): on a row
of a few thousand elements, the size of one token's activations, host work is what a call
costs, and each op or autograd node a call adds is a fixed price on every layer of a model."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from normkit import reference, tolerances
from normkit.torch import LayerNorm, RMSNorm
from normkit.torch.kernels import cpu
from tests.helpers.dispatched import DispatchedOps

pytest.importorskip("numba")


def _graph(y: torch.Tensor) -> list[str]:
    """The autograd nodes behind ``y`` other than the parameters' leaves, sorted."""
    found, stack = [], [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ != "AccumulateGrad":
            found.append(type(node).__name__)
        stack += [parent for parent, _ in node.next_functions]
    return sorted(found)


@pytest.mark.parametrize("layer", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 64)])
def test_an_eager_call_dispatches_only_its_outputs_and_parameter_casts(
    layer: type[torch.nn.Module], dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """A training-mode forward dispatches the two outputs' allocations (y, and r for the
    backward), a cast per half parameter and, for inputs of more than two dims, the views of x
    as rows and of y back; its graph is the kernel's node and the casts'. No reshape of a
    parameter, no filled tensor for a missing bias, no view where the shape is already right."""
    module = layer(64).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    module(x)  # compiled and warm
    with DispatchedOps() as ops:
        y = module(x)
    params = len(list(module.parameters()))
    casts = params if dtype != torch.float32 else 0
    views = 2 if len(shape) > 2 else 0
    assert sorted(ops.names) == sorted(
        ["_to_copy"] * casts + ["empty_like", "empty"] + ["view"] * views
    ), ops.names
    assert _graph(y) == sorted(
        ["CpuNormFunctionBackward"] + ["ToCopyBackward0"] * casts + ["ViewBackward0"] * (
            views // 2)
    )
    spec = module.spec_for(dtype)  # type: ignore[operator]
    want = reference.normalize(x.float().numpy(), spec)
    tolerances.assert_close(y.detach().float().numpy(), want, str(dtype)[6:], what="y")


def test_an_eager_call_does_not_bind_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.autograd.Function.apply` binds the arguments to forward's signature on every call
    (about 17 us, more than the kernel on a row of 4096); eager calls go to autograd's apply
    directly, with the same gradients. torch.func transforms still bind (they need it)."""
    module = RMSNorm(64)
    x = torch.randn(3, 64, requires_grad=True)
    dy = torch.randn(3, 64)
    module(x)
    binds = []
    original = inspect.Signature.bind
    monkeypatch.setattr(
        inspect.Signature, "bind",
        lambda self, *args, **kwargs: binds.append(1) or original(self, *args, **kwargs),
    )
    y = module(x)
    y.backward(dy)
    assert binds == []
    assert x.grad is not None and module.weight.grad is not None
    spec = module.spec_for(torch.float32)
    weight = module.weight.detach()
    grads = reference.normalize_vjp(x.detach().numpy(), dy.numpy(), spec, weight.numpy())
    tolerances.assert_close(x.grad.numpy(), grads.dx, quantity="grad", what="dx")
    tolerances.assert_close(module.weight.grad.numpy(), grads.dscale, quantity="grad",
                            what="dweight")
    from normkit.torch.functional import normalize

    got = torch.func.grad(lambda xi: (normalize(xi, spec, weight) * dy).sum())(x.detach())
    assert binds, "torch.func.grad went around Function.apply"
    np.testing.assert_allclose(got.numpy(), x.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
def test_a_call_in_inference_mode_leaves_later_training_calls_intact(affine: bool) -> None:
    """The shared constants that stand in for a missing bias or weight are made once; made first
    under ``torch.inference_mode`` they must still be normal tensors, which a later training
    call saves for its backward."""
    n = 48
    cpu._shared_filled.cache_clear()  # made afresh, under inference_mode
    module = RMSNorm(n, elementwise_affine=affine)
    with torch.inference_mode():
        module(torch.randn(3, n))
    x = torch.randn(3, n, requires_grad=True)
    dy = torch.randn(3, n)
    module(x).backward(dy)
    assert x.grad is not None
    spec = module.spec_for(torch.float32)
    weight = module.weight.detach().numpy() if affine else None
    grads = reference.normalize_vjp(x.detach().numpy(), dy.numpy(), spec, weight)
    tolerances.assert_close(x.grad.numpy(), grads.dx, quantity="grad", what="dx")
