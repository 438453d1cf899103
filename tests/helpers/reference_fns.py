"""The reference of a spec as a torch function, for checking `assert_conforms` and the
conformance matrix against implementations that follow another spec exactly.

`torch_reference(spec, calls_as)` is ``fn`` as `assert_conforms` calls it for the spec
``calls_as`` (``fn(x[, residual or gate][, scale, bias[, alpha]])``), computing `spec`'s
reference forward and its exact VJP (`normkit.conformance.compare.expected`), each output
rounded to `spec`'s dtypes; a parameter `spec` lacks is ignored (no gradient reaches it).
`changed_outputs(spec, inputs)` is the same for the matrix: a hook's outputs, in `spec`'s
quantities, for a case's inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from normkit import dtypes
from normkit.bridges import TorchBridge
from normkit.conformance.compare import Inputs, expected, expected_dtypes, quantities
from normkit.spec import NormSpec

_BRIDGE = TorchBridge()


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _BRIDGE.to_numpy(t)


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else _BRIDGE.to_tensor(a)


def _inputs(spec: NormSpec, x, second, scale, bias, alpha, dy, dh) -> Inputs:
    """The case's arrays as `spec` reads them: parameters it lacks left out."""
    x = _numpy(x)
    return Inputs(
        x=x,
        dy=np.zeros_like(x) if dy is None else _numpy(dy),
        scale=_numpy(scale) if spec.scale else None,
        bias=_numpy(bias) if spec.bias else None,
        residual=_numpy(second) if spec.residual is not None else None,
        dh=(None if spec.residual is None
            else np.zeros_like(_numpy(second)) if dh is None else _numpy(dh)),
        alpha=_numpy(alpha) if spec.kind == "dyt" else None,
        gate=_numpy(second) if spec.gate is not None else None,
    )


def _rounded(spec: NormSpec, inputs: Inputs) -> dict[str, np.ndarray | None]:
    """The reference's quantities of `spec`, each rounded to its dtype."""
    values = expected(spec, inputs)
    kinds = expected_dtypes(spec, inputs)
    return {q: None if v is None else dtypes.round_to(v, kinds[q]) for q, v in values.items()}


def changed_outputs(spec: NormSpec, calls_as: NormSpec, inputs: Inputs) -> tuple:
    """A hook's outputs for a case of `calls_as` computed by `spec`, in `calls_as`'s quantities
    (a quantity `spec` lacks is None)."""
    read = inputs._replace(
        scale=inputs.scale if spec.scale else None,
        bias=inputs.bias if spec.bias else None,
    )
    found = _rounded(spec, read)
    return tuple(found.get(q) for q in quantities(calls_as))


class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: NormSpec, x, second, scale, bias, alpha):
        ctx.spec = spec
        ctx.save_for_backward(x, second, scale, bias, alpha)
        found = _rounded(spec, _inputs(spec, x, second, scale, bias, alpha, None, None))
        if spec.residual is not None:
            return _tensor(found["y"]), _tensor(found["h"])
        return _tensor(found["y"])

    @staticmethod
    def backward(ctx: Any, dy, dh=None):
        spec = ctx.spec
        x, second, scale, bias, alpha = ctx.saved_tensors
        found = _rounded(spec, _inputs(spec, x, second, scale, bias, alpha, dy, dh))
        dsecond = found.get("dresidual") if spec.residual is not None else found.get("dgate")
        grads = [found["dx"], dsecond, found.get("dscale"), found.get("dbias"), found.get("dalpha")]
        return (None, *(None if g is None else _tensor(np.asarray(g)) for g in grads))


def torch_reference(spec: NormSpec, calls_as: NormSpec, params: bool):
    """`spec`'s reference as ``fn`` for `assert_conforms` with the spec `calls_as`."""
    second = calls_as.residual is not None or calls_as.gate is not None

    def fn(x, *rest):
        rest = list(rest)
        other = rest.pop(0) if second else None
        scale, bias, alpha = (rest + [None, None, None])[:3] if params else (None, None, None)
        if alpha is None and spec.kind == "dyt":
            alpha = torch.full((1,), float(spec.alpha_init))
        if scale is None and spec.scale:
            shape = spec.param_shape(tuple(x.shape))
            scale = torch.full(shape, spec.scale_init, dtype=torch.float32)
        if bias is None and spec.bias:
            bias = torch.zeros(spec.param_shape(tuple(x.shape)), dtype=torch.float32)
        return _Reference.apply(spec, x, other, scale, bias, alpha)

    fn.__qualname__ = f"reference of {spec!r}"
    return fn
