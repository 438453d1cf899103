"""The conformance hook: run a `normkit.tf` layer forward and backward on numpy inputs.

It runs on the current Keras backend (`keras_backend`); the cross-framework runner starts one
process per ``KERAS_BACKEND``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from normkit import reference
from normkit.bridges import (
    Bridge,
    JaxBridge,
    TensorFlowBridge,
    TorchBridge,
    device_index,
    device_name,
)
from normkit.conformance.targets import check_variant
from normkit.spec import NormSpec
from normkit.tf.layers import WEIGHT_ATTRIBUTES, from_spec

__all__ = ["POLICIES", "VARIANTS", "devices", "evaluate", "keras_backend"]

VARIANTS: dict[str, tuple[object, ...] | None] = {"jit": (True, False), "policy": None}
POLICIES = {
    "float16": "mixed_float16", "bfloat16": "mixed_bfloat16",
    "float32": "float32", "float64": "float64",
}
"""The dtype policy `evaluate` picks for an input dtype: its compute dtype is the input's, so
Keras' autocast leaves ``x`` as it is (the mixed policies keep float32 variables)."""
_BRIDGES: dict[str, Bridge] = {
    "tensorflow": TensorFlowBridge(), "jax": JaxBridge(), "torch": TorchBridge(),
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
    return _BRIDGES[backend]


def devices() -> list[str]:
    """The devices the current backend sees: ``"cpu"``, then ``"cuda:0"``, ``"cuda:1"``, ..."""
    return [d for d in _bridge().devices() if d == "cpu" or d.startswith("cuda:")]


def _keras_device(name: str) -> str:
    """Keras' name for a normkit device name: ``cpu:0``, ``gpu:N``."""
    kind, index = device_index(name)
    return f"{'gpu' if kind == 'cuda' else kind}:{index}"


def _param_dtype(spec: NormSpec, params: dict[str, np.ndarray | None]) -> str | None:
    """The variables' dtype: that of the parameters given (None: the policy's). A layer holds
    all its variables in one dtype; parameters of several dtypes raise NotImplementedError."""
    found = {name: np.asarray(v).dtype.name for name, v in params.items() if v is not None}
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in found.items())
        raise NotImplementedError(
            f"normkit.tf layers hold all their variables in one dtype (param_dtype); got {listed}"
        )
    return next(iter(found.values()), None)


def _check_extended(
    spec: NormSpec,
    x: np.ndarray,
    residual: np.ndarray | None,
    dh: np.ndarray | None,
    alpha: np.ndarray | None,
) -> None:
    """ValueError unless residual and dh are given exactly when the spec has a residual, and
    alpha only for DyT, of shape () or (1,)."""
    if (residual is None) != (spec.residual is None) or (dh is None) != (spec.residual is None):
        raise ValueError(
            f"residual and dh are given exactly when the spec has a residual; the spec has "
            f"residual={spec.residual!r}, residual given: {residual is not None}, dh given: "
            f"{dh is not None}"
        )
    for name, value in (("residual", residual), ("dh", dh)):
        if value is not None and np.shape(value) != np.shape(x):
            raise ValueError(
                f"{name} has shape {np.shape(value)}, expected the shape of x, {np.shape(x)}"
            )
    if alpha is not None:
        if spec.kind != "dyt":
            raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
        if np.shape(alpha) not in ((), (1,)):
            raise ValueError(f"alpha has shape {np.shape(alpha)}, expected (1,)")


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    residual: np.ndarray | None = None,
    dh: np.ndarray | None = None,
    alpha: np.ndarray | None = None,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray | None, ...]:
    """``from_spec(spec)`` at ``x`` forward, and its VJP with the cotangents ``dy`` (and ``dh``).

    Returns ``(y, dx, dscale, dbias)``, then ``(h, dresidual)`` when ``spec.residual`` is set,
    then ``(dalpha,)`` for ``kind="dyt"``: numpy arrays in the dtypes the backend produced, None
    for weights the spec lacks. The backward is that of ``sum(dy * y) + sum(dh * h)``.

    Args:
      spec: the norm.
      x: the input, float16, bfloat16, float32 or float64.
      dy: the cotangent of the output, of ``x``'s shape (cast to the output's dtype).
      scale, bias: the weights ``w`` and ``b`` (None: their initial values).
      residual, dh: the residual added to ``x`` and the cotangent of ``h`` (cast to ``h``'s
        dtype), given exactly when ``spec.residual`` is set.
      alpha: DyT's ``alpha``, shape ``(1,)`` (None: ``spec.alpha_init``); ``dalpha`` has its
        shape.
      device: one of `devices()` (``gpu:N`` is read as ``cuda:N``).
      **variant: ``jit=True`` runs under ``tf.function(jit_compile=True)`` (TensorFlow) or
        ``jax.jit`` (JAX); the torch backend has no jit variant. ``policy=`` a Keras dtype policy
        name; ``x`` is cast to its compute dtype first, and the outputs are in it. Without it the
        policy is ``x``'s own (`POLICIES`: ``mixed_bfloat16`` for bfloat16, ...), under which
        the layer computes the spec on ``x`` as given.

    The variables take the dtype of the parameters given (``param_dtype``); when none is, the
    policy's, or float32 under the policy chosen from ``x``. Parameters of different dtypes
    raise NotImplementedError.
    """
    check_variant(variant, VARIANTS)
    device = device_name(device)
    if device not in devices():
        raise ValueError(
            f"device {device!r} is not seen by the {keras_backend()} backend: {devices()}"
        )
    jit = bool(variant.get("jit", False))
    backend = keras_backend()
    if jit and backend == "torch":
        raise ValueError("the torch Keras backend has no jit variant (jit=True)")
    if np.shape(dy) != np.shape(x):
        raise ValueError(f"dy has shape {np.shape(dy)}, expected the shape of x, {np.shape(x)}")
    reference.check_params(np.shape(x), spec, scale, bias)
    _check_extended(spec, x, residual, dh, alpha)
    params = {"scale": scale, "bias": bias, "alpha": alpha}
    param_dtype = _param_dtype(spec, params)
    policy = variant.get("policy")
    if not policy:
        # Other dtypes run under float32, where the layer names what it accepts.
        policy = POLICIES.get(np.asarray(x).dtype.name, "float32")
        param_dtype = param_dtype or "float32"

    framework = _bridge()
    with _float64_scope(backend, x), keras.device(_keras_device(device)):
        given = [np.asarray(a) for a in (x, dy, residual, dh) if a is not None]
        inputs = [framework.to_tensor(a, device) for a in given]
        layer = from_spec(spec, dtype=policy, param_dtype=param_dtype)
        layer.build(tuple(inputs[0].shape))
        for name, attribute in WEIGHT_ATTRIBUTES.items():
            variable, value = getattr(layer, attribute), params[name]
            if value is not None:
                assert variable is not None  # checked above: the spec has this parameter
                array = np.asarray(value).reshape(tuple(variable.shape))
                variable.assign(framework.to_tensor(array, device))
        vjp = {"tensorflow": _vjp_tensorflow, "jax": _vjp_jax}.get(backend, _vjp_torch)
        primals, grads = vjp(layer, jit)(*inputs)
    found = [
        None if variable is None else grads[_position(layer, variable)]
        for variable in (layer.gamma, layer.beta, layer.alpha)
    ]
    outputs = [primals[0], grads[0], found[0], found[1]]
    if spec.residual is not None:
        outputs += [primals[1], grads[1]]
    if spec.kind == "dyt":
        outputs.append(found[2])
    arrays = [None if t is None else framework.to_numpy(t) for t in outputs]
    if spec.kind == "dyt" and alpha is not None:
        arrays[-1] = arrays[-1].reshape(np.shape(alpha))  # type: ignore[union-attr]
    return tuple(arrays)


def _float64_scope(backend: str, x: np.ndarray) -> contextlib.AbstractContextManager[Any]:
    """For a float64 ``x`` on the JAX backend, JAX's 64-bit mode (scoped, as `normkit.jax`'s
    hook does): without it JAX computes float64 arrays in float32."""
    if backend != "jax" or np.asarray(x).dtype != np.float64:
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)


def _position(layer: Any, variable: Any) -> int:
    """Where ``variable``'s gradient is in a VJP's result: after the inputs' (x and residual)."""
    skip = 2 if layer.spec.residual is not None else 1
    return skip + [v is variable for v in layer.trainable_variables].index(True)


def _split(layer: Any, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(primal inputs, cotangents)``: ``([x], [dy])`` or ``([x, residual], [dy, dh])``."""
    return (inputs[0::2], inputs[1::2]) if len(inputs) == 4 else ([inputs[0]], [inputs[1]])


def _vjp_tensorflow(layer: Any, jit: bool) -> Callable[..., tuple[list[Any], list[Any]]]:
    """The VJP of ``layer`` on ``(x, dy[, residual, dh])``; with ``jit`` one
    ``tf.function(jit_compile=True)``, traced once per input signature."""
    import tensorflow as tf

    def vjp(*inputs: Any) -> tuple[list[Any], list[Any]]:
        primals, cotangents = _split(layer, list(inputs))
        with tf.GradientTape() as tape:
            for t in primals:
                tape.watch(t)
            out = layer(*primals)
        outs = list(out) if isinstance(out, tuple) else [out]
        cotangents = [tf.cast(c, o.dtype) for c, o in zip(cotangents, outs, strict=True)]
        grads = tape.gradient(
            outs, [*primals, *layer.trainable_variables], output_gradients=cotangents
        )
        return outs, grads

    return tf.function(vjp, jit_compile=True) if jit else vjp


def _vjp_jax(layer: Any, jit: bool) -> Callable[..., tuple[list[Any], list[Any]]]:
    """The VJP of ``layer`` on ``(x, dy[, residual, dh])`` at its variables' current values;
    with ``jit`` one `jax.jit`, traced once per input signature."""
    import jax

    def vjp(trainable: list[Any], frozen: list[Any], *inputs: Any) -> tuple[list[Any], list[Any]]:
        primals, cotangents = _split(layer, list(inputs))

        def f(trainable: list[Any], *primals: Any) -> list[Any]:
            out = layer.stateless_call(trainable, frozen, *primals)[0]
            return list(out) if isinstance(out, tuple) else [out]

        outs, pullback = jax.vjp(f, trainable, *primals)
        grads = pullback([c.astype(o.dtype) for c, o in zip(cotangents, outs, strict=True)])
        return outs, [*grads[1:], *grads[0]]

    compiled = jax.jit(vjp) if jit else vjp

    def run(*inputs: Any) -> tuple[list[Any], list[Any]]:
        trainable = [v.value for v in layer.trainable_variables]
        frozen = [v.value for v in layer.non_trainable_variables]
        return compiled(trainable, frozen, *inputs)

    return run


def _vjp_torch(layer: Any, jit: bool) -> Callable[..., tuple[list[Any], list[Any]]]:
    """The VJP of ``layer`` on ``(x, dy[, residual, dh])`` at its variables' current values."""
    import torch

    del jit  # refused by evaluate: the torch backend has no jit variant

    def run(*inputs: Any) -> tuple[list[Any], list[Any]]:
        primals, cotangents = _split(layer, list(inputs))
        primals = [t.detach().requires_grad_(True) for t in primals]
        trainable = [
            v.value.detach().clone().requires_grad_(True) for v in layer.trainable_variables
        ]
        frozen = [v.value for v in layer.non_trainable_variables]
        out = layer.stateless_call(trainable, frozen, *primals)[0]
        outs = list(out) if isinstance(out, tuple) else [out]
        cotangents = [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)]
        grads = torch.autograd.grad(outs, [*primals, *trainable], cotangents)
        return [o.detach() for o in outs], list(grads)

    return run
