"""The host work of an eager call on the CPU kernel, by structure (nothing is timed): on a row
of a few thousand elements, the size of one token's activations, host work is what a call
costs, and each op or autograd node a call adds is a fixed price on every layer of a model."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from normkit import NormSpec, reference, tolerances
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


# ---- a call with a cached plan: its Python work, counted (sys.setprofile) -------------------

#: The most Python function calls (normkit's, torch's Python layers, the Module call) a call
#: with a cached plan makes on the CPU kernel, one token: forward under no_grad, forward with
#: an input that requires grad, and forward+backward (of which torch's own ``backward`` makes
#: 18). Each output whose numpy view is not cached (`cpu._view`: a fresh allocation at a new
#: address) adds two; 2 in a forward, 6 in a backward at most. Before plans: 87 to 91 calls
#: in a forward.
PYTHON_CALLS = {"forward": 14, "training forward": 20, "forward+backward": 56}


def _python_calls(fn: Callable[[], object]) -> list[str]:
    """The Python functions ``fn`` calls (every frame entered, by qualified name)."""
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[1:]  # fn itself


@pytest.mark.parametrize("layer", [RMSNorm, LayerNorm])
def test_a_cached_plan_call_makes_few_python_calls(layer: type[torch.nn.Module]) -> None:
    """The checks happen when the plan is built; a call whose signature has a plan looks it up,
    allocates and launches: a bounded number of Python calls, whatever the kind."""
    module = layer(4096)
    x = torch.randn(1, 4096)
    xg = x.clone().requires_grad_()
    dy = torch.randn(1, 4096)
    for _ in range(2):
        with torch.no_grad():
            module(x)
        module(xg).backward(dy)

    with torch.no_grad():
        counts = {"forward": _python_calls(lambda: module(x))}
    counts["training forward"] = _python_calls(lambda: module(xg))
    counts["forward+backward"] = _python_calls(lambda: module(xg).backward(dy))
    for what, calls in counts.items():
        assert len(calls) <= PYTHON_CALLS[what], f"{what}: {len(calls)} calls: {calls}"


class _CountedKernels:
    """The CPU kernel's launches, counted: its compiled entry points (`cpu._state`) wrapped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, gated: bool) -> None:
        self.forward = self.backward = 0
        assert cpu.load(dtype, gated) is not None, cpu.unavailable_reason()
        key = (dtype, gated)
        forward, backward = cpu._state["compiled"][key]

        def counted_forward(*args: Any) -> None:
            self.forward += 1
            forward(*args)

        def counted_backward(*args: Any) -> None:
            self.backward += 1
            backward(*args)

        monkeypatch.setitem(cpu._state["compiled"], key, (counted_forward, counted_backward))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", [NormSpec(), NormSpec("layer"), NormSpec("partial_rms", p=0.25),
                                  NormSpec(gate="after", group_size=16)], ids=lambda s: s.kind
                         + ("-gated" if s.gate else ""))
def test_the_cpu_kernel_launches_once_forward_and_once_backward(
    monkeypatch: pytest.MonkeyPatch, spec: NormSpec, dtype: torch.dtype
) -> None:
    """A forward is one launch of the forward kernel, a backward one of the backward kernel
    (dx and the parameters' gradients in one launch)."""
    from normkit.torch import from_spec

    launches = _CountedKernels(monkeypatch, dtype, spec.gate is not None)
    module = from_spec(spec, 64, kernel="cpu").to(dtype)
    x = torch.randn(5, 64, dtype=dtype, requires_grad=True)
    z = torch.randn(5, 64, dtype=dtype) if spec.gate else None
    call = (lambda t: module(t, z)) if z is not None else module
    with torch.no_grad():
        call(x)
    assert (launches.forward, launches.backward) == (1, 0)
    call(x).float().sum().backward()
    assert (launches.forward, launches.backward) == (2, 1)


class _CountedLaunches:
    """``kernel[grid](...)`` of a Triton kernel, counted."""

    def __init__(self, kernel: Any, counts: dict[str, int], name: str) -> None:
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid: Any) -> Any:
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.kernel[grid]


@pytest.mark.parametrize("layer", [RMSNorm, functools.partial(LayerNorm, bias=False)],
                         ids=["RMSNorm", "LayerNorm-no-bias"])
def test_the_triton_kernels_launch_once_forward_and_at_most_twice_backward(
    monkeypatch: pytest.MonkeyPatch, layer: Callable[..., torch.nn.Module]
) -> None:
    """In Triton's interpreter: a forward is one launch, a backward at most two (the backward
    kernel and the sum of the weight gradient's parts). (A LayerNorm with a bias sums its
    bias gradient in a third launch: the backward's reduction of both is not one kernel yet.)"""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from normkit.torch.kernels import triton as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts: dict[str, int] = {}
    for name in ("_forward_kernel", "_backward_kernel", "_column_sums_kernel"):
        monkeypatch.setattr(kernels, name, _CountedLaunches(getattr(kernels, name), counts, name))
    module = layer(32, device=device, kernel="triton")
    x = torch.randn(4, 32, device=device, requires_grad=True)
    with torch.no_grad():
        module(x)
    assert counts == {"_forward_kernel": 1}
    counts.clear()
    module(x).backward(torch.ones(4, 32, device=device))
    assert counts.pop("_forward_kernel") == 1
    assert sum(counts.values()) <= 2, counts
