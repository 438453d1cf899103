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
        raise ValueError(f"{path}: {_mismatch(missing, extra)}")
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


def _mismatch(missing: list[str], extra: list[str]) -> str:
    """Why the file's layers are not the model's, and what to do: a single norm's file (written
    by `save`) is not a model's; paths that differ by a prefix come from another module."""
    if extra == [""]:
        where = f"the model's norm {missing[0]!r}" if len(missing) == 1 else "a model's norm"
        return (
            "the file holds a single norm (written by port.save), not a model's norms by path: "
            f"to load it into {where}, read it with port.load(path, to=...) and set that layer's "
            "parameters; port.export_norms writes a model's norms by path"
        )
    found = (
        f"the model's {missing} are not in the file, the file's {extra} are not in the model"
    )
    for a, b, whose in ((extra, missing, "file's"), (missing, extra, "model's")):
        prefix = _common_prefix(a, b)
        if prefix:
            return (
                f"the file's norm layers do not match the model's: {found}; every {whose} path "
                f"has the prefix {prefix!r} that the other's lack: export and import the same "
                "module (paths are attribute paths from it, see docs/porting.md)"
            )
    return (
        f"the file's norm layers do not match the model's: {found} (paths are attribute paths "
        "from the module exported and imported, see docs/porting.md)"
    )


def _common_prefix(longer: list[str], shorter: list[str]) -> str:
    """The prefix every path of ``longer`` has over the one of ``shorter`` it ends with, when
    it is one and the same for all (and they pair up one to one), else ""."""
    if not longer or len(longer) != len(shorter):
        return ""
    prefixes = set()
    for path in longer:
        ends = [p for p in shorter if path.endswith("." + p)]
        if len(ends) != 1:
            return ""
        prefixes.add(path[: -len(ends[0])])
    return prefixes.pop() if len(prefixes) == 1 else ""
