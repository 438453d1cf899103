"""Loading a norms file into a model: the file's parameters matched to the model's norm layers.

Each framework's module (`normkit.port.torch`, `.keras`, `.flax`) lists its model's norms and
assigns what `plan_import` returns; the matching and the checks are here, once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from normkit.port.convert import ALPHA, ALPHA_SHAPE, convert
from normkit.port.files import load_norms
from normkit.spec import NormSpec

__all__ = ["plan_import"]


def plan_import(
    path: str | os.PathLike[str],
    model_norms: Mapping[str, tuple[NormSpec, tuple[int, ...]]],
    convention: str,
) -> dict[str, dict[str, np.ndarray]]:
    """The parameters in ``path`` for each of ``model_norms`` (``{path: (spec, param shape)}``,
    the shape of ``w`` and ``b``; DyT's ``alpha`` is ``(1,)``), named in ``convention`` and
    converted to each layer's spec (``scale_offset`` only); ValueError on any mismatch."""
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
            want = ALPHA_SHAPE if param == ALPHA else tuple(shape)
            if value.shape != want:
                raise ValueError(
                    f"{path}: layer {name!r}: {param!r} has shape {value.shape} in the file, the "
                    f"model's has {want}"
                )
        planned[name] = converted
    return planned
