"""The conformance hook of normkit.tf: its layers on the current Keras backend, eager or jitted
(a `normkit.conformance.harness.Harness`); the cross-framework runner starts one process per
``KERAS_BACKEND``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import keras
import numpy as np

from normkit.bridges import Bridge, JaxBridge, TensorFlowBridge, TorchBridge, VjpFn
from normkit.conformance.harness import Harness
from normkit.conformance.support import PROBE_SHAPE, Cell
from normkit.spec import NormSpec
from normkit.tf.layers import WEIGHT_ATTRIBUTES, from_spec

__all__ = [
    "POLICIES", "VARIANTS", "build", "devices", "evaluate", "keras_backend", "support",
]

VARIANTS: dict[str, tuple[object, ...] | None] = {"jit": (True, False), "policy": None}
POLICIES = {
    "float16": "mixed_float16", "bfloat16": "mixed_bfloat16",
    "float32": "float32", "float64": "float64",
}
"""The dtype policy `build` picks for an input dtype: its compute dtype is the input's, so
Keras' autocast leaves ``x`` as it is (the mixed policies keep float32 variables)."""
_BRIDGES: dict[str, type[Bridge]] = {
    "tensorflow": TensorFlowBridge, "jax": JaxBridge, "torch": TorchBridge,
}


def keras_backend() -> str:
    """The Keras backend in use: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.backend.backend()


def _bridge() -> Bridge:
    """The bridge of the framework under the current Keras backend."""
    backend = keras_backend()
    if backend not in _BRIDGES:
        raise RuntimeError(
            f"normkit.tf supports the tensorflow, jax and torch Keras backends, not {backend!r}"
        )
    return _BRIDGES[backend]()


_BRIDGE = _bridge()


def devices() -> list[str]:
    """The devices the current backend sees: ``"cpu"``, then ``"cuda:0"``, ``"cuda:1"``, ..."""
    return [d for d in _bridge().devices() if d == "cpu" or d.startswith("cuda:")]


@functools.lru_cache(maxsize=64)
def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, **variant: Any,
) -> VjpFn:
    """``fn(x[, residual or gate], **params)``: ``from_spec(spec)`` called statelessly with the
    params as its variables' values.

    Variants: ``jit=True`` compiles the VJP (``tf.function(jit_compile=True)`` on TensorFlow,
    ``jax.jit`` on JAX; the torch backend has none). ``policy=`` a Keras dtype policy name;
    ``x`` is cast to its compute dtype first, and the outputs are in it. Without it the policy
    is ``x``'s own (`POLICIES`: ``mixed_bfloat16`` for bfloat16, ...), under which the layer
    computes the spec on ``x`` as given. The variables take ``param_dtype``; parameters given in
    several dtypes raise NotImplementedError.

    One function per spec, shape, dtypes and variant (the 64 latest): the layer is built once,
    and the bridge traces and compiles its VJP once per function and input signature.
    """
    del device  # the bridge puts the inputs and the params there
    if variant.get("jit", False) and keras_backend() == "torch":
        raise ValueError("the torch Keras backend has no jit variant (jit=True)")
    # Other dtypes run under float32, where the layer names what it accepts.
    policy = variant.get("policy") or POLICIES.get(np.dtype(dtype).name, "float32")
    with _float64_scope(dtype, param_dtype):
        layer = from_spec(spec, dtype=policy, param_dtype=np.dtype(param_dtype).name)
        layer.build(shape)
    named = {id(getattr(layer, attribute)): name for name, attribute in WEIGHT_ATTRIBUTES.items()}
    order = [(named[id(v)], tuple(v.shape)) for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]
    initial = {
        named[id(v)]: _BRIDGE.to_numpy(keras.ops.convert_to_tensor(v.value))
        for v in layer.trainable_variables
    }

    def fn(x: Any, second: Any = None, **params: Any) -> Any:
        _check_one_dtype(params)
        values = [keras.ops.reshape(params[name], size) for name, size in order]
        if spec.gate is not None:
            return layer.stateless_call(values, frozen, x, gate=second)[0]
        return layer.stateless_call(values, frozen, x, second)[0]

    fn.initial_params = initial  # type: ignore[attr-defined]
    return fn


def _check_one_dtype(params: dict[str, Any]) -> None:
    """NotImplementedError unless all ``params`` have one dtype: a layer holds all its variables
    in one dtype (``param_dtype``)."""
    found = {name: keras.backend.standardize_dtype(v.dtype) for name, v in params.items()}
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in found.items())
        raise NotImplementedError(
            f"normkit.tf layers hold all their variables in one dtype (param_dtype); got {listed}"
        )


def _float64_scope(*kinds: Any) -> contextlib.AbstractContextManager[Any]:
    """On the JAX backend, JAX's 64-bit mode while a float64 layer is built (without it JAX
    makes float64 variables float32)."""
    if not isinstance(_BRIDGE, JaxBridge):
        return contextlib.nullcontext()
    return _BRIDGE.float64_scope(*kinds)


_HARNESS = Harness(_BRIDGE, build, VARIANTS, devices=devices)
evaluate = _HARNESS.evaluate


def support(spec: NormSpec, argument: str | None) -> dict[str, Cell]:
    """What normkit.tf on the current Keras backend does with ``spec`` and the call
    ``argument`` (`normkit.conformance.support`): `from_spec`'s layer called on `PROBE_SHAPE`
    ones; a refusal is ``("no", message)``. One implementation, named ``""``."""
    layer = from_spec(spec)
    name = type(layer).__name__
    if argument is not None and argument not in inspect.signature(layer.call).parameters:
        return {"": ("no", f"normkit.tf.{name}.call takes no {argument}=")}
    layer = from_spec(spec, name=name)
    layer.build(PROBE_SHAPE)
    x = keras.ops.ones(PROBE_SHAPE)
    try:  # the layer's own call: Keras' __call__ would wrap the message in its own
        if spec.gate is not None:
            layer.call(x, gate=x)
        else:
            layer.call(x, x if spec.residual is not None else None)
    except ValueError as exc:
        return {"": ("no", str(exc))}
    return {"": ("yes", "")}
