"""The conformance targets that run in this test process, with their variants, and one check of a
target against the reference through `normkit.conformance.compare` (the tolerance policy).

`check` is the only comparison tests/conformance/test_every_target.py makes: the hook's outputs
(`normkit.conformance.targets.Hook`), every quantity in its dtype and within the tolerance, and
for torch the forward pass again without autograd (another path through its kernels). A target
whose framework is not installed is a skip; normkit.tf runs on the Keras backend of this process
(``KERAS_BACKEND``, default TensorFlow).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from normkit import dtypes, tolerances
from normkit.conformance import compare as conformance
from normkit.conformance.compare import Inputs
from normkit.conformance.targets import JAX_HOOK, KERAS_HOOK, TORCH_HOOK
from normkit.spec import NormSpec

KERAS_BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
_KERAS_PACKAGES = ("keras", KERAS_BACKEND if KERAS_BACKEND != "tensorflow" else "tensorflow")


@dataclass(frozen=True)
class Variant:
    """One way to run a conformance target: its hook and the variant keywords of ``evaluate``.

    ``name`` is the test id; ``requires`` the packages it needs (a skip without them)."""

    name: str
    hook: str
    requires: tuple[str, ...]
    options: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict[str, object]:
        return dict(self.options)

    @property
    def framework(self) -> str:
        return {TORCH_HOOK: "torch", JAX_HOOK: "jax", KERAS_HOOK: "tf"}[self.hook]


def _variant(name: str, hook: str, requires: tuple[str, ...], **options: object) -> Variant:
    return Variant(name, hook, requires, tuple(sorted(options.items())))


_TORCH = ("torch",)
_JAX = ("jax", "flax")
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        # kernel="auto": the numba CPU kernel where it computes the spec, else torch ops;
        # the module API where the normalized axes are the trailing ones
        _variant("torch", TORCH_HOOK, _TORCH),
        _variant("torch.functional", TORCH_HOOK, _TORCH, api="functional"),
        _variant("torch[composite]", TORCH_HOOK, _TORCH, kernel="composite"),
        _variant("torch[cpu-kernel]", TORCH_HOOK, (*_TORCH, "numba"), kernel="cpu"),
        # on CPU tensors under Triton's interpreter (tests/conftest.py sets it without a GPU)
        _variant("torch[triton]", TORCH_HOOK, (*_TORCH, "triton"), kernel="triton"),
        _variant("torch[compiled]", TORCH_HOOK, _TORCH, compiled=True),
        _variant("jax.linen", JAX_HOOK, _JAX, api="linen"),
        _variant("jax.nnx", JAX_HOOK, _JAX, api="nnx"),
        _variant("jax.functional", JAX_HOOK, _JAX, api="functional"),
        _variant("jax.functional[eager]", JAX_HOOK, _JAX, api="functional", jit=False),
        # normkit.tf on this process's Keras backend, eager and jitted
        _variant("tf", KERAS_HOOK, _KERAS_PACKAGES, jit=False),
        _variant("tf[jit]", KERAS_HOOK, _KERAS_PACKAGES, jit=True),
    )
}


def hook(variant: Variant) -> ModuleType:
    """The variant's hook module; a skip naming what is missing when it cannot run here."""
    for package in variant.requires:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{variant.name} needs {package}, which is not installed")
    if variant.framework == "tf" and variant.kwargs.get("jit") and KERAS_BACKEND == "torch":
        pytest.skip("the torch Keras backend has no jit")
    if variant.kwargs.get("kernel") == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only (set "
                    "without a GPU; test_gpu_edges runs them on one)")
    return importlib.import_module(variant.hook)


def evaluate(
    variant: Variant, spec: NormSpec, inputs: Inputs, device: str = "cpu"
) -> tuple[np.ndarray | None, ...]:
    """The hook's outputs for ``inputs``, named by `normkit.conformance.compare.quantities`."""
    x, dy, scale, bias, residual, dh, alpha, gate = inputs
    extra: dict[str, Any] = {} if gate is None else {"gate": gate}
    found: tuple[np.ndarray | None, ...] = hook(variant).evaluate(
        spec, x, dy, scale, bias, residual=residual, dh=dh, alpha=alpha, device=device,
        **extra, **variant.kwargs,
    )
    return found


def torch_forward_without_autograd(
    variant: Variant, spec: NormSpec, inputs: Inputs, device: str = "cpu"
) -> tuple[np.ndarray, ...]:
    """``(y,)``, or ``(y, h)`` with a residual, of the variant's torch function called under
    ``torch.no_grad()`` (the path inference takes, which the VJP does not)."""
    import torch

    from normkit.bridges import TorchBridge, device_name
    from normkit.conformance.compare import param_dtype
    from normkit.conformance.harness import initial_params

    bridge = TorchBridge()
    place = device_name(device)
    x, residual, gate = inputs.x, inputs.residual, inputs.gate
    params = initial_params(spec, inputs)
    fn = hook(variant).build(
        spec, x.shape, param_dtype(inputs), dtype=x.dtype, device=place, **variant.kwargs
    )
    second = residual if residual is not None else gate
    args = [bridge.to_tensor(a, place) for a in (x, second) if a is not None]
    with torch.no_grad():
        out = fn(*args, **{k: bridge.to_tensor(v, place) for k, v in params.items()})
    outs = out if isinstance(out, tuple | list) else (out,)
    return tuple(bridge.to_numpy(o) for o in outs)


def _assert_no_problems(what: str, problems: Sequence[str]) -> None:
    assert not problems, f"{what}: " + "; ".join(problems)


def check(
    variant: Variant,
    spec: NormSpec,
    inputs: Inputs,
    *,
    device: str = "cpu",
    checked: Sequence[str] | None = None,
    unscaled_y: bool = False,
    what: str = "",
) -> dict[str, np.ndarray | None]:
    """The variant's outputs against the reference: `compare` (every quantity of ``checked``,
    all by default, in its dtype and within `normkit.tolerances`), and beyond it:

    - ``h`` bit for bit (the sum is rounded once, where the reference rounds it);
    - with a residual, ``dx`` and ``dresidual`` also without the ``|dh|`` magnitude compare
      allows for cancellation (the bound those tests held before it did);
    - ``unscaled_y``: a half ``y`` of ``cast="before_scale"`` also in ulps at ``|y|`` alone,
      without ``compare``'s ``|y_hat * (scale_offset + w)|``;
    - torch (not compiled): ``y`` (and ``h``) of the forward under ``torch.no_grad()`` too.

    Returns the outputs by name.
    """
    label = f"{variant.name} {what or spec}"
    outputs = evaluate(variant, spec, inputs, device)
    problems, _ = conformance.compare(spec, inputs, outputs, checked)
    _assert_no_problems(label, problems)
    names = conformance.quantities(spec)
    got = dict(zip(names, outputs, strict=True))
    want = conformance.expected(spec, inputs)
    want_dtypes = conformance.expected_dtypes(spec, inputs)

    def wanted(name: str) -> bool:
        return checked is None or name in checked

    if "h" in got and wanted("h"):
        np.testing.assert_array_equal(got["h"], want["h"], err_msg=f"{label} h")
    if spec.residual is not None:
        for name in ("dx", "dresidual"):
            if wanted(name):
                tolerances.assert_close(
                    got[name], want[name], want_dtypes[name], "grad", what=f"{label} {name}"
                )
    x = inputs.x
    if unscaled_y and dtypes.is_half(x.dtype) and spec.cast == "before_scale" and wanted("y"):
        tolerances.assert_close(got["y"], want["y"], cast=spec.cast, what=f"{label} y at |y|")
    if variant.framework == "torch" and not variant.kwargs.get("compiled"):
        forward = torch_forward_without_autograd(variant, spec, inputs, device)
        alone = [None] * len(names)
        alone[0] = forward[0]
        forward_names = ["y"]
        if spec.residual is not None:
            alone[names.index("h")] = forward[1]
            forward_names.append("h")
        shown = [n for n in forward_names if wanted(n)]
        problems, _ = conformance.compare(spec, inputs, alone, shown)
        _assert_no_problems(f"{label} (no_grad)", problems)
    return got


def params(names: Sequence[str]) -> list[Any]:
    """pytest params of the variants ``names``, each with its name as id."""
    return [pytest.param(VARIANTS[n], id=n) for n in names]
