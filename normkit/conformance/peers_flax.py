"""Conformance hook for Flax's built-in norm modules, linen and nnx (see `peers`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from normkit import dtypes
from normkit.spec import NormSpec

__all__ = ["devices", "evaluate"]


def devices() -> list[str]:
    """``"cpu"``, then ``"<platform>:<id>"`` for each accelerator JAX sees."""
    return ["cpu"] + [f"{d.platform}:{d.id}" for d in jax.devices() if d.platform != "cpu"]


def _apply(layer: str, n: int) -> Callable[[jax.Array, dict[str, jax.Array]], jax.Array]:
    kind = layer.rsplit(".", 1)[-1]
    if layer.startswith("flax.linen."):
        module = getattr(nn, kind)()
        return lambda x, p: module.apply({"params": p}, x)
    if layer.startswith("flax.nnx."):
        graphdef, _ = nnx.split(getattr(nnx, kind)(n, rngs=nnx.Rngs(0)))
        return lambda x, p: nnx.merge(graphdef, nnx.State({k: nnx.Param(v) for k, v in p.items()}))(x)
    raise ValueError(f"unknown Flax peer {layer!r}")


def _numpy(a: Any) -> np.ndarray:
    return np.asarray(a).astype(dtypes.as_float_dtype(a.dtype))


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    device: str = "cpu",
    layer: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dscale, dbias)`` of the built-in ``layer``, jitted, float32 params (Flax's default)."""
    platform, _, index = device.partition(":")
    target = jax.devices(platform)[int(index or 0)]
    params = {k: v for k, v in (("scale", scale), ("bias", bias)) if v is not None}
    apply = _apply(layer, x.shape[-1])

    @jax.jit
    def run(x: jax.Array, p: dict[str, jax.Array], dy: jax.Array) -> Any:
        y, pullback = jax.vjp(apply, x, p)
        return y, *pullback(dy.astype(y.dtype))

    y, dx, grads = run(*jax.device_put((x, params, dy), target))
    return _numpy(y), _numpy(dx), *(_numpy(grads[k]) if k in grads else None for k in ("scale", "bias"))  # type: ignore[return-value]
