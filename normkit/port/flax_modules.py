"""Flax norm modules straight from a norms file: NNX modules, or linen modules with their
variables; no model to mirror the file's layers."""

from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from normkit.jax import linen as nklinen
from normkit.jax import nnx as nknnx
from normkit.port.files import load_norms

__all__ = ["linen_norms_from_file", "nnx_norms_from_file"]


def nnx_norms_from_file(path: str | os.PathLike[str], **kwargs: Any) -> dict[str, nnx.Module]:
    """Every layer of the norms file ``path`` as a normkit NNX module (`normkit.jax.nnx.
    from_spec` of its spec, ``param_dtype`` the file's), keyed by its path in the file, its
    parameters the file's. ``kwargs`` go to ``from_spec`` (``dtype``, ``rngs``)."""
    modules: dict[str, nnx.Module] = {}
    for name, (params, spec) in load_norms(path, to="flax").items():
        shape, dtype = _shape_dtype(params, np.size(spec.axis))
        module = nknnx.from_spec(spec, shape, param_dtype=dtype, **kwargs)
        for param, value in params.items():
            getattr(module, param).set_value(jnp.asarray(value))
        modules[name] = module
    return modules


def linen_norms_from_file(
    path: str | os.PathLike[str], **kwargs: Any
) -> dict[str, tuple[nn.Module, dict[str, Any]]]:
    """Every layer of the norms file ``path`` as ``(module, variables)``: a normkit linen
    module (`normkit.jax.linen.from_spec`, ``param_dtype`` the file's) and its variables
    ``{"params": {...}}`` holding the file's parameters, for ``module.apply(variables, x)``."""
    modules: dict[str, tuple[nn.Module, dict[str, Any]]] = {}
    for name, (params, spec) in load_norms(path, to="flax").items():
        _, dtype = _shape_dtype(params, np.size(spec.axis))
        module = nklinen.from_spec(spec, param_dtype=dtype, **kwargs)
        variables = {"params": {p: jnp.asarray(v) for p, v in params.items()}}
        modules[name] = (module, variables)
    return modules


def _shape_dtype(params: dict[str, Any], axes: int) -> tuple[tuple[int, ...], Any]:
    shaped = [v for p, v in params.items() if p != "alpha"]
    shape = tuple(shaped[0].shape) if shaped else (1,) * axes
    return shape, (next(iter(params.values())).dtype if params else jnp.float32)
