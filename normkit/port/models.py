"""Whole models: every normkit norm layer's parameters and spec, keyed by its path in the model.

The path of a layer is the chain of attribute names from the model to it, joined by ``"."``,
with list and tuple positions as decimal indices: ``model.layers[0].input_layernorm`` is
``"layers.0.input_layernorm"``. torch's ``named_modules`` and Flax NNX's ``iter_modules`` give
these paths; for Keras, normkit walks the layer's public attributes the same way (the layers of a
``Sequential`` or functional model by their ``name``). The same architecture written with the
same attribute names in two frameworks therefore has the same paths.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from normkit.port.convert import convert
from normkit.port.files import load_norms
from normkit.spec import NormSpec

__all__ = ["export_norms", "import_norms", "plan_import"]


def export_norms(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write every normkit norm layer of ``model`` (a torch ``nn.Module``, a Keras layer or
    model, or a Flax NNX module) to ``path``, keyed by its path in the model; see
    `normkit.port.load_norms` for the file. For a Flax linen model use
    `normkit.port.flax.export_linen_norms`. Returns the path written."""
    return _framework(model).export_norms(model, path)


def import_norms(model: Any, path: str | os.PathLike[str]) -> list[str]:
    """Load the norms in ``path`` into ``model``'s normkit norm layers, matched by path, in place.

    Every layer of the model must be in the file and every layer of the file in the model, with
    the same spec up to ``scale_offset`` (the scale is then converted, see `convert`) and the
    same parameter shapes; otherwise ValueError naming the layers. Returns the paths loaded.
    """
    return _framework(model).import_norms(model, path)


def plan_import(
    path: str | os.PathLike[str],
    model_norms: Mapping[str, tuple[NormSpec, tuple[int, ...]]],
    convention: str,
) -> dict[str, dict[str, np.ndarray]]:
    """The parameters in ``path`` for each of ``model_norms`` (``{path: (spec, param shape)}``),
    named in ``convention`` and converted to each layer's spec; ValueError on any mismatch."""
    layers = load_norms(path, to=convention)
    missing = sorted(set(model_norms) - set(layers))
    extra = sorted(set(layers) - set(model_norms))
    if missing or extra:
        raise ValueError(
            f"{path}: the file's norm layers do not match the model's: the model's {missing} are "
            f"not in the file, the file's {extra} are not in the model (paths are attribute "
            "paths, see docs/porting.md)"
        )
    planned = {}
    for name, (spec, shape) in model_norms.items():
        params, file_spec = layers[name]
        try:
            converted = convert(params, file_spec, src=convention, dst=convention, dst_spec=spec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: layer {name!r}: {err}") from None
        for param, value in converted.items():
            if value.shape != tuple(shape):
                raise ValueError(
                    f"{path}: layer {name!r}: {param!r} has shape {value.shape} in the file, the "
                    f"model's has {tuple(shape)}"
                )
        planned[name] = converted
    return planned


def _framework(model: Any) -> Any:
    """The ``normkit.port`` module for ``model``'s framework, found without importing any."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        from normkit.port import torch as framework
    elif "keras" in sys.modules and isinstance(model, sys.modules["keras"].layers.Layer):
        from normkit.port import keras as framework
    elif "flax.nnx" in sys.modules and isinstance(model, sys.modules["flax.nnx"].Module):
        from normkit.port import flax as framework
    else:
        raise TypeError(
            f"export_norms/import_norms take a torch nn.Module, a Keras layer or a Flax NNX "
            f"module, got {type(model).__module__}.{type(model).__name__} (for Flax linen use "
            "normkit.port.flax.export_linen_norms / import_linen_norms)"
        )
    return framework
