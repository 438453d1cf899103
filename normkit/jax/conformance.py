"""The conformance hook: run a normkit.jax layer on numpy inputs, forward and backward.

float64 cases run with JAX's 64-bit mode enabled only for the duration of `evaluate` (the
scoped ``jax.enable_x64`` context), so they are computed and returned in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import normkit.jax as nkjax
from normkit import reference
from normkit.bridges import JaxBridge
from normkit.conformance.targets import check_variant
from normkit.jax import functional
from normkit.spec import NormSpec

__all__ = ["APIS", "VARIANTS", "devices", "evaluate"]

Api = Literal["linen", "nnx", "functional"]
APIS: tuple[Api, ...] = ("linen", "nnx", "functional")
VARIANTS: dict[str, tuple[object, ...] | None] = {"api": APIS}


_BRIDGE = JaxBridge()
devices = _BRIDGE.devices


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``spec``'s layer applied to ``x`` on ``device`` under ``jax.jit``, and its VJP with ``dy``.

    Args:
      spec: the norm.
      x: the input, float16, bfloat16, float32 or float64.
      dy: the output cotangent, of ``x``'s shape and dtype.
      scale: ``w`` in the parameter dtype; None: the layer's initial value (float32).
      bias: ``b``; None: zeros (float32).
      device: one of `devices` (``gpu:N`` is read as ``cuda:N``).
      variant: ``api=`` ``"linen"`` (`normkit.jax.from_spec`, the default), ``"nnx"``
        (`normkit.jax.nnx.from_spec`) or
        ``"functional"`` (`normkit.jax.functional.normalize`).

    Returns:
      ``(y, dx, dscale, dbias)`` as numpy arrays in the dtypes JAX produced; ``dscale`` and
      ``dbias`` are None when the spec has no such parameter.
    """
    check_variant(variant, VARIANTS)
    api: Api = variant.get("api", "linen")
    x, dy = np.asarray(x), np.asarray(dy)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(
            f"dy has shape {dy.shape} and dtype {dy.dtype}; expected x's, {x.shape} and {x.dtype}"
        )
    target = _BRIDGE.device(device)
    reference.check_params(x.shape, spec, scale, bias)
    shape = spec.param_shape(x.shape)
    params: dict[str, np.ndarray] = {}
    for name, value, present, init in (
        ("scale", scale, spec.scale, spec.scale_init),
        ("bias", bias, spec.bias, 0.0),
    ):
        if present:
            params[name] = np.full(shape, init, np.float32) if value is None else np.asarray(value)
    x64 = jax.enable_x64(True) if x.dtype == np.float64 else contextlib.nullcontext()
    with x64:
        apply = _apply_fn(spec, shape, params, api)

        @jax.jit
        def run(x: jax.Array, params: Any, dy: jax.Array) -> tuple[jax.Array, Any, Any]:
            y, vjp = jax.vjp(apply, x, params)
            dx, dparams = vjp(dy)
            return y, dx, dparams

        y, dx, dparams = run(*jax.device_put((x, params, dy), target))
        grads = {name: np.asarray(value) for name, value in dparams.items()}
        return np.asarray(y), np.asarray(dx), grads.get("scale"), grads.get("bias")


def _apply_fn(
    spec: NormSpec, shape: tuple[int, ...], params: dict[str, np.ndarray], api: Api
) -> Callable[[jax.Array, dict[str, jax.Array]], Any]:
    """``(x, params) -> y`` for ``api``, with ``params`` a dict of ``scale``/``bias`` arrays."""
    param_dtype = next(iter(params.values())).dtype if params else jnp.float32
    if api == "functional":
        return lambda x, p: functional.normalize(x, spec, p.get("scale"), p.get("bias"))
    if api == "linen":
        module = nkjax.from_spec(spec, param_dtype=param_dtype)
        return lambda x, p: module.apply({"params": p}, x)
    graphdef = nnx.graphdef(nkjax.nnx.from_spec(spec, shape, param_dtype=param_dtype))

    def apply_nnx(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
        return nnx.merge(graphdef, state)(x)

    return apply_nnx
