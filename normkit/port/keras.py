"""Keras 3 models: export or import the parameters of their normkit norm layers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras

from normkit import dtypes
from normkit.port.files import save_norms
from normkit.port.plan import plan_import
from normkit.spec import NormSpec
from normkit.tf.layers import WEIGHT_ATTRIBUTES

__all__ = ["export_norms", "import_norms", "named_layers", "norm_layers"]

def norm_layers(model: keras.layers.Layer) -> dict[str, keras.layers.Layer]:
    """The normkit norm layers in ``model`` by path (see `normkit.port.models`): every layer
    with a `NormSpec` ``spec``, DyT included.

    ValueError if one is not built yet (call the model once so its weights exist).
    """
    found = {}
    for path, layer in named_layers(model).items():
        if isinstance(getattr(layer, "spec", None), NormSpec):
            if not layer.built:
                raise ValueError(
                    f"{path or '<root>'}: the layer is not built, so it has no weights yet; call "
                    "the model on an input first"
                )
            found[path] = layer
    return found


def named_layers(model: keras.layers.Layer) -> dict[str, keras.layers.Layer]:
    """Every layer in ``model``, itself included (``""``), by path (see `normkit.port.models`)."""
    return dict(_walk(model, "", set()))


def _walk(obj: Any, path: str, seen: set[int]) -> Iterator[tuple[str, keras.layers.Layer]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield path, obj
    for name, child in _children(obj):
        yield from _walk(child, f"{path}.{name}" if path else name, seen)


def _children(obj: keras.layers.Layer) -> Iterator[tuple[str, keras.layers.Layer]]:
    if isinstance(obj, keras.Sequential) or type(obj).__name__ == "Functional":
        for layer in obj.layers:
            yield layer.name, layer
        return
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, keras.layers.Layer):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, keras.layers.Layer):
                    yield f"{name}.{i}", item


def export_norms(model: keras.layers.Layer, path: str | os.PathLike[str]) -> Path:
    """Write every normkit norm of ``model`` (attribute paths, keras convention)."""
    layers = {
        name: (_weights(layer), layer.spec) for name, layer in norm_layers(model).items()
    }
    return save_norms(path, layers, convention="keras")


def import_norms(model: keras.layers.Layer, path: str | os.PathLike[str]) -> list[str]:
    """Load ``path`` into ``model``'s normkit norms in place; see `normkit.port.import_norms`."""
    norms = norm_layers(model)
    shapes = {name: (layer.spec, _shape(layer)) for name, layer in norms.items()}
    planned = plan_import(path, shapes, "keras")
    for name, params in planned.items():
        for param, value in params.items():
            variable = getattr(norms[name], WEIGHT_ATTRIBUTES[param])
            variable.assign(dtypes.round_to(value, variable.dtype))
    return list(planned)


def _weights(layer: keras.layers.Layer) -> dict[str, Any]:
    """The layer's weights by the files' parameter names."""
    found = {name: getattr(layer, attribute) for name, attribute in WEIGHT_ATTRIBUTES.items()}
    return {name: v for name, v in found.items() if v is not None}


def _shape(layer: keras.layers.Layer) -> tuple[int, ...]:
    weights = [v for n, v in _weights(layer).items() if n != "alpha"]
    return tuple(weights[0].shape) if weights else ()
