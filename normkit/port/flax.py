"""Flax models: export or import the parameters of their normkit norm layers.

NNX modules are walked with `flax.nnx.iter_modules` (attribute paths, list positions as
indices). A linen model is a module and its variables; its norm layers are found by running it
once on example inputs, and their paths are their scope names joined by ``"."``, with the
``_<i>`` that linen appends to the elements of a list attribute written ``.<i>``
(``layers_0`` -> ``layers.0``), so they match the torch, Keras and NNX paths.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from normkit import dtypes
from normkit.port.files import save_norms
from normkit.port.plan import plan_import
from normkit.spec import NormSpec

__all__ = [
    "export_norms", "import_norms", "linen_norms", "export_linen_norms", "import_linen_norms",
]

_PARAMS = ("scale", "bias", "alpha")
_LIST_ITEM = re.compile(r"^(.+)_(\d+)$")


def _nnx_norms(model: nnx.Module) -> dict[str, Any]:
    return {
        ".".join(str(part) for part in path): module
        for path, module in nnx.iter_modules(model)
        if _is_norm(module)
    }


def _is_norm(module: Any) -> bool:
    """A normkit norm layer: one with a `NormSpec` ``spec`` (DyT included)."""
    return isinstance(getattr(module, "spec", None), NormSpec)


def _params(module: Any) -> dict[str, Any]:
    return {n: v for n in _PARAMS if (v := getattr(module, n, None)) is not None}


def _shape(module: Any) -> tuple[int, ...]:
    """The shape of the layer's ``w`` and ``b``."""
    present = [v for n, v in _params(module).items() if n != "alpha"]
    return tuple(present[0].shape) if present else tuple(getattr(module, "shape", ()))


def export_norms(model: nnx.Module, path: str | os.PathLike[str]) -> Path:
    """Write every normkit norm of the NNX ``model`` (attribute paths, flax convention)."""
    layers = {name: (_params(m), m.spec) for name, m in _nnx_norms(model).items()}
    return save_norms(path, layers, convention="flax")


def import_norms(model: nnx.Module, path: str | os.PathLike[str]) -> list[str]:
    """Load ``path`` into the NNX ``model``'s normkit norms in place; see
    `normkit.port.import_norms`."""
    norms = _nnx_norms(model)
    planned = plan_import(path, {name: (m.spec, _shape(m)) for name, m in norms.items()}, "flax")
    for name, params in planned.items():
        for param, value in params.items():
            variable = getattr(norms[name], param)
            variable.set_value(_as_jax(value, variable.get_value().dtype))
    return list(planned)


def linen_norms(
    module: nn.Module, variables: Mapping[str, Any], *args: Any, **kwargs: Any
) -> dict[str, tuple[tuple[str, ...], NormSpec]]:
    """The normkit norm layers a linen ``module`` calls on ``args``: ``{path: (scope path, spec)}``.

    The module runs once under `jax.eval_shape` (nothing is computed).
    """
    found: dict[str, tuple[tuple[str, ...], NormSpec]] = {}

    def record(next_fun: Any, call_args: Any, call_kwargs: Any, context: Any) -> Any:
        norm = context.module
        # The method first: reading ``spec`` calls the module's own methods, intercepted too.
        if context.method_name == "__call__" and _is_norm(norm):
            scope = tuple(str(p) for p in norm.path)
            found[".".join(_LIST_ITEM.sub(r"\1.\2", p) for p in scope)] = (scope, norm.spec)
        return next_fun(*call_args, **call_kwargs)

    def run() -> Any:
        with nn.intercept_methods(record):
            return module.apply(variables, *args, **kwargs)

    jax.eval_shape(run)
    return found


def export_linen_norms(
    module: nn.Module,
    variables: Mapping[str, Any],
    path: str | os.PathLike[str],
    *args: Any,
    **kwargs: Any,
) -> Path:
    """Write the normkit norms a linen ``module`` with ``variables`` calls on ``args``."""
    layers = {
        name: (_params(_Lookup(variables["params"], scope)), spec)
        for name, (scope, spec) in linen_norms(module, variables, *args, **kwargs).items()
    }
    return save_norms(path, layers, convention="flax")


def import_linen_norms(
    module: nn.Module,
    variables: Mapping[str, Any],
    path: str | os.PathLike[str],
    *args: Any,
    **kwargs: Any,
) -> dict[str, Any]:
    """``variables`` with the norms in ``path`` loaded into the normkit norms the linen
    ``module`` calls on ``args`` (a new tree; linen variables are immutable)."""
    norms = linen_norms(module, variables, *args, **kwargs)
    shapes = {}
    for name, (scope, spec) in norms.items():
        shapes[name] = (spec, _shape(_Lookup(variables["params"], scope)))
    planned = plan_import(path, shapes, "flax")
    params = dict(variables["params"])
    for name, values in planned.items():
        node = params
        for part in norms[name][0]:
            node[part] = dict(node[part])
            node = node[part]
        for param, value in values.items():
            node[param] = _as_jax(value, node[param].dtype)
    return {**variables, "params": params}


class _Lookup:
    """The ``scale``/``bias`` of a linen norm at ``scope`` in a params tree, as attributes."""

    def __init__(self, params: Mapping[str, Any], scope: tuple[str, ...]) -> None:
        node: Any = params
        for part in scope:
            node = node[part]
        self.scale = node.get("scale")
        self.bias = node.get("bias")
        self.alpha = node.get("alpha")


def _as_jax(value: Any, dtype: Any) -> jax.Array:
    return jnp.asarray(dtypes.round_to(value, str(jnp.dtype(dtype))))
