"""Conformance hook for Flax's built-in norm modules, linen and nnx (see `peers`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx

from normkit.conformance.bridges import JaxBridge, Outputs
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
    framework, _, kind = layer.removeprefix("flax.").partition(".")
    if framework == "linen":
        module = getattr(nn, kind)()

        def fn(x: Any, scale: Any, bias: Any) -> Any:
            params = {k: v for k, v in (("scale", scale), ("bias", bias)) if v is not None}
            return module.apply({"params": params}, x)

    elif framework == "nnx":
        graphdef, _ = nnx.split(getattr(nnx, kind)(x.shape[-1], rngs=nnx.Rngs(0)))

        def fn(x: Any, scale: Any, bias: Any) -> Any:
            params = {k: nnx.Param(v) for k, v in (("scale", scale), ("bias", bias)) if v is not None}
            return nnx.merge(graphdef, nnx.State(params))(x)

    else:
        raise ValueError(f"unknown Flax peer {layer!r}")
    return BRIDGE.vjp(fn, x, dy, scale, bias, device)
