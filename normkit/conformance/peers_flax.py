"""Conformance hook for Flax's built-in norm modules, linen and nnx (see `peers`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx

from normkit.conformance import Identification
from normkit.conformance import identify as identify_fn
from normkit.conformance.bridges import FrameworkFn, JaxBridge, Outputs
from normkit.spec import NormSpec

BRIDGE = JaxBridge()
devices = BRIDGE.devices


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    layer: str,
) -> Outputs:
    """``(y, dx, dscale, dbias)`` of the built-in ``layer`` with float32 params (Flax's default)."""
    return BRIDGE.vjp(peer_function(layer, x.shape[-1]), x, dy, scale, bias, device)


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

    def fn(x: Any, scale: Any, bias: Any) -> Any:
        return apply(x, {k: v for k, v in (("scale", scale), ("bias", bias)) if v is not None and k in has})

    return fn


def identify(*, layer: str, n: int = 64, device: str = "cpu") -> Identification:
    """What the built-in ``layer`` computes, probed with float32 parameters."""
    return identify_fn(peer_function(layer, n), (n,), backend="jax", params=True, device=device)
