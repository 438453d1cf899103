"""Conformance hook for Flax's built-in norm modules, linen and nnx (see `peers`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx

from normkit.bridges import FrameworkFn, JaxBridge
from normkit.conformance.harness import Harness
from normkit.spec import NormSpec

LAYERS = ("flax.linen.RMSNorm", "flax.linen.LayerNorm", "flax.nnx.RMSNorm", "flax.nnx.LayerNorm")
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS}


def build(
    spec: NormSpec, shape: tuple[int, ...], param_dtype: np.dtype, *, dtype: np.dtype,
    device: str, layer: str,
) -> FrameworkFn:
    """The built-in ``layer`` over the last axis of the input, with float32 params (Flax's
    default)."""
    del spec, param_dtype, dtype, device  # the peer is what it is; the bridge places the arrays
    return peer_function(layer, shape[-1])


def peer_function(layer: str, n: int) -> FrameworkFn:
    """``fn(x, scale, bias)``: the built-in ``layer`` of size ``n`` with those parameters."""
    framework, _, kind = layer.removeprefix("flax.").partition(".")
    if framework == "linen":
        module = getattr(nn, kind)()

        def apply(x: Any, params: dict[str, Any]) -> Any:
            return module.apply({"params": params}, x)

    elif framework == "nnx":
        graphdef, _ = nnx.split(getattr(nnx, kind)(n, rngs=nnx.Rngs(0)))

        def apply(x: Any, params: dict[str, Any]) -> Any:
            return nnx.merge(graphdef, nnx.State({k: nnx.Param(v) for k, v in params.items()}))(x)

    else:
        raise ValueError(f"unknown Flax peer {layer!r}")
    has = {"scale", "bias"} if kind == "LayerNorm" else {"scale"}  # the defaults of both APIs

    def fn(x: Any, scale: Any = None, bias: Any = None) -> Any:
        return apply(
            x, {k: v for k, v in (("scale", scale), ("bias", bias)) if v is not None and k in has}
        )

    return fn


_HARNESS = Harness(JaxBridge(), build, VARIANTS)
devices, evaluate, identify = _HARNESS.devices, _HARNESS.evaluate, _HARNESS.identify
