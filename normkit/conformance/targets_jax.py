"""The conformance hook of normkit.jax: its linen and nnx modules and its functions, jitted or
eager (a `normkit.conformance.harness.Harness`).

float64 cases run with JAX's 64-bit mode enabled only while they run (the scoped
``jax.enable_x64``, `normkit.bridges.JaxBridge.float64_scope`), so they are computed and
returned in float64.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import normkit.jax as nkjax
from normkit.bridges import JaxBridge, VjpFn
from normkit.conformance.harness import Harness
from normkit.conformance.support import PROBE_SHAPE, Cell
from normkit.jax import functional
from normkit.spec import NormSpec

__all__ = ["APIS", "VARIANTS", "build", "devices", "evaluate", "support"]

Api = Literal["linen", "nnx", "functional"]
APIS: tuple[Api, ...] = ("linen", "nnx", "functional")
VARIANTS: dict[str, tuple[object, ...] | None] = {
    "api": APIS, "jit": (True, False), "implementation": functional.IMPLEMENTATIONS,
}
_BRIDGE = JaxBridge()


@functools.lru_cache(maxsize=64)
def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, **variant: Any,
) -> VjpFn:
    """``fn(x[, residual or gate], **params)`` for ``api=`` ``"linen"``
    (`normkit.jax.from_spec`, the default), ``"nnx"`` (`normkit.jax.nnx.from_spec`) or
    ``"functional"`` (`normkit.jax.functional.normalize` and ``add_norm``); ``jit=False`` takes
    the VJP eagerly (default: one jitted program); ``implementation=`` the modules' and
    functions' (default: theirs). One function per spec, shape, dtypes and variant (the 64
    latest), so that the bridge compiles its VJP once for the cases that share them (rows of
    another kind)."""
    del device  # the layers take the input's, where the bridge puts it
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

        apply_functional.initial_params = {}  # type: ignore[attr-defined]
        return apply_functional
    if api == "linen":
        module = nkjax.from_spec(spec, param_dtype=param_dtype, **chosen)

        def apply_linen(x: Any, second: Any = None, **p: Any) -> Any:
            if spec.gate is not None:
                return module.apply({"params": p}, x, gate=second)
            return module.apply({"params": p}, x, second)

        with _BRIDGE.float64_scope(param_dtype, dtype):
            x = jnp.zeros(shape, dtype)
            second = x if spec.gate is not None or spec.residual is not None else None
            own = module.init(jax.random.key(0), x, **_second(spec, second))["params"]
        apply_linen.initial_params = {  # type: ignore[attr-defined]
            name: np.asarray(value) for name, value in own.items()
        }
        return apply_linen
    with _BRIDGE.float64_scope(param_dtype):
        layer = nkjax.nnx.from_spec(
            spec, spec.param_shape(shape), param_dtype=param_dtype, **chosen
        )
        graphdef = nnx.graphdef(layer)

    def apply_nnx(x: Any, second: Any = None, **p: Any) -> Any:
        state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
        if spec.gate is not None:
            return nnx.merge(graphdef, state)(x, gate=second)
        return nnx.merge(graphdef, state)(x, second)

    apply_nnx.initial_params = {  # type: ignore[attr-defined]
        name: np.asarray(getattr(layer, name).value)
        for name in ("scale", "bias", "alpha") if isinstance(getattr(layer, name, None), nnx.Param)
    }
    return apply_nnx


def _second(spec: NormSpec, second: Any) -> dict[str, Any]:
    """The keyword or positional second input of a linen module's call, for ``init``."""
    if spec.gate is not None:
        return {"gate": second}
    return {} if second is None else {"residual": second}


_HARNESS = Harness(_BRIDGE, build, VARIANTS, jit=True)
devices = _HARNESS.devices
evaluate = _HARNESS.evaluate


def support(spec: NormSpec, argument: str | None) -> dict[str, Cell]:
    """What each of normkit.jax's implementations (`functional.IMPLEMENTATIONS`) does with
    ``spec`` and the call ``argument`` (`normkit.conformance.support`): `functional.normalize`
    or ``add_norm`` traced on `PROBE_SHAPE` ones (``axis_name`` under a `jax.vmap` that names
    the axis); a refusal is ``("no", message)``, the Pallas kernels missing from the traced
    program ``("fallback", "xla")``."""
    found: dict[str, Cell] = {}
    x = jnp.ones(PROBE_SHAPE)
    second = x if spec.gate is not None or spec.residual is not None else None
    function = functional.normalize if spec.residual is None else functional.add_norm
    if argument is not None and argument not in inspect.signature(function).parameters:
        refused: Cell = "no", f"normkit.jax.functional.{function.__name__} takes no {argument}="
        return dict.fromkeys(functional.IMPLEMENTATIONS, refused)
    arguments = {"mask": jnp.ones(PROBE_SHAPE, bool), "axis_name": "rows"}
    for implementation in functional.IMPLEMENTATIONS:
        extra: dict[str, Any] = {"implementation": implementation}
        if argument is not None:
            extra[argument] = arguments[argument]

        def call(x: Any, second: Any, extra: dict[str, Any] = extra) -> Any:
            if spec.residual is not None:
                return functional.add_norm(x, second, spec, **extra)
            return functional.normalize(x, spec, gate=second, **extra)

        traced = jax.vmap(call, axis_name="rows") if argument == "axis_name" else call
        try:
            program = str(jax.make_jaxpr(traced)(x, second))
        except ValueError as exc:
            found[implementation] = "no", str(exc)
            continue
        kernels = implementation == "xla" or "pallas_call" in program
        found[implementation] = ("yes", "") if kernels else ("fallback", "xla")
    return found
