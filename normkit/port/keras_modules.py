"""Keras norm layers straight from a norms file: no model to mirror the file's layers."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from normkit.port.files import load_norms
from normkit.tf.layers import WEIGHT_ATTRIBUTES, from_spec

__all__ = ["norms_from_file"]


def norms_from_file(path: str | os.PathLike[str], **kwargs: Any) -> dict[str, keras.layers.Layer]:
    """Every layer of the norms file ``path`` as a built normkit Keras layer (`from_spec` of its
    spec, ``param_dtype`` the file's), keyed by its path in the file, its weights the file's.
    ``kwargs`` go to the layers (``dtype``: the dtype policy). The layers normalize the
    trailing axes the spec names; a spec over other axes is refused (ValueError)."""
    layers: dict[str, keras.layers.Layer] = {}
    for name, (params, spec) in load_norms(path, to="keras").items():
        shaped = [v for p, v in params.items() if p != "alpha"]
        shape = tuple(shaped[0].shape) if shaped else (1,) * np.size(spec.axis)
        trailing = tuple(range(-len(shape), 0))
        if sorted(np.atleast_1d(spec.axis).tolist()) != list(trailing):
            raise ValueError(
                f"{path}: layer {name!r} normalizes axis {spec.axis}: the loader builds layers "
                "for the trailing axes only; build it with normkit.tf.from_spec instead"
            )
        dtype = next(iter(params.values())).dtype.name if params else None
        layer = from_spec(spec.replace(axis=trailing), param_dtype=dtype, **kwargs)
        layer.build((None, *shape))
        for param, value in params.items():
            getattr(layer, WEIGHT_ATTRIBUTES[param]).assign(value)
        layers[name] = layer
    return layers
