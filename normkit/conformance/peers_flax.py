"""Conformance hook for Flax's built-in norm modules, linen and nnx (see `peers`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx

from normkit.backends import FrameworkFn, Outputs
from normkit.bridges import JaxBridge
from normkit.conformance.peers import refuse_extras
from normkit.conformance.targets import check_variant
from normkit.identify import Identification
from normkit.identify import identify as identify_fn
from normkit.spec import NormSpec

LAYERS = ("flax.linen.RMSNorm", "flax.linen.LayerNorm", "flax.nnx.RMSNorm", "flax.nnx.LayerNorm")
VARIANTS: dict[str, tuple[object, ...] | None] = {"layer": LAYERS}
BRIDGE = JaxBridge()
devices = BRIDGE.devices


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
) -> Outputs:
    """``(y, dx, dscale, dbias)`` of the built-in ``layer`` with float32 params (Flax's default)."""
    check_variant(variant, VARIANTS)
    refuse_extras(residual, dh, alpha)
    layer = str(variant["layer"])
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
        return apply(
            x, {k: v for k, v in (("scale", scale), ("bias", bias)) if v is not None and k in has}
        )

    return fn


def identify(*, layer: str, n: int = 64, device: str = "cpu") -> Identification:
    """What the built-in ``layer`` computes, probed with float32 parameters."""
    return identify_fn(peer_function(layer, n), (n,), backend="jax", params=True, device=device)
