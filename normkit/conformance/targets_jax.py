"""The conformance hook of normkit.jax: its linen and nnx modules and its functions, jitted or
eager (a `normkit.conformance.harness.Harness`).

float64 cases run with JAX's 64-bit mode enabled only while they run (the scoped
``jax.enable_x64``, `normkit.bridges.JaxBridge.float64_scope`), so they are computed and
returned in float64.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from flax import nnx

import normkit.jax as nkjax
from normkit.bridges import JaxBridge, VjpFn
from normkit.conformance.harness import Harness
from normkit.jax import functional
from normkit.spec import NormSpec

__all__ = ["APIS", "VARIANTS", "build", "devices", "evaluate"]

Api = Literal["linen", "nnx", "functional"]
APIS: tuple[Api, ...] = ("linen", "nnx", "functional")
VARIANTS: dict[str, tuple[object, ...] | None] = {
    "api": APIS, "jit": (True, False), "implementation": functional.IMPLEMENTATIONS,
}
_BRIDGE = JaxBridge()


def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, **variant: Any,
) -> VjpFn:
    """``fn(x[, residual or gate], **params)`` for ``api=`` ``"linen"``
    (`normkit.jax.from_spec`, the default), ``"nnx"`` (`normkit.jax.nnx.from_spec`) or
    ``"functional"`` (`normkit.jax.functional.normalize` and ``add_norm``); ``jit=False`` takes
    the VJP eagerly (default: one jitted program); ``implementation=`` the modules' and
    functions' (default: theirs)."""
    del dtype, device  # the layers take the input's, where the bridge puts it
    api: Api = variant.get("api", "linen")
    chosen: dict[str, Any] = {"implementation": variant.get("implementation")}
    if api == "functional":

        def apply_functional(x: Any, second: Any = None, **p: Any) -> Any:
            args = (spec, p.get("scale"), p.get("bias"))
            implementation = chosen["implementation"]
            if spec.residual is None:
                return functional.normalize(x, *args, gate=second, alpha=p.get("alpha"),
                                            implementation=implementation)
            return functional.add_norm(x, second, *args, alpha=p.get("alpha"),
                                       implementation=implementation)

        return apply_functional
    if api == "linen":
        module = nkjax.from_spec(spec, param_dtype=param_dtype, **chosen)

        def apply_linen(x: Any, second: Any = None, **p: Any) -> Any:
            if spec.gate is not None:
                return module.apply({"params": p}, x, gate=second)
            return module.apply({"params": p}, x, second)

        return apply_linen
    with _BRIDGE.float64_scope(param_dtype):
        graphdef = nnx.graphdef(
            nkjax.nnx.from_spec(spec, spec.param_shape(shape), param_dtype=param_dtype, **chosen)
        )

    def apply_nnx(x: Any, second: Any = None, **p: Any) -> Any:
        state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
        if spec.gate is not None:
            return nnx.merge(graphdef, state)(x, gate=second)
        return nnx.merge(graphdef, state)(x, second)

    return apply_nnx


_HARNESS = Harness(_BRIDGE, build, VARIANTS, jit=True)
devices = _HARNESS.devices
evaluate = _HARNESS.evaluate
