"""The conventions of an mlx-lm directory's norms, found by loading it with mlx-lm and probing
its norm modules.

mlx-lm's loader (`mlx_lm.utils.load_model`) builds the model class the config names and runs the
class's ``sanitize`` on the stored weights before loading them; some classes change norm
weights there (mlx-lm's Qwen3-Next and Qwen3.5 add 1 to their RMSNorm weights when the
checkpoint looks unconverted). So a stored tensor's convention is the module's (probed with
`normkit.identify.identify_forward` through numpy, in float32: kind, eps, offset) plus what
``sanitize`` added to it, measured by comparing the loaded weight with the stored one.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from normkit.identify import identify_forward, identify_gated_forward
from normkit.spec import NormSpec

__all__ = ["MlxNorm", "probe_mlx_directory"]


@dataclass(frozen=True)
class MlxNorm:
    """One parameter of an mlx-lm norm module: the module's class, the spec it computes (None
    and ``reason`` when the probe fails) and what the loader's ``sanitize`` added to the stored
    values (``loaded``: the parameter as loaded)."""

    module: str
    spec: NormSpec | None
    loaded: np.ndarray
    reason: str = ""


def probe_mlx_directory(path: str | os.PathLike[str]) -> dict[str, MlxNorm]:
    """``{parameter name: MlxNorm}`` for the ``weight`` and ``bias`` of every norm module of the
    mlx-lm model in ``path`` (loaded lazily, as mlx-lm loads it)."""
    model, _ = load_model(Path(path), lazy=True)
    found: dict[str, MlxNorm] = {}
    probed: dict[tuple[Any, ...], tuple[NormSpec | None, str]] = {}
    for name, module in model.named_modules():
        if "norm" not in type(module).__name__.lower() or module.children():
            continue
        params = {p: module[p] for p in ("weight", "bias") if isinstance(module.get(p), mx.array)}
        if not params:
            continue
        key = (type(module), tuple(params["weight" if "weight" in params else "bias"].shape),
               tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, float))),
               getattr(module, "eps", None), tuple(params))
        if key not in probed:
            probed[key] = _probe(module, params)
        spec, reason = probed[key]
        for param, value in params.items():
            loaded = np.array(value.astype(mx.float32))
            found[f"{name}.{param}" if name else param] = MlxNorm(
                type(module).__name__, spec, loaded, reason
            )
    return found


def _probe(module: Any, params: dict[str, Any]) -> tuple[NormSpec | None, str]:
    """The spec ``module`` computes (its own weight and bias restored afterwards)."""
    shape = next(iter(params.values())).shape
    n = int(np.prod(shape))
    signature = inspect.signature(module.__call__)
    extra = list(signature.parameters.values())[1:]
    gated = bool(extra) and extra[0].default is inspect.Parameter.empty
    try:
        if gated:
            found = identify_gated_forward(_forward(module, params, gated=True), n,
                                           accepts_params=True, dtypes=("float32",))
        else:
            found = identify_forward(_forward(module, params, gated=False), n,
                                     accepts_params=True, dtypes=("float32",))
    except Exception as exc:  # foreign code: any failure means "not recognised"
        return None, f"identify: {type(exc).__name__}: {exc}"
    finally:
        for param, value in params.items():
            module[param] = value
    return found.spec, ""


def _forward(module: Any, params: dict[str, Any], gated: bool) -> Callable[..., np.ndarray]:
    """``forward(x, scale, bias)`` (gated: ``forward(x, z, scale, bias)``) on numpy arrays,
    computed by ``module`` in float32 with ``scale`` and ``bias`` as its parameters."""

    def as_mx(value: np.ndarray) -> mx.array:
        return mx.array(np.asarray(value, np.float32))

    def forward(x: np.ndarray, *rest: np.ndarray | None) -> np.ndarray:
        z, (scale, bias) = (rest[0], rest[1:]) if gated else (None, rest)
        for param, value in (("weight", scale), ("bias", bias)):
            if param in params and value is not None:
                module[param] = as_mx(value.reshape(params[param].shape))
        y = module(as_mx(x)) if z is None else module(as_mx(x), as_mx(z))
        return np.array(y.astype(mx.float32)).astype(x.dtype)

    return forward
